"""ZeRO-3 optimizer state after a backward that raised, and what its ``step()`` releases: extends upstream
``stage3.py``.

Note: [A backward that raised]
    An exception in the middle of a backward (in a recompute, in a custom Function) leaves ZeRO-3's
    per-backward state half-way: the backward-hook state still counts an active backward whose
    end-of-backward callback never ran, some gradients sit in the reduce buckets, others were
    already reduced into the gradient partitions. Upstream then skips the next backward's epilogue
    and the next ``step()`` fails, or it adds half a micro-batch to the next one. Reduced and
    unreduced contributions cannot be told apart any more, so the fork drops the gradients of the
    whole accumulation window, says so, and lets the next micro-batch start a fresh window.
"""

import weakref

from deepspeed.utils import logger

from zero3_ac.runtime.zero import stage3_unit_gradients, stock_engines
from zero3_ac.runtime.zero.parameter_offload import lifecycle_hooks

_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


def discard_aborted_backward(optimizer) -> None:
    hook_state = optimizer._backward_hook_state
    hook_state.backward_active_depth = 0
    hook_state.reset_for_new_step()
    hook_state.remaining_grad_acc_hooks = 0
    stage3_unit_gradients.discard(optimizer)
    for bucket in optimizer.ipg_buckets.values():
        bucket.clear_params()
    for param_id in optimizer.params_already_reduced:
        optimizer.params_already_reduced[param_id] = False
    for partition in getattr(optimizer, _GRAD_PARTITIONS, {}).values():
        partition.zero_()
    for group in optimizer.fp16_groups:
        for param in group:
            param.grad = None
    optimizer.micro_step_id = 0
    optimizer._epilogue_ran_this_backward = False
    logger.warning("zero3_ac: the previous backward raised; the gradients accumulated in its accumulation window "
                   "were discarded and the next micro-batch starts a new window.")


def initialize_ds_offload(optimizer, stock, *args, **kwargs):
    """Wraps ``DeepSpeedZeroOptimizer_Stage3.initialize_ds_offload``: link the offload's hooks back,
    and mark the optimizer of an engine left to stock (Note [Engines left to stock])."""
    offload = stock(optimizer, *args, **kwargs)
    stock_engines.mark([optimizer], left=stock_engines.offload_left_to_stock(offload))
    hooks = lifecycle_hooks(offload)
    if hooks is not None:
        optimizer_ref = weakref.ref(optimizer)
        hooks.on_aborted_backward = lambda: optimizer_ref() is not None and discard_aborted_backward(optimizer_ref())
    return offload


def step(optimizer, stock, *args, **kwargs):
    """Wraps ``DeepSpeedZeroOptimizer_Stage3.step``: its release of every param keeps the persistent params
    that are their whole shards (Note [Persistent params across the step] in partitioned_param_coordinator.py)."""
    offload = getattr(optimizer, "parameter_offload", None)
    hooks = lifecycle_hooks(offload) if offload is not None else None
    if hooks is None:
        return stock(optimizer, *args, **kwargs)
    hooks.params.stepping = True
    try:
        return stock(optimizer, *args, **kwargs)
    finally:
        hooks.params.stepping = False
