"""ZeRO-3 gradient accumulation when micro-batches use different params, and when one backward
delivers a param's gradient more than once: extends upstream ``runtime/zero/stage3.py``
(``reduce_ready_partitions_and_remove_grads``, ``partition_grads``,
``independent_gradient_partition_epilogue``, ``zero_grad``).

Note: [Micro-step 0 copies, and nothing else clears the gradient partitions]
    ZeRO-3 keeps each param's reduced gradient partition in a flat buffer that lives as long as
    the optimizer. ``partition_grads`` copies a reduced gradient into it at ``micro_step_id == 0``
    and adds to it at later micro-steps; nothing else ever zeroes it. That is right only if every
    trainable param is reduced exactly once in the first micro-step of every accumulation window:

    - a param unused in micro-batch 0 and used later adds its gradient onto the previous
      window's, which the step applies a second time;
    - a param unused in a whole window keeps the previous window's gradient, and the step applies
      it again (plain PyTorch: no gradient, no update; ZeRO 1 and 2: a zero gradient);
    - a param reduced twice in micro-step 0 (Note [A gradient that arrives twice in one backward],
      when the bucket was flushed in between) keeps only its second gradient.

    So data-dependent control flow (routing, optional branches, early exits) trains on wrong
    gradients silently; only the first window is right, because the buffer starts at zero.

    The fork keeps, per window, the set of partitions that hold this window's gradient. A partition
    first written at a later micro-step is zeroed before upstream adds to it; one written again at
    micro-step 0 goes through upstream's accumulate branch; at the end of every backward the
    partitions not written yet in the window are zeroed, so the step, the gradient norm and
    ``safe_get_full_grad`` never see a stale value; ``zero_grad`` (which the engine calls after
    every step) starts a new window. With the optimizer offloaded, upstream also copies a partition
    to the offloaded optimizer's gradient only when it is reduced in the boundary micro-batch; the
    fork runs the others through that copy at the end of the boundary backward. With unmanaged
    accumulation (``managed_gradient_accumulation: false``, 0.19.8+) the boundary is ``step()``:
    upstream copies only the params reduced in the window, and the fork gives the others the same
    zero gradient there, so managed and unmanaged accumulation take the same step.

Note: [A gradient that arrives twice in one backward]
    Reentrant checkpointing backpropagates each region's recomputed graph in a nested backward of
    its own, and torch runs a param's ``AccumulateGrad`` (and the reduce hook ZeRO-3 registers
    after it) once per graph task that reaches the param. A param used in two regions (a reward
    model's chosen and rejected forwards with one summed loss, one block called twice) or in a
    region and outside any (PEFT AdaLoRA's orthogonal regulariser over every adapter after the
    forward) therefore fires its hook twice in one ``engine.backward``. ZeRO-3's hook moves the
    gradient into the reduce bucket (``param.grad.data`` becomes a view of the bucket's buffer)
    and appends the param; the second ``AccumulateGrad`` adds the new gradient into that view in
    place (outside ``create_graph``), and the second hook appends the param again, so the bucket
    holds the sum twice and upstream asserts that a bucket holds distinct params. If the bucket
    was reduced in between, the second gradient is reduced on its own and the window's partition
    must add it (Note [Micro-step 0 copies, and nothing else clears the gradient partitions]).

    The fork lets a hook that fires again for a param still waiting in a bucket leave the bucket
    as it is: the bucketed gradient already holds the sum. Should ``AccumulateGrad`` have replaced
    ``param.grad`` instead of adding in place (a ``create_graph`` backward), the new sum is copied
    back into the bucket's view first. Only the second firing pays: the first is a set lookup.
    Non-reentrant checkpointing needs none of this (one graph task accumulates each param once).

The optimizer of an engine left to stock (Note [Engines left to stock] in ``runtime/engine.py``)
runs upstream's methods unchanged.
"""

import contextlib

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

from zero3_ac.runtime.zero import stage3_unit_gradients
from zero3_ac.runtime.zero.stock_engines import left_to_stock

_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
_WINDOW = "_zero3_ac_window_grad_partitions"
_REDUCED = "_zero3_ac_reduced_this_backward"
_HOLDS_DATA = "_zero3_ac_partition_holds_data"  # ds_id -> whether this rank's gradient partition has elements
_BUCKETED = stage3_unit_gradients.BUCKETED


