"""deepspeed-zero3-ac: a per-invocation parameter lifecycle for DeepSpeed ZeRO-3 under activation checkpointing."""

from zero3_ac.activation import DISABLE_ENV, apply, is_active, remove
from zero3_ac.runtime.zero.accounting import STEP_LOG_ENV, set_step_logging
from zero3_ac.utils.z3_leaf_module import set_gather_units
from zero3_ac.version_guard import SUPPORTED_RANGE, UnsupportedDeepSpeedVersion

__version__ = "0.1.0"

__all__ = ["apply", "remove", "is_active", "lifecycle_stats", "set_gather_units", "set_step_logging", "DISABLE_ENV",
           "STEP_LOG_ENV", "SUPPORTED_RANGE", "UnsupportedDeepSpeedVersion", "__version__"]


def lifecycle_stats(engine):
    """Accounting of a ZeRO-3 engine under the fork, or None when the engine runs stock.

    Returns a dict with ``last_step`` and ``current`` step counters (gathered numel/bytes/params
    by phase and frozen/trainable, re-gathered params/bytes, drained and swept params, peak
    gathered bytes; see ``zero3_ac/runtime/zero/accounting.py``) and totals over finished steps.
    """
    from zero3_ac.runtime.zero.parameter_offload import lifecycle_hooks
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    hooks = lifecycle_hooks(offload) if offload is not None else None
    if hooks is None:
        return None
    accounting = hooks.accounting
    return {
        "current": accounting.current.as_dict(),
        "last_step": accounting.last_step.as_dict() if accounting.last_step else None,
        "total_drained_params": accounting.total_drained_params,
        "total_swept_params": accounting.total_swept_params,
        "total_regathered_params": accounting.total_regathered_params,
        "steps": accounting.steps,
        "bookkeeping": hooks.bookkeeping_size(),
    }
