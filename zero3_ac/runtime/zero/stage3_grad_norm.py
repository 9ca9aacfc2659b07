"""The gradient norm's fp64 copies made in one batch: extends upstream ``stage3.py``'s
``get_grad_norm_direct``.

Note: [The gradient norm's fp64 copies]
    Upstream's gradient norm (``get_grad_norm_direct``, once per sub-group) casts each gradient to the
    norm dtype on its own (``g.to(device).to(get_norm_dtype())``; ``.double()`` before 0.19) and takes
    its norm: per gradient an allocation, a cast kernel, a norm kernel and about ten Python calls. For
    a 1.1B LoRA model that is 308 gradients a step, and under cProfile about half of the fork's
    optimizer step.

    The fork makes those fp64 copies in one batch before it calls upstream: one buffer, one
    ``_foreach_copy_`` into 1-D views of it, each view starting at a multiple of 512 bytes, where a
    fresh allocation of the CUDA caching allocator starts (CPU allocations start at multiples of 64).
    Upstream's casts then return the views themselves (``Tensor.to`` a tensor's own device and dtype
    returns it), and its norm runs the same kernel, at the same alignment, over the same values (a
    cast to fp64 is exact). Each per-gradient norm, the total and so the clipping are upstream's, bit
    for bit.

    The buffer lives for the call only, and it does not raise the step's peak memory: moments later
    the step flattens each sub-group's gradients into an fp32 copy (``_prepare_fp32_grad_for_sub_group``,
    4 bytes per element, more for bf16 gradients), and the buffer, with upstream's own cast of the
    largest gradient left out of it, is planned to take no more than that. The smallest gradients go
    in first: they carry the most per-call work for the fewest bytes. A gradient that is not 1-D and
    contiguous, not on the current device, or already in the norm dtype is left to upstream's cast,
    and so is the inf norm, which casts nothing. On one H100 with 1.1B LoRA, 228 of the 308 gradients
    go in and the norm takes 6.65 ms instead of 8.10, the same bits
    (benchmarks/results/2026-12-06-1xh100-grad-norm).

Note: [The gradient norm without upstream's per-gradient loop]
    With the copies made, most of upstream's norm is its loop: per gradient two ``.to`` calls,
    ``get_accelerator().device_name()``, ``get_norm_dtype()``, ``is_model_parallel_parameter``,
    and ``Tensor.norm``, which reaches ``torch.linalg.vector_norm`` through two Python wrappers
    (``torch.functional.norm``): about ten Python calls around the one kernel.

    Where upstream's texts of the function all compute the same thing, the fork runs the same
    kernels itself, without the loop: each gradient's ``torch.linalg.vector_norm(g, 2.0)`` (what
    ``Tensor.norm(2)`` calls for a strided CPU or CUDA tensor) of its fp64 copy or its own fp64
    cast, ``torch.sum(torch.pow(torch.stack(norms), 2.0))``, the SUM all-reduce over the same
    group, the square root as ``** 0.5``, and -1.0 where the result is inf or nan, on the same
    tensors in the same order: the same bits. Three texts were compared: one from 0.18.5 to
    0.19.2, one from 0.19.3 to 0.19.5 (the all-reduce over the first param's partition group,
    which must be every param's, and AutoEP's expert group added), and 0.19.8's (the norm dtype
    and a model-parallel count added). They compute the same thing when the 2-norm is asked for,
    the norm dtype is fp64, there is no model-parallel group (every gradient counts and nothing
    is all-reduced over model-parallel ranks), no param is an AutoEP expert, and every gradient
    is on the current device (upstream would copy it there). Anything else is upstream's
    function, given the copies. These facts and the group are taken once per sub-group, with the
    copies' plan.
"""

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

from zero3_ac.runtime.zero.stage3_sub_group_gradients import same_tensors
from zero3_ac.runtime.zero.stock_engines import left_to_stock

_PLANS = "_zero3_ac_grad_norm_plans"  # id(params) -> _Plan
ALIGNMENT_BYTES = 512
FLAT_COPY_BYTES_PER_ELEMENT = 4  # the fp32 copy of a sub-group's gradients that the step makes next


def norm_dtype() -> torch.dtype:
    """Upstream's norm dtype: ``get_norm_dtype()`` where it exists (0.19+), fp64 before."""
    try:
        from deepspeed.runtime.zero.utils import get_norm_dtype
    except ImportError:
        return torch.float64
    return get_norm_dtype()