def _ids(optimizer, attribute) -> set:
    ids = optimizer.__dict__.get(attribute)
    if ids is None:
        ids = optimizer.__dict__[attribute] = set()
    return ids


def _window(optimizer) -> set:
    """``ds_id``s of the params whose gradient partition holds the current window's gradient."""
    return _ids(optimizer, _WINDOW)


def _at_boundary(optimizer) -> bool:
    flag = optimizer.is_gradient_accumulation_boundary  # 0.19.2: an attribute; 0.19.8: a method
    return bool(flag() if callable(flag) else flag)


@contextlib.contextmanager
def _accumulating(optimizer):
    """Upstream's ``partition_grads`` adds instead of copying (it copies at micro-step 0 only)."""
    micro_step_id = optimizer.micro_step_id
    optimizer.micro_step_id = max(micro_step_id, 1)
    try:
        yield
    finally:
        optimizer.micro_step_id = micro_step_id


def _waiting_in_a_bucket(optimizer, param) -> bool:
    return any(waiting is param for bucket in optimizer.ipg_buckets.values() for waiting in bucket.params)


def reduce_ready_partitions_and_remove_grads(optimizer, stock, param):
    """Wraps the reduce hook's body: a gather unit's gradients enter the bucket together
    (stage3_unit_gradients), and a gradient that arrives again for a param still waiting in a
    bucket was summed into the bucketed one (Note [A gradient that arrives twice in one backward])."""
    if left_to_stock(optimizer) or getattr(optimizer, "_coalesce_grad_reduction", False):
        return stock(optimizer, param)
    batches = stage3_unit_gradients.unit_gradients(optimizer, _reduce_alone, stock)
    if batches is not None and batches.keep(param):
        return None
    return _reduce_alone(optimizer, stock, param)


def _reduce_alone(optimizer, stock, param):
    bucketed = optimizer.__dict__.setdefault(_BUCKETED, {})
    earlier = bucketed.get(param.ds_id)
    if earlier is not None and _waiting_in_a_bucket(optimizer, param):
        if param.grad is not None and param.grad.data_ptr() != earlier.data_ptr():
            earlier.copy_(param.grad)
            param.grad.data = earlier
        return None
    result = stock(optimizer, param)
    if any(bucket.params and bucket.params[-1] is param for bucket in optimizer.ipg_buckets.values()):
        bucketed[param.ds_id] = param.grad.detach()
    return result


def partition_grads(optimizer, stock, params_to_release, grad_partitions):
    """Wraps ``partition_grads``: each partition sums the gradients it gets in the window."""
    if left_to_stock(optimizer):
        return stock(optimizer, params_to_release, grad_partitions)
    window = _window(optimizer)
    pairs = list(zip(params_to_release, grad_partitions))
    fresh = [(param, grad) for param, grad in pairs if param.ds_id not in window]
    again = [(param, grad) for param, grad in pairs if param.ds_id in window]
    window.update(param.ds_id for param in params_to_release)
    _ids(optimizer, _REDUCED).update(param.ds_id for param in params_to_release)
    bucketed = optimizer.__dict__.get(_BUCKETED)
    if bucketed:
        for param in params_to_release:
            bucketed.pop(param.ds_id, None)
    if optimizer.micro_step_id != 0:
        partitions = getattr(optimizer, _GRAD_PARTITIONS)
        for param, _ in fresh:
            partitions[param.ds_id].zero_()
        return stock(optimizer, params_to_release, grad_partitions)
    if not again:
        return _copy_into_partitions(optimizer, stock, params_to_release, grad_partitions)
    buffers = list(_copy_into_partitions(optimizer, stock, [param for param, _ in fresh], [grad for _, grad in fresh]))
    with _accumulating(optimizer):
        buffers += stock(optimizer, [param for param, _ in again], [grad for _, grad in again]) or []
    return buffers


