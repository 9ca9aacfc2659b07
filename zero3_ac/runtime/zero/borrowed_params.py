"""Where a module reads a param it borrows: extends upstream ``parameter_offload.py``'s getter.

Reading a partitioned param inside the engine's forward from outside its owner (a module reading
a child's ``weight``) makes upstream's ``ZeROOrderedDict.__getitem__`` gather it and register it as
an external param of the module on top of ZeRO-3's module stack: the module *borrows* it (Note:
[Params the getter gathers]). This file records where each borrowed param was read.

Note: [Borrows inside a checkpointed region]
    A borrowing module's backward slot holds the param like its own, because the module's code may
    use it in an op whose backward comes after the owner's backward (``test_borrowed_params.py``).
    When every read of a frozen borrowed param in the call happened inside the forward of torch's
    non-reentrant checkpoint regions, the module's code has no other reference to it than the
    ones those regions' recomputes make again: a region's forward saves nothing, its recompute
    re-runs the reads and records the ops that use the param, and those ops keep the param's tensor
    referenced until their backward has run (autograd_context's [Which region a read belongs to,
    and when its recompute is done]). So once each of those regions has been recomputed in the
    running backward (or its graph is gone) and nothing references the param's tensor, the borrow
    can end, and the param is released at its last consumer, as upstream's two prompt-release
    tests ask. A read anywhere else (outside a region, inside a region we do not recognise, with
    the param trainable) keeps the borrow to the end of the slot, as stock does.

    The first read gathers the param through the getter, and the fork sees it in
    ``register_external_parameter``. Later steps find the param gathered by the borrower's own
    fetch (it is an external param now), so the getter registers nothing; the owner's parameter
    dict is then given a ``__getitem__`` that reports reads from outside the owner. Only owners of
    borrowed frozen params get it: every other param read costs what it costs in stock.
"""

import weakref

from deepspeed.runtime.zero import parameter_offload as upstream
from deepspeed.runtime.zero import partition_parameters

from zero3_ac.runtime.zero import autograd_context
from zero3_ac.runtime.zero.zero_ordered_dict import LifecycleParameters

_OUTSIDE_A_REGION = object()  # a read outside any recognised checkpoint region's forward
_reads_of_module = weakref.WeakKeyDictionary()  # module -> the BorrowReads of the engine that registered it


class BorrowReads:
    """Per engine: where borrowed params were read since the last drain."""

    def __init__(self):
        self._reads = {}  # param -> [weakref to a checkpoint frame, or _OUTSIDE_A_REGION]

    def attach(self, module) -> None:
        """``module`` belongs to this engine (called at registration, for every module)."""
        _reads_of_module[module] = self

    def record(self, param) -> None:
        if autograd_context.in_backward():
            return  # a recompute re-runs a read recorded in the forward
        frame = autograd_context.running_checkpoint_region()
        self._reads.setdefault(param, []).append(_OUTSIDE_A_REGION if frame is None else weakref.ref(frame))

    def scope(self, param):
        """The regions a borrow of ``param`` ends with, or None when it must last to the slot's end."""
        reads = self._reads.get(param)
        if not reads or param.requires_grad or _OUTSIDE_A_REGION in reads:
            return None
        return tuple(reads)

    def clear(self) -> None:
        self._reads.clear()


def scope_is_over(param, frames) -> bool:
    """Whether a lent borrow of ``param`` read in the regions of ``frames`` can end now."""
    if param.requires_grad or not autograd_context.referenced_only_by_itself(param):
        return False
    for ref in frames:
        frame = ref()
        if frame is not None and not autograd_context.recompute_done_and_consumed(frame, param):
            return False
    return True


class _ReadReportingParameters(LifecycleParameters):
    """An owner's parameter dict that reports reads made from outside the owner's forward."""

    def __getitem__(self, key):
        param = super().__getitem__(key)
        if param is not None and self._in_forward:
            stack = upstream.FWD_MODULE_STACK
            if stack and stack[-1] is not self._parent_module:
                reads = _reads_of_module.get(self._parent_module)
                if reads is not None:
                    reads.record(param)
        return param


def report_reads_of(owner) -> None:
    """Make ``owner``'s parameter dict report reads from outside ``owner`` (idempotent)."""
    params = owner._parameters
    if type(params) in (upstream.ZeROOrderedDict, LifecycleParameters):
        params.__class__ = _ReadReportingParameters


def register_external_parameter(module, parameter):
    """Replacement of ``register_external_parameter`` in upstream ``parameter_offload.py``, whose
    getter calls it when a read from outside the owner gathers a param."""
    partition_parameters.register_external_parameter(module, parameter)
    reads = _reads_of_module.get(module)
    if reads is not None and getattr(module._parameters, "_in_forward", False):
        reads.record(parameter)
