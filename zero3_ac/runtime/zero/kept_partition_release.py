"""The release of a gathered param whose partition stays as it is: extends upstream ``partition_parameters.py``'s
``partition`` (``_partition``, ``_partition_param``, ``free_param``) as the coordinator's ``__release_param`` calls it.

Note: [A release that frees only the gathered data]
    The coordinator releases a param by calling ``param.partition()``. For a param that has its
    partition already (``ds_tensor``; every param after ``zero.Init`` or ``initialize``), upstream
    keeps the partition and frees the gathered data: ``free_param`` records the data on the current
    stream, so that the caching allocator hands its memory out again only once the kernels queued
    there have read it, swaps ``param.data`` for a zero-element tensor and marks the param
    ``NOT_AVAILABLE``, and the coordinator lowers its count of available elements. On the way it
    passes three NVTX wrappers and builds six debug messages it does not print, one of them from the
    param's name, shape and device: per release, and a LoRA step releases every param about twice.
    Here the fork's releases (any world size) take that path directly, with the same effects: the
    record on the current stream where upstream records, the zero-element tensor, the status, the
    count. The zero-element tensor is shared by the released params of a dtype (Note [A shard that is
    the whole param] in whole_param_shards.py says why that is safe).
    Left to upstream's ``partition``: a partition on NVMe (its swap buffers are released too), with an
    hpZ secondary partition (``_partition_param_sec``), quantized, or on another device than the compute
    device (param offload, ``offload_states``), gathered data off the compute device, and a release that
    keeps the data (``free_data=False``).
"""

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

_AVAILABLE = ZeroParamStatus.AVAILABLE
_NOT_AVAILABLE = ZeroParamStatus.NOT_AVAILABLE


class ReleasedData(dict):
    """dtype -> the zero-element tensor on the compute device that every released param of the dtype holds (made
    on the first lookup; a lookup is a dict's, no Python frame)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self._device = device

    def __missing__(self, dtype: torch.dtype) -> torch.Tensor:
        released = self[dtype] = torch.empty(0, dtype=dtype, device=self._device)
        return released


class KeptPartitionRelease:
    """One coordinator's release of params on the path of [A release that frees only the gathered data]."""

    def __init__(self, coordinator, private_prefix: str, released_data: ReleasedData, device: torch.device):
        self._coordinator = coordinator
        self._counter_attr = private_prefix + "n_available_params"
        self._released_data = released_data
        self._device = device
        accelerator = get_accelerator()
        # free_param records the data on the current stream unless the device runs every op in order.
        self._current_stream = None if accelerator.is_synchronized_device() else accelerator.current_stream

    def release(self, param) -> bool:
        """Release a gathered param no module is active on; False where upstream's ``partition`` must."""
        return not self.release_all((param, ))

    def release_all(self, params) -> list:
        """Release the gathered ``params`` no module is active on; returns those upstream's ``partition`` must, in
        order."""
        if not params:
            return params
        rest = []
        elements = 0
        device = self._device
        released_data = self._released_data
        stream = self._current_stream() if self._current_stream is not None else None
        for param in params:
            partition = param.ds_tensor
            data = param.data
            if (param.ds_status is not _AVAILABLE or partition is None or partition.device != device
                    or data.device != device or getattr(param, "ds_zero_param_process_group", None) is not None
                    or getattr(partition, "final_location", None) == OffloadDeviceEnum.nvme
                    or hasattr(partition, "ds_quant_scale")):
                rest.append(param)
                continue
            if stream is not None:
                data.record_stream(stream)
            param.data = released_data[param.dtype]
            param.ds_status = _NOT_AVAILABLE
            elements += param.ds_numel
        if elements:
            coordinator = self._coordinator
            setattr(coordinator, self._counter_attr, getattr(coordinator, self._counter_attr) - elements)
        return rest