def _copy_into_partitions(optimizer, stock, params, grad_partitions):
    """Upstream's ``partition_grads`` at micro-step 0 without optimizer offload, with one copy for all
    the partitions instead of a ``copy_`` and a no-op ``.to`` per param.

    Every release from 0.18.5 to 0.19.8 does this per param there: a param whose partition on this rank
    holds no element (``partition_numel() * partition rank >= ds_numel``) only loses its gradient;
    the others (0.19.5+: recorded in ``_offload_boundary_param_ids``) have the reduced gradient copied
    into their partition of the flat gradient buffer, which the returned list holds narrowed, and
    their gradient recorded on the current stream and dropped. Offload goes to upstream's.
    """
    if optimizer.offload_optimizer:
        return stock(optimizer, params, grad_partitions) or []
    partitions = getattr(optimizer, _GRAD_PARTITIONS)
    active = getattr(optimizer, "_offload_boundary_param_ids", None)
    holds_data = _partition_holds_data(optimizer)
    buffers, sources, reduced = [], [], []
    for param, grad in zip(params, grad_partitions):
        if not holds_data(param):
            param.grad = None
            continue
        if active is not None:
            active.add(param.ds_id)
        buffers.append(partitions[param.ds_id].narrow(0, 0, grad.numel()))
        sources.append(grad)
        reduced.append(param)
    if buffers:
        torch._foreach_copy_(buffers, sources, non_blocking=True)
    accelerator = get_accelerator()
    stream = None if accelerator.is_synchronized_device() else accelerator.current_stream()
    for param in reduced:
        if stream is not None and param.grad is not None:
            param.grad.record_stream(stream)
        param.grad = None
    return buffers


def _partition_holds_data(optimizer):
    """Whether a param's gradient partition on this rank holds an element: fixed per param, asked once."""
    known = optimizer.__dict__.get(_HOLDS_DATA)
    if known is None:
        known = optimizer.__dict__[_HOLDS_DATA] = {}
    rank_of = getattr(optimizer, "_get_param_partition_rank", None)  # 0.19.3+; before, the data-parallel rank

    def holds_data(param):
        answer = known.get(param.ds_id)
        if answer is None:
            rank = rank_of(param) if rank_of is not None else dist.get_rank(optimizer.dp_process_group)
            answer = known[param.ds_id] = param.partition_numel() * rank < param.ds_numel
        return answer

    return holds_data


def independent_gradient_partition_epilogue(optimizer, stock):
    """Wraps the end-of-backward epilogue: pending unit gradients enter their buckets first;
    partitions not written in this window yet are zero."""
    if left_to_stock(optimizer):
        return stock(optimizer)
    stage3_unit_gradients.end_of_backward(optimizer)
    stock(optimizer)
    window = _window(optimizer)
    partitions = getattr(optimizer, _GRAD_PARTITIONS)
    if len(window) < len(partitions):
        for ds_id, partition in partitions.items():
            if ds_id not in window:
                partition.zero_()
        window.update(partitions)
    reduced = _ids(optimizer, _REDUCED)
    if optimizer.offload_optimizer and _at_boundary(optimizer):
        _offload_unreduced(optimizer, reduced)
    reduced.clear()
    optimizer.__dict__.pop(_BUCKETED, None)


def _offload_unreduced(optimizer, reduced) -> None:
    """Upstream copies a partition to the offloaded optimizer only when the partition is reduced in
    the boundary micro-batch; the others keep an older window's gradient there. Reducing a zero
    gradient for them goes through upstream's own copy (and its norm and NVMe swap)."""
    partitions = getattr(optimizer, _GRAD_PARTITIONS)
    missing = [param for group in optimizer.fp16_groups for param in group
               if param.ds_id in partitions and param.ds_id not in reduced]
    if missing:
        device = get_accelerator().current_device_name()
        zeros = [torch.zeros(param.partition_numel(), dtype=partitions[param.ds_id].dtype, device=device)
                 for param in missing]
        optimizer.partition_grads(missing, zeros)


def finalize_gradient_accumulation_boundary(optimizer, stock):
    """Wraps the unmanaged boundary (``step()``): params idle in the window get a zero gradient in
    the offloaded optimizer too, as at the managed boundary."""
    stock(optimizer)
    if optimizer.offload_optimizer and not left_to_stock(optimizer):
        _offload_unreduced(optimizer, set(optimizer._offload_boundary_param_ids))


def zero_grad(optimizer, stock, *args, **kwargs):
    """Wraps ``zero_grad``: the next gradient starts a new accumulation window."""
    if left_to_stock(optimizer):
        return stock(optimizer, *args, **kwargs)
    _window(optimizer).clear()
    return stock(optimizer, *args, **kwargs)
