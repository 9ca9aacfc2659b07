"""A gather unit's gradients enter ZeRO-3's reduce bucket together: extends upstream ``stage3.py``
(``reduce_independent_p_g_buckets_and_remove_grads``, ``__add_grad_to_ipg_bucket``).

The rules are invocation_lifecycle's ``GradientBatch`` (Note: [A unit's gradients enter the reduce
bucket together]). Here they meet the optimizer: which params are batched, and the move itself,
which does what upstream's ``__add_grad_to_ipg_bucket`` does for each param (the gradient copied
into the bucket's flat buffer, the old gradient recorded on the reduce stream, ``param.grad``
made a view of the buffer, the param appended to the bucket) for a run of params at once: one
wait for the compute stream, one stream switch, one ``torch._foreach_copy_``. A param that the run
cannot take goes through upstream's own per-param path, which reduces the bucket first where it
must: its bucket would overflow, it belongs to another partition group than the bucket's
(0.19.8+), its gradient is not ready (``ds_grad_is_ready``) or is missing.

Batched: the trainable params of the model's gather units (``is_gather_unit``), but not those of a
user's ZeRO-3 leaf (the leaf's backward hook reduces them), not a param under two units, and not a
unit whose trainable elements exceed ``reduce_bucket_size``. Nothing is batched with
``contiguous_gradients`` off, with ZenFlow, or with AutoEP's folded tensor parallelism (which
correct each gradient before it enters the bucket), nor while ``coalesce_grad_reduction`` defers
all reduction to its end.
"""

import collections

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import z3_leaf_parameter
from torch._utils import _unflatten_dense_tensors

from zero3_ac.runtime.zero.invocation_lifecycle import GradientBatch
from zero3_ac.utils import module_tree
from zero3_ac.utils.z3_leaf_module import is_gather_unit, markings

_ATTR = "_zero3_ac_unit_gradients"
BUCKETED = "_zero3_ac_bucketed_this_backward"  # ds_id -> the gradient a bucket holds (see stage3_gradients)


class _Member:
    """Static facts of one batched param."""
    __slots__ = ("unit", "index", "size", "comm_dtype", "group")

    def __init__(self, unit, index, size, comm_dtype, group):
        self.unit, self.index, self.size, self.comm_dtype, self.group = unit, index, size, comm_dtype, group


def _batching_applies(optimizer) -> bool:
    return (getattr(optimizer, "parameter_offload", None) is not None and optimizer.contiguous_gradients
            and not getattr(optimizer, "zenflow", False) and getattr(optimizer, "autoep_folding_spec", None) is None)


def _members(optimizer) -> dict:
    """``ds_id`` -> ``_Member`` for every batched param."""
    trainable = {}
    for group in optimizer.fp16_groups:
        for param in group:
            if param.requires_grad and not z3_leaf_parameter(param):
                if param.ds_id in trainable:
                    return {}  # ids that do not tell params apart: batch nothing
                trainable[param.ds_id] = param
    partition_group = getattr(optimizer, "_get_param_partition_group", None)
    units = [[param for param in module.parameters() if trainable.get(getattr(param, "ds_id", None)) is param]
             for module in optimizer.parameter_offload.module.modules() if is_gather_unit(module)]
    under = collections.Counter(param.ds_id for params in units for param in params)
    members = {}
    for unit, params in enumerate(units):
        params = [param for param in params if under[param.ds_id] == 1]
        if not params or sum(param.ds_numel for param in params) > optimizer.reduce_bucket_size:
            continue
        for index, param in enumerate(params):
            members[param.ds_id] = _Member(unit, index, len(params), optimizer.get_param_comm_dtype(param),
                                           partition_group(param) if partition_group is not None else None)
    return members


