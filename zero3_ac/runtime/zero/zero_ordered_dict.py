"""A read of a gathered param costs one frame: extends upstream ``parameter_offload.py``'s
``ZeROOrderedDict.__getitem__``.

Note: [A param read that upstream's getter has nothing to do for]
    ZeRO-3 replaces every module's ``_parameters`` with a ``ZeROOrderedDict``, whose ``__getitem__``
    runs at every ``module.weight`` read (``nn.Module.__getattr__`` looks params up there). It acts
    in two cases only: the param is partitioned (``NOT_AVAILABLE``) and the read is in the engine's
    forward (it gathers the param and registers it as external to the module on top of ZeRO-3's
    module stack), or DeepCompile's eager fallback is active (0.19.3+, it records the read). Every
    other read returns the param, after a call of ``torch.compiler.is_compiling``, two ``hasattr``s
    and, in a forward, an import and a call of ``get_active_z3_eager_fallback``: some six calls per
    read, and a LoRA layer reads its weights a hundred times a step.

    The fork's dict returns at once when the param is not partitioned (or not a ZeRO param) and no
    fallback is active, and calls upstream's getter otherwise, so every case that does something
    does what stock does. The fallback is read from the module that owns it (``_ACTIVE_FALLBACK``,
    which ``get_active_z3_eager_fallback`` returns). The dicts of an engine that runs the lifecycle
    get this class when the hooks are registered; a dict made later (``ensure_zero_ordered_dict``
    for a module attached after ``initialize``) keeps upstream's getter, which gives the same
    params.
"""

import importlib

from deepspeed.runtime.zero import parameter_offload as upstream
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


class _NoFallbacks:
    """DeepSpeed before 0.19.3: no DeepCompile eager fallback."""
    _ACTIVE_FALLBACK = None


try:
    _fallbacks = importlib.import_module("deepspeed.compile.z3_eager_fallback")
except ImportError:
    _fallbacks = _NoFallbacks
# A DeepSpeed that keeps its active fallback elsewhere keeps upstream's getter.
_READABLE_FALLBACK = hasattr(_fallbacks, "_ACTIVE_FALLBACK")

_NOT_AVAILABLE = ZeroParamStatus.NOT_AVAILABLE
_stock_getitem = upstream.ZeROOrderedDict.__getitem__
_dict_getitem = dict.__getitem__


class LifecycleParameters(upstream.ZeROOrderedDict):
    """A module's ``ZeROOrderedDict`` whose reads of gathered params skip upstream's checks (see
    [A param read that upstream's getter has nothing to do for])."""

    def __getitem__(self, key):
        param = _dict_getitem(self, key)
        if getattr(param, "ds_status", None) is not _NOT_AVAILABLE and _fallbacks._ACTIVE_FALLBACK is None:
            return param
        return _stock_getitem(self, key)


def use_lifecycle_getter(module) -> None:
    """Give ``module``'s parameter dict the fork's getter, if it has upstream's (idempotent)."""
    if _READABLE_FALLBACK and type(module._parameters) is upstream.ZeROOrderedDict:
        module._parameters.__class__ = LifecycleParameters