def padded(numel: int, element_size: int) -> int:
    """``numel`` rounded up so that the next view starts at a multiple of ``ALIGNMENT_BYTES``."""
    step = max(1, ALIGNMENT_BYTES // element_size)
    return -(-numel // step) * step


def plan_sizes(stageable, cast_by_upstream, total, element_size):
    """Which gradients go into the buffer (Note [The gradient norm's fp64 copies]).

    ``stageable``: the sizes in elements of the gradients that may; ``cast_by_upstream``: those of the
    gradients that upstream casts itself; ``total``: the elements of all the sub-group's gradients;
    ``element_size``: the norm dtype's. Returns indices into ``stageable``, smallest first: the most for
    which the buffer (each view padded) plus upstream's cast of the largest gradient left out takes no
    more bytes than the step's fp32 copy of all the gradients.
    """
    budget = FLAT_COPY_BYTES_PER_ELEMENT * total
    order = sorted(range(len(stageable)), key=stageable.__getitem__)
    largest_cast = max(cast_by_upstream, default=0) * element_size
    used = [0]
    for index in order:
        used.append(used[-1] + padded(stageable[index], element_size) * element_size)
    if not order or used[-1] + largest_cast <= budget:
        return order
    largest_left = max(largest_cast, stageable[order[-1]] * element_size)
    count = 0
    while count < len(order) - 1 and used[count + 1] + largest_left <= budget:
        count += 1
    return order[:count]


class _Plan:
    """A sub-group's staging: its gradients (to recognise them), the staged ones and where they go; the
    group of the norm's all-reduce where the fork computes the norm itself (``own_norm``)."""
    __slots__ = ("gradients", "indices", "sources", "split_sizes", "numel", "dtype", "device", "own_norm", "group")

    def __init__(self, optimizer, gradients, params, dtype, device):
        self.gradients = list(gradients)
        self.dtype = dtype
        self.device = device
        stageable = [index for index, gradient in enumerate(gradients) if _stageable(gradient, dtype, device)]
        left = set(range(len(gradients))).difference(stageable)
        cast_by_upstream = [gradients[index].numel() for index in left if gradients[index].dtype != dtype]
        chosen = plan_sizes([gradients[index].numel() for index in stageable], cast_by_upstream,
                            sum(gradient.numel() for gradient in gradients), dtype.itemsize)
        self.indices = sorted(stageable[position] for position in chosen)
        self.sources = [gradients[index] for index in self.indices]
        self.split_sizes = []
        for source in self.sources:
            numel = source.numel()
            self.split_sizes += [numel, padded(numel, dtype.itemsize) - numel]
        self.numel = sum(self.split_sizes)
        self.own_norm, self.group = _own_norm_group(optimizer, gradients, params, dtype, device)

    def staged(self, gradients):
        """``gradients`` with the staged ones replaced by their copies in a fresh buffer."""
        buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        views = buffer.split_with_sizes(self.split_sizes)[::2]
        torch._foreach_copy_(views, self.sources)
        staged = list(gradients)
        for index, view in zip(self.indices, views):
            staged[index] = view
        return staged


def _stageable(gradient, dtype, device) -> bool:
    return (gradient.dtype != dtype and gradient.is_floating_point() and gradient.layout == torch.strided
            and gradient.dim() == 1 and gradient.is_contiguous() and gradient.device == device)


def _own_norm_group(optimizer, gradients, params, dtype, device):
    """``(True, group)`` where the fork computes the norm itself, ``(False, None)`` where upstream's must
    (Note [The gradient norm without upstream's per-gradient loop])."""
    if (dtype != torch.float64 or getattr(optimizer, "model_parallel_group", True) is not None
            or getattr(optimizer, "model_parallel_rank", 1) != 0 or len(gradients) != len(params)
            or any(gradient.device != device for gradient in gradients)):
        return False, None
    if not hasattr(optimizer, "_get_param_partition_group"):  # before 0.19.3
        return True, optimizer.dp_process_group
    try:
        optimizer._assert_same_partition_group(params)
        if optimizer._autoep_expert_parallel_group(params) is not None:
            return False, None
    except RuntimeError:  # upstream raises it again, naming the problem
        return False, None
    return True, optimizer._get_param_partition_group(params[0])


def _two_norm(optimizer, plan, gradients):
    """Upstream's 2-norm of ``gradients`` where ``plan.own_norm`` (see Note [The gradient norm without
    upstream's per-gradient loop])."""
    if plan.indices:
        gradients = plan.staged(gradients)
    dtype = plan.dtype
    vector_norm = torch.linalg.vector_norm
    norms = [vector_norm(gradient if gradient.dtype == dtype else gradient.to(dtype), 2.0) for gradient in gradients]
    total = torch.sum(torch.pow(torch.stack(norms), 2.0))
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=plan.group)
    total = total**0.5
    inf_or_nan = total.isnan().logical_or(total.isinf())
    return torch.where(inf_or_nan, torch.tensor(-1.0, device=optimizer.device, dtype=torch.float), total)


def staged_count(optimizer, params) -> int:
    """How many of the gradients of the sub-group of ``params`` the last norm staged (0 before any)."""
    plan = optimizer.__dict__.get(_PLANS, {}).get(id(params))
    return len(plan.indices) if plan is not None else 0


def get_grad_norm_direct(optimizer, stock, gradients, params, norm_type=2):
    """Wraps ``get_grad_norm_direct``: see Notes [The gradient norm's fp64 copies] and [The gradient norm
    without upstream's per-gradient loop]."""
    if left_to_stock(optimizer) or float(norm_type) == float("inf") or not gradients:
        return stock(optimizer, gradients, params, norm_type)
    plans = optimizer.__dict__.setdefault(_PLANS, {})
    plan = plans.get(id(params))
    if plan is None or not same_tensors(plan.gradients, gradients):
        device = torch.device(get_accelerator().current_device_name())
        plan = plans[id(params)] = _Plan(optimizer, gradients, params, norm_dtype(), device)
    if plan.own_norm and float(norm_type) == 2.0:
        return _two_norm(optimizer, plan, gradients)
    if not plan.indices:
        return stock(optimizer, gradients, params, norm_type)
    return stock(optimizer, plan.staged(gradients), params, norm_type)
