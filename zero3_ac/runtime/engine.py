"""``DeepSpeedEngine`` setups that the per-invocation lifecycle leaves to stock ZeRO-3, the one it
refuses, the config it reads, and the forward prologue's walk of every module, cached: extends upstream
``engine.py``.

Note: [Engines left to stock]
    Two ZeRO-3 setups own the params in ways the lifecycle cannot share:
    - DeepCompile (``compile.deepcompile``): ``engine.compile()`` removes ZeRO-3's module hooks
      (the fork's among them) and gathers and releases params from passes over the compiled graph;
    - ZenFlow (``zero_optimization.zenflow``): see [ZenFlow keeps params transposed between its hooks].
    Such an engine runs stock ZeRO-3, whole: the fork stands aside for it, logs so once, and every
    other engine of the process, created before or after it, keeps the lifecycle.

    The decision is made once per engine, in ``_configure_zero_optimizer``, before the engine's
    ``DeepSpeedZeRoOffload`` registers its module hooks; both setups are in the config by then
    (DeepCompile's too, although it only acts at ``engine.compile()``: by then the fork's hooks and
    gather units would be on every module, and undoing them is not safe). ``stock_engines`` records
    it on the offload, the optimizer and the params, and each patched method that can tell which
    engine it serves runs upstream's code for such an engine:
    - the hooks' registration is upstream's (no gather units are marked, no lifecycle is created),
      so ``release_backward_leftovers``, ``partition_all_parameters``, ``initialize_ds_offload``
      and ``lifecycle_stats`` find no lifecycle and do what stock does;
    - the gradient-partition wrappers (``stage3_gradients``) call upstream's directly;
    - ZeRO-3's linear (forward and ``apply``) runs upstream's for a weight of such an engine.
    The other patches change no result of any engine: ``print_rank_0`` prints what it printed,
    ``current_stream`` returns the same stream, ``iter_params`` the same params, NVTX ranges are
    off (``engine.compile()`` turns them off itself), and a read of a borrowed param records
    nothing for modules without the fork's hooks. A linear whose weight is computed from params
    (not a param) takes the fork's path in every engine; its values are the same.

    What remains refused: DeepCompile on an engine that runs the lifecycle, which only a
    ``compile.deepcompile`` switched on after ``deepspeed.initialize`` reaches.
"""

import contextlib

from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
from deepspeed.utils import logger

from zero3_ac.runtime.zero import stock_engines
from zero3_ac.runtime.zero.parameter_offload import lifecycle_hooks
from zero3_ac.utils import module_tree
from zero3_ac.utils.z3_leaf_module import remember_config_setting

_MODULES_WALK_CACHE_ATTR = "_zero3_ac_modules_walk"
_FLAGGED_DICTS_ATTR = "_zero3_ac_forward_flag_dicts"


class UnsupportedSetup(RuntimeError):
    """A DeepSpeed feature that cannot be combined with the fork's ZeRO-3 lifecycle."""


def _runs_the_lifecycle(engine) -> bool:
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    return offload is not None and lifecycle_hooks(offload) is not None


def reason_to_leave_to_stock(engine):
    """Why ``engine`` (ZeRO-3) runs stock ZeRO-3 under the fork, or None (see [Engines left to stock]).

    Note: [ZenFlow keeps params transposed between its hooks]
        With ZenFlow, upstream's ``pre_sub_module_forward_function`` and
        ``pre_sub_module_backward_function`` transpose each fetched param's data, and the
        ``post_sub_module_*`` functions transpose it back before the release. The lifecycle
        gathers through the ``pre_`` functions but releases params itself, at other times than a
        module's end, and never calls the ``post_`` ones: params would be released transposed.
    """
    if engine.is_deepcompile_enabled():
        return "DeepCompile (compile.deepcompile) replaces ZeRO-3's module hooks at engine.compile()"
    if getattr(engine, "zenflow", False):
        return "ZenFlow (zero_optimization.zenflow) transposes params between ZeRO-3's module hooks"
    return None


def compile(engine, stock, *args, **kwargs):
    """Wraps ``DeepSpeedEngine.compile``: DeepCompile on an engine that runs the lifecycle is refused.

    An engine configured with DeepCompile runs stock from ``initialize`` on (see [Engines left to
    stock]); one that runs the lifecycle has the fork's hooks and gather units on every module, and
    DeepCompile would silently take over from them. Plain ``torch.compile`` (no
    ``compile.deepcompile``) keeps the hooks and is supported.
    """
    if engine.is_deepcompile_enabled() and _runs_the_lifecycle(engine):
        raise UnsupportedSetup(
            "zero3_ac: DeepCompile (compile.deepcompile=true) was switched on after deepspeed.initialize created "
            "this engine with the per-invocation ZeRO-3 lifecycle, whose module hooks DeepCompile would replace. "
            "Either set compile.deepcompile=true in the config passed to deepspeed.initialize (the fork then "
            "leaves that engine to stock ZeRO-3), or keep it false (plain engine.compile() works with the fork).")
    return stock(engine, *args, **kwargs)


