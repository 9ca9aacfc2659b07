"""The copy-out of a coalesced all-gather, in one op for all its params: extends upstream
``partition_parameters.py``'s ``AllGatherCoalescedHandle.wait``.

Note: [One copy-out per coalesced all-gather]
    ``all_gather_coalesced`` gathers a list of params (a module's fetch, or a prefetch of the modules
    ahead) with one collective. The collective's output is one flat buffer laid out rank by rank:
    rank 0's shard of each param in turn, then rank 1's, and so on. Upstream's ``wait`` then puts
    each param together by itself:
    - one ``narrow`` per rank,
    - a ``torch.cat`` of the pieces,
    - a ``view`` and a ``.to``,
    - a ``record_stream`` per piece (off CPU).
    At world size W that is about 2W + 4 tensor calls and one kernel per param.

    Seen as a ``[W, S]`` matrix (S the sum of the shard sizes), the buffer holds param p in the
    columns ``[o_p, o_p + s_p)``. The param's padded whole, seen as ``[W, s_p]``, is exactly that block.
    So one ``torch.split_with_sizes_copy`` along dim 1 copies every param out, as FSDP2 copies out its
    all-gather. On CUDA that is one kernel for contiguous operands.
    - Each param gets its own buffer, as upstream allocates one per param, so that releasing one
      param frees its memory as before. The buffer holds the padded whole (``W * s_p`` elements,
      at most W - 1 more than the param), and the param's data is a view of its first ``ds_numel``.
    - One ``record_stream`` of the flat buffer stands for upstream's one per piece: the pieces are
      views of that buffer.
    - The values are upstream's, bit for bit: both only copy.

    Left to upstream: quantized gathers, hpZ secondary partitions, a gather dtype other than a
    param's partition dtype (upstream's ``.to`` converts there), and partitions that are not
    consecutive slices of one buffer.
"""

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import AllGatherCoalescedHandle, ZeroParamStatus


def rank_major_matrix(partitions):
    """The buffer behind ``partitions`` (one per rank) as a ``[W, S]`` view; None unless they are equal,
    contiguous 1-D slices that follow each other in one buffer.

    Checked with a few calls per gather, not per param (upstream's non-quantized gather makes its partitions
    so): each partition starts where the one before ends, and the first one's storage holds them all.
    """
    first = partitions[0]
    width = first.numel()
    if first.stride() != (1,):
        return None
    rows = len(partitions)
    element_size = first.element_size()
    if (first.storage_offset() + rows * width) * element_size > first.untyped_storage().nbytes():
        return None
    start = first.data_ptr()
    for rank in range(1, rows):
        part = partitions[rank]
        if part.data_ptr() != start + rank * width * element_size or part.numel() != width or part.stride() != (1,):
            return None
    return first.as_strided((rows, width), (width, 1))


def _copy_out_plan(handle):
    """(the ``[W, S]`` matrix, each param's shard size) where the handle's params can be copied out in one op."""
    if handle.quantization is not None or handle.use_secondary_tensor or not handle.params:
        return None
    matrix = rank_major_matrix(handle.partitions)
    if matrix is None:
        return None
    sizes = []
    for param in handle.params:
        if param.ds_tensor.dtype != matrix.dtype:
            return None
        sizes.append(param.ds_tensor.ds_numel)
    if sum(sizes) != matrix.shape[1]:
        return None
    return matrix, sizes


def wait(handle, stock, handle_dependency=True):
    """Wraps ``AllGatherCoalescedHandle.wait``: the params come out of the flat buffer in one op
    (Note [One copy-out per coalesced all-gather]); anything else waits as upstream does."""
    if handle.complete:
        return None
    plan = _copy_out_plan(handle)
    if plan is None:
        return stock(handle, handle_dependency)
    matrix, sizes = plan
    handle.allgather_handle.wait()
    world_size = matrix.shape[0]
    wholes = [torch.empty((world_size, size), dtype=matrix.dtype, device=matrix.device) for size in sizes]
    torch.split_with_sizes_copy(matrix, sizes, dim=1, out=wholes)
    for param, size, whole in zip(handle.params, sizes, wholes):
        assert param.ds_status == ZeroParamStatus.INFLIGHT, f"expected param {param.ds_summary()} to be inflight"
        numel = param.ds_numel
        param.data = (whole if numel == world_size * size else whole.view(-1).narrow(0, 0, numel)).view(param.ds_shape)
        param.ds_status = ZeroParamStatus.AVAILABLE
    handle.complete = True
    accelerator = get_accelerator()
    if not accelerator.is_synchronized_device():
        if handle_dependency:
            matrix.record_stream(accelerator.current_stream())
        else:  # kept until the coordinator's free_buffer(), as upstream keeps its pieces
            AllGatherCoalescedHandle.data_buffer.append(handle.partitions)
    return None
