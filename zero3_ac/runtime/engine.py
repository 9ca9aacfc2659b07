"""Setups of ``DeepSpeedEngine`` that the per-invocation lifecycle refuses, and the config it reads:
extends upstream ``engine.py``."""

from zero3_ac.runtime.zero.parameter_offload import lifecycle_hooks
from zero3_ac.utils.z3_leaf_module import remember_config_setting


class UnsupportedSetup(RuntimeError):
    """A DeepSpeed feature that cannot be combined with the fork's ZeRO-3 lifecycle."""


def _runs_the_lifecycle(engine) -> bool:
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    return offload is not None and lifecycle_hooks(offload) is not None


def compile(engine, stock, *args, **kwargs):
    """Wraps ``DeepSpeedEngine.compile``: DeepCompile and the lifecycle both own ZeRO-3's params.

    DeepCompile removes ZeRO-3's module hooks (the fork's among them) and gathers and releases
    params from passes over the compiled graph, so the lifecycle would silently stop applying.
    Plain ``torch.compile`` (no ``compile.deepcompile``) keeps the hooks and is supported.
    """
    if engine.is_deepcompile_enabled() and _runs_the_lifecycle(engine):
        raise UnsupportedSetup(
            "zero3_ac: DeepCompile (compile.deepcompile=true) replaces the ZeRO-3 module hooks that the "
            "per-invocation lifecycle runs on, so the two cannot be combined. Either set "
            "compile.deepcompile=false in the DeepSpeed config to keep the fork (plain engine.compile() works), "
            "or set ZERO3_AC_DISABLE=1 to run DeepCompile on stock ZeRO-3.")
    return stock(engine, *args, **kwargs)


def configure_zero_optimizer(engine, stock, *args, **kwargs):
    """Wraps ``DeepSpeedEngine._configure_zero_optimizer``: the config's gather units reach the hooks' registration,
    and ZenFlow on ZeRO-3 is refused.

    Note: [ZenFlow keeps params transposed between its hooks]
        With ZenFlow, upstream's ``pre_sub_module_forward_function`` and
        ``pre_sub_module_backward_function`` transpose each fetched param's data, and the
        ``post_sub_module_*`` functions transpose it back before the release. The lifecycle
        gathers through the ``pre_`` functions but releases params itself, at other times than a
        module's end, and never calls the ``post_`` ones: params would be released transposed.
    """
    if engine.zero_optimization_partition_weights():
        remember_config_setting(engine.module, engine._config._param_dict)
    if getattr(engine, "zenflow", False) and engine.zero_optimization_partition_weights():
        raise UnsupportedSetup(
            "zero3_ac: ZenFlow (zero_optimization.zenflow) with ZeRO stage 3 transposes params between ZeRO-3's "
            "module hooks, which the per-invocation lifecycle replaces, so the two cannot be combined. Either "
            "remove zero_optimization.zenflow from the DeepSpeed config to keep the fork, or set "
            "ZERO3_AC_DISABLE=1 to run ZenFlow on stock ZeRO-3.")
    return stock(engine, *args, **kwargs)