def configure_zero_optimizer(engine, stock, *args, **kwargs):
    """Wraps ``DeepSpeedEngine._configure_zero_optimizer``: decides whether a ZeRO-3 engine runs the
    lifecycle, and passes the config's gather units to the hooks' registration if it does."""
    if not engine.zero_optimization_partition_weights():
        return stock(engine, *args, **kwargs)
    reason = reason_to_leave_to_stock(engine)
    stock_engines.mark(engine.module.parameters(), left=reason is not None)
    if reason is None:
        remember_config_setting(engine.module, engine._config._param_dict)
        return stock(engine, *args, **kwargs)
    logger.warning(f"zero3_ac: {reason}, so this engine runs stock ZeRO-3; other engines keep the "
                   "per-invocation lifecycle.")
    with stock_engines.configuring_stock_engine():
        return stock(engine, *args, **kwargs)


def _flagged_dicts(root, modules):
    """Each module's ``ZeROOrderedDict`` in walk order, while every module of ``modules`` still has the
    one it had when the list was made; None if one does not have one (upstream's loop gives it one)."""
    cached = root.__dict__.get(_FLAGGED_DICTS_ATTR)
    if cached is None or cached[0] is not modules:
        dicts = [module._parameters for module in modules]
        if not all(isinstance(params, ZeROOrderedDict) for params in dicts):
            root.__dict__.pop(_FLAGGED_DICTS_ATTR, None)
            return None
        cached = root.__dict__[_FLAGGED_DICTS_ATTR] = (modules, dicts)
    for module, params in zip(modules, cached[1]):
        if module._parameters is not params:
            root.__dict__.pop(_FLAGGED_DICTS_ATTR, None)
            return None
    return cached[1]


@contextlib.contextmanager
def _root_modules_from_cached_walk(engine, in_forward: bool):
    """While it is open, ``engine.module.modules()`` answers from the cached walk, or answers nothing
    once every module's ``_in_forward`` is set here (see [The engine's walk of every module at each
    root forward])."""
    root = engine.module
    if not _runs_the_lifecycle(engine) or "modules" in root.__dict__:
        yield
        return
    modules = module_tree.cached_walk(root, _MODULES_WALK_CACHE_ATTR, lambda module: module.modules())
    dicts = None if engine.flops_profiler_enabled() else _flagged_dicts(root, modules)
    if dicts is not None:
        for params in dicts:
            params._in_forward = in_forward
        modules = ()
    root.__dict__["modules"] = lambda: iter(modules)
    try:
        yield
    finally:
        root.__dict__.pop("modules", None)


def forward_prologue(engine, stock, *args, **kwargs):
    """Wraps ``DeepSpeedEngine._forward_prologue``: upstream's, with its walk of every module cached.

    Note: [The engine's walk of every module at each root forward]
        With params partitioned, upstream's forward prologue walks ``self.module.modules()`` to set
        ``_in_forward`` on every module's ``ZeROOrderedDict`` (a read of another module's param inside
        the forward then registers it as that module's external param), and the epilogue walks it
        again to reset the flag. That is two walks of every module per root forward: about 2,700
        modules and 53,000 generator resumptions per step for an 8B LoRA model, since ``modules()``
        runs ``named_modules``, which builds every module's prefixed name. Both methods run
        unchanged; while they run, the root's ``modules`` is an instance attribute that answers from
        the list cached by ``module_tree`` (see [Module trees that change shape]). Once every module
        of that list has a ``ZeROOrderedDict`` (upstream's loop gives one to a module that has none,
        ``ensure_zero_ordered_dict``, 0.19.3+), the wrapper sets the flag on each of them from a list
        of those dicts, the one store per module that upstream's loop would make, and ``modules``
        answers nothing, so the loop has nothing left to do. Otherwise ``modules`` answers the cached
        modules, in the same order, and upstream's loop visits each. A module attached after
        ``initialize`` (``setattr``, ``add_module``) renews the list; a module whose ``_parameters``
        was replaced sends that forward through upstream's loop. With the flops profiler on (its
        profile starts in the prologue) upstream's loop always runs. Engines left to stock walk as
        stock does.
    """
    with _root_modules_from_cached_walk(engine, in_forward=True):
        return stock(engine, *args, **kwargs)


def forward_epilogue(engine, stock, *args, **kwargs):
    """Wraps ``DeepSpeedEngine._forward_epilogue``: see [The engine's walk of every module at each root forward]."""
    with _root_modules_from_cached_walk(engine, in_forward=False):
        return stock(engine, *args, **kwargs)
