"""ZeRO-3's gradient reduce-scatter with a partition group of one rank: replaces upstream
``runtime/comm/coalesced_collectives.py``'s ``reduce_scatter_coalesced`` as ``runtime/zero/stage3.py``
calls it (``__avg_scatter_grads``).

Note: [A reduce-scatter over one rank]
    Upstream's reduce-scatter lays every gradient's partition for each rank side by side in one
    buffer (``torch.cat`` of a slice of each, padded to equal partitions), divides the buffer by
    the world size in place, reduce-scatters it, and returns a ``narrow`` of the rank's part for
    each gradient. With one rank in the group the partition is the whole gradient, the division is
    by 1 and the sum is over one rank: the values it returns are the gradients' own, bit for bit
    (x / 1 is x in IEEE arithmetic; NaN and infinities stay what they are). What it costs is a copy
    of the whole bucket, a division kernel, a collective, and four tensor operations a gradient.
    Here each gradient's flat view is returned instead (``tensor.view(-1)``, which upstream takes
    of each gradient too, so a gradient it cannot flatten raises as upstream's does). The results
    alias the gradients rather than a fresh buffer; upstream's caller only reads them, into the
    gradient partitions, before the bucket is reused, and upstream's own single-tensor case
    already reduces the gradient in place. Any group of more than one rank, and an empty list, go
    to upstream.
"""

from deepspeed import comm as dist
from deepspeed.runtime.comm import coalesced_collectives as upstream


def reduce_scatter_coalesced(tensors, group=None):
    """``reduce_scatter_coalesced``: each tensor's flat view where ``group`` has one rank (see [A reduce-scatter
    over one rank]), upstream's collective otherwise."""
    if tensors and dist.get_world_size(group) == 1:
        return [tensor.view(-1) for tensor in tensors]
    return upstream.reduce_scatter_coalesced(tensors, group)
