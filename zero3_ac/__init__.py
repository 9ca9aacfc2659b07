"""deepspeed-zero3-ac: a per-invocation parameter lifecycle for DeepSpeed ZeRO-3 under activation checkpointing.

Importing the package is cheap (stdlib only): the names below load their modules, and with them
torch and DeepSpeed, on first use (PEP 562).
"""

import importlib

from zero3_ac.version import __version__

_EXPORTS = {
    "apply": "zero3_ac.activation",
    "remove": "zero3_ac.activation",
    "is_active": "zero3_ac.activation",
    "DISABLE_ENV": "zero3_ac.activation",
    "set_gather_units": "zero3_ac.utils.z3_leaf_module",
    "set_step_logging": "zero3_ac.runtime.zero.accounting",
    "STEP_LOG_ENV": "zero3_ac.runtime.zero.accounting",
    "SUPPORTED_RANGE": "zero3_ac.version_guard",
    "UnsupportedDeepSpeedVersion": "zero3_ac.version_guard",
}

__all__ = [*_EXPORTS, "lifecycle_stats", "__version__"]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zero3_ac' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_EXPORTS})


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