class UnitGradients:
    """One optimizer's batch of unit gradients, and the move of a batch into its buckets."""

    def __init__(self, optimizer, reduce_alone):
        self._optimizer = optimizer
        self._reduce_alone = reduce_alone  # upstream's per-param path (with the fork's wrapper around it)
        self._key = (module_tree.generation(), markings())
        self._members = _members(optimizer)
        self._batch = GradientBatch()

    def stale(self) -> bool:
        return self._key != (module_tree.generation(), markings())

    def keep(self, param) -> bool:
        """``param``'s gradient arrived: whether the batch keeps it (else the caller reduces it alone,
        after whatever was pending has moved)."""
        member = self._members.get(param.ds_id)
        bucketed = self._optimizer.__dict__.get(BUCKETED)
        if member is None or (bucketed and param.ds_id in bucketed):
            self.flush()
            return False
        moved = self._batch.arrive(param, member.unit, member.index, member.size)
        if moved:
            self._move(moved)
        return True

    def flush(self) -> None:
        """Move whatever is pending (before anything else enters a bucket, and at the end of a backward)."""
        if self._batch.pending:
            self._move(self._batch.take())

    def discard(self) -> None:
        self._batch.take()

    @torch.no_grad()
    def _move(self, params) -> None:
        optimizer = self._optimizer
        limit = optimizer.reduce_bucket_size
        run, run_bucket, run_elements, run_group = [], None, 0, None
        for param in params:
            member = self._members[param.ds_id]
            bucket = optimizer.ipg_buckets[member.comm_dtype]
            if bucket is not run_bucket and run:
                self._copy_run(run_bucket, run, run_elements, run_group)
                run, run_elements = [], 0
            run_bucket = bucket
            group = run_group if run else (getattr(bucket, "process_group", None) if bucket.params else None)
            grad = param.grad
            if (grad is None or bucket.buffer is None or not getattr(param, "ds_grad_is_ready", True)
                    or grad.numel() != param.ds_numel or bucket.elements + run_elements + param.ds_numel > limit
                    or (group is not None and member.group is not None and group != member.group)):
                if run:
                    self._copy_run(bucket, run, run_elements, run_group)
                    run, run_elements = [], 0
                self._reduce_alone(param)
                continue
            run.append(param)
            run_elements += param.ds_numel
            run_group = member.group
        if run:
            self._copy_run(run_bucket, run, run_elements, run_group)

    def _copy_run(self, bucket, run, elements, group) -> None:
        optimizer = self._optimizer
        accelerator = get_accelerator()
        grads = [param.grad for param in run]
        if not accelerator.resolves_data_dependency():
            optimizer.reduce_and_partition_stream.wait_stream(accelerator.current_stream())
        with accelerator.stream(optimizer.reduce_and_partition_stream):
            # Views of the bucket's buffer shaped as the gradients, made in one call.
            views = _unflatten_dense_tensors(bucket.buffer.narrow(0, bucket.elements, elements), grads)
            torch._foreach_copy_(views, grads, non_blocking=True)
            if not accelerator.is_synchronized_device():
                reduce_stream = accelerator.current_stream()
                for grad in grads:
                    grad.record_stream(reduce_stream)
            for grad, view in zip(grads, views):
                grad.data = view
        bucket.params.extend(run)
        bucket.elements += elements
        if group is not None:
            bucket.process_group = group
        bucketed = optimizer.__dict__.setdefault(BUCKETED, {})
        for param, view in zip(run, views):
            bucketed[param.ds_id] = view


def unit_gradients(optimizer, reduce_alone, stock):
    """The optimizer's ``UnitGradients``, or None where nothing is batched (see the module's docstring);
    a param that a batch cannot take goes to ``reduce_alone(optimizer, stock, param)``."""
    batches = optimizer.__dict__.get(_ATTR, _ATTR)
    if batches is _ATTR:
        usable = _batching_applies(optimizer) and module_tree.generation() is not None
        batches = optimizer.__dict__[_ATTR] = (UnitGradients(
            optimizer, lambda param: reduce_alone(optimizer, stock, param)) if usable else None)
    return batches


def end_of_backward(optimizer) -> None:
    """Move what is pending before upstream's epilogue reduces the buckets; forget stale facts."""
    batches = optimizer.__dict__.get(_ATTR)
    if batches is not None:
        batches.flush()
        if batches.stale():
            del optimizer.__dict__[_ATTR]


def discard(optimizer) -> None:
    """A backward raised: its pending gradients are dropped with the rest of the window."""
    batches = optimizer.__dict__.get(_ATTR)
    if batches is not None:
        batches.discard()
