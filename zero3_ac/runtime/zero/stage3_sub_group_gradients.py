"""A sub-group's reduced gradients enter the fp32 optimizer as one region of the flat gradient buffer:
extends upstream ``runtime/zero/stage3.py``'s ``_prepare_fp32_grad_for_sub_group``.

Note: [A sub-group's gradient partitions are one region of the flat buffer]
    ZeRO-3 keeps every trainable param's reduced gradient partition in one flat buffer
    (``grad_partitions_flat_buffer``), laid out param after param in the order of the optimizer's
    sub-groups, and hands each partition out as a ``narrow`` view of it. At the end of a backward,
    ``averaged_gradients[i]`` becomes the list of those views for sub-group ``i``; the step computes
    the gradient norm from it, param by param, and then ``_prepare_fp32_grad_for_sub_group``
    flattens the list into a new tensor (``torch.cat``), the fp32 master partition's ``.grad``, and
    records every view on the current stream, with some five Python calls per param around each
    ``record_stream`` (about 1,500 a step for a 1.1B LoRA model).

    When the list holds exactly the buffer's own views of the sub-group's params, in order (every
    param of the sub-group trainable; a frozen one gets a ``zeros_like`` instead), its
    concatenation is the region of the buffer those views tile. The fork hands upstream's method
    that region as two views instead (its first element and the rest): ``torch.cat`` of two views
    copies the same values into a new tensor, so the master partition's gradient is a copy as
    before (one view alone would be flattened to an alias, and the clipping's in-place scaling would
    then reach the buffer), and recording the two views records the buffer's one allocation, as the
    per-param records did. The gradient norm, computed before, still sees one view per param.
"""

import operator

from zero3_ac.runtime.zero.stock_engines import left_to_stock

_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
_REGIONS = "_zero3_ac_sub_group_gradient_regions"  # sub-group index -> (the views, the region as two views)


def _tiling(optimizer, sub_group_id):
    """(the buffer's views of the sub-group's params, the region they tile as two views), or (views, None)
    where they do not tile one region of the flat buffer."""
    partitions = getattr(optimizer, _GRAD_PARTITIONS, {})
    group = optimizer.fp16_groups[sub_group_id]
    views = [partitions.get(param.ds_id) for param in group]
    flat = getattr(optimizer, "grad_partitions_flat_buffer", None)
    if flat is None or len(views) < 2 or any(view is None for view in views):
        return views, None
    element_size = flat.element_size()
    start = (views[0].data_ptr() - flat.data_ptr()) // element_size
    offset = start
    for view in views:
        if (view.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr() or view.dim() != 1
                or view.dtype != flat.dtype or view.data_ptr() != flat.data_ptr() + offset * element_size):
            return views, None
        offset += view.numel()
    if offset - start < 2:
        return views, None
    return views, [flat.narrow(0, start, 1), flat.narrow(0, start + 1, offset - start - 1)]


def prepare_fp32_grad_for_sub_group(optimizer, stock, sub_group_id):
    """Wraps ``_prepare_fp32_grad_for_sub_group``: the sub-group's gradient views become the region they
    tile (Note [A sub-group's gradient partitions are one region of the flat buffer])."""
    if left_to_stock(optimizer):
        return stock(optimizer, sub_group_id)
    grads = optimizer.averaged_gradients.get(sub_group_id)
    if grads:
        regions = optimizer.__dict__.setdefault(_REGIONS, {})
        known = regions.get(sub_group_id)
        if known is None or not same_tensors(known[0], grads):
            known = regions[sub_group_id] = _tiling(optimizer, sub_group_id)
        views, region = known
        if region is not None and same_tensors(views, grads):
            optimizer.averaged_gradients[sub_group_id] = region
    return stock(optimizer, sub_group_id)


def same_tensors(known, tensors) -> bool:
    """Whether ``tensors`` holds the ``known`` tensor objects, in order (a list upstream rebuilds each step)."""
    return len(known) == len(tensors) and all(map(operator.is_, tensors, known))
