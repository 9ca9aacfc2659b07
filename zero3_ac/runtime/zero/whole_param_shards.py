"""Gather and release of params whose partition is the whole param: extends upstream
``partition_parameters.py``'s no-gather path (``NoGatherHandle``, ``free_param``) as the coordinator uses it.

Note: [A shard that is the whole param]
    With a partition group of one rank (one GPU, or ZeRO-3 on one rank per replica), a param's
    partition ``ds_tensor`` holds the whole param. Upstream still runs the all-gather machinery for
    it, param by param: ``all_gather_coalesced`` builds a ``NoGatherCoalescedHandle`` whose
    ``.to(current_device_name())`` of the partition returns the partition itself, and the fetch
    then enters the all-gather stream, waits on the handle (a stream synchronize) and records an
    event, for every param; the release frees the param's data with a ``record_stream``. What the
    param ends up with is a view of its own partition, and what the release frees is that view:
    the partition's memory stays where it is, so no stream can be using memory that the release
    hands back. Here a param on that path gets the view and the status directly, and its release
    drops the view, with the coordinator's count of available elements kept as upstream keeps it.
    Left to upstream: partitions on another device than the compute device (param offload, states
    offloaded by ``offload_states``), on NVMe, quantized (``ds_quant_scale``), with an hpZ secondary
    partition, and any partition group of more than one rank.
"""

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

_WHOLE_ATTR = "_zero3_ac_whole_shard"


def _partition_is_whole(param) -> bool:
    """Static facts: one rank in the param's partition group, no NVMe, no quantization, no hpZ."""
    partition = param.ds_tensor
    return (partition is not None and param.ds_process_group is not None
            and dist.get_world_size(group=param.ds_process_group) == 1
            and getattr(partition, "final_location", None) != OffloadDeviceEnum.nvme
            and not hasattr(partition, "ds_quant_scale") and param.ds_secondary_tensor is None)


class WholeParamShards:
    """One coordinator's gather and release of params on the path of [A shard that is the whole param]."""

    def __init__(self, coordinator, counter_attr: str):
        self._coordinator = coordinator
        self._counter_attr = counter_attr  # the coordinator's (name-mangled) count of available elements
        self._device = torch.device(get_accelerator().current_device_name())

    def _whole(self, param) -> bool:
        whole = param.__dict__.get(_WHOLE_ATTR)
        if whole is None:
            whole = param.__dict__[_WHOLE_ATTR] = _partition_is_whole(param)
        return whole and param.ds_tensor.device == self._device

    def gather(self, params):
        """Gather the params on this path; returns the others, for upstream's all-gather."""
        rest = []
        elements = 0
        for param in params:
            if param.ds_status == ZeroParamStatus.NOT_AVAILABLE and self._whole(param):
                param.data = param.ds_tensor.data.view(param.ds_shape)
                param.ds_status = ZeroParamStatus.AVAILABLE
                elements += param.ds_numel
            else:
                rest.append(param)
        if elements:
            setattr(self._coordinator, self._counter_attr, getattr(self._coordinator, self._counter_attr) + elements)
        return rest

    def release(self, param) -> bool:
        """Release a gathered, unheld param on this path; False if it is not on it (upstream releases it)."""
        if not self._whole(param):
            return False
        param.data = torch.empty(0, dtype=param.dtype, device=param.ds_tensor.device)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        setattr(self._coordinator, self._counter_attr, getattr(self._coordinator, self._counter_attr) - param.ds_numel)
        return True
