"""Setups of ``DeepSpeedEngine`` that the per-invocation lifecycle refuses: extends upstream ``engine.py``."""

from zero3_ac.runtime.zero.parameter_offload import lifecycle_hooks


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
