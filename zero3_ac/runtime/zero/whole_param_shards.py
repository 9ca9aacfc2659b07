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
    A released param holds a zero-element tensor, as upstream's, but one shared by every released
    param of its dtype rather than one made per release: ``param.data = t`` shares ``t``'s storage
    but keeps the param's own shape and version counter, and a zero-element storage holds nothing
    that a later gather could find.
    Left to upstream: partitions on another device than the compute device (param offload, states
    offloaded by ``offload_states``), on NVMe, quantized (``ds_quant_scale``), with an hpZ secondary
    partition, and any partition group of more than one rank.

Note: [A fetch of whole shards]
    Upstream's ``fetch_sub_module`` does per-param work beyond the gather: a set of the module's
    params, a status check, a mark and an in-flight lookup for each, and, once the trace is
    complete, a walk of the prefetch queue past the module's params and a prefetch of the params
    ahead. The queue and the prefetch exist to start all-gathers early; a whole shard's gather is a
    view of memory already there, so there is nothing to start early. When every param of the
    engine's model is on the path above, a module's fetch is the gather of its params (through the
    coordinator's tapped all-gather, so the listeners hear of it; any other param, an external one
    from outside the model, goes to upstream's all-gather and is waited for) and the trace position
    step that ``trace_prologue`` checks the next module against. The queue is then never walked:
    only fetches walk it, and ``reset_step`` rebuilds it at every root forward. The choice is made
    for the whole model at each root forward, never per module, since a fetch through upstream's
    path after one through this would find the queue behind it (upstream's "tracing error"). It is
    answered once per tree shape; the gather still checks each param's partition at every fetch and
    hands any param off this path to upstream's all-gather.
    The mark is not needed: the lifecycle holds what a module fetches by the invocation's id.
    Left to upstream's fetch: models with any param off this path, and
    ``fast_sharding_for_leaf_module``, whose fetch and release handle buffers of their own.
"""

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

_WHOLE_ATTR = "_zero3_ac_whole_shard"


def _partition_is_whole(param) -> bool:
    """Static facts: a ZeRO-3 param (not a plain one of a module attached after ``initialize``), one rank in
    its partition group, no NVMe, no quantization, no hpZ."""
    partition = getattr(param, "ds_tensor", None)
    return (partition is not None and param.ds_process_group is not None
            and dist.get_world_size(group=param.ds_process_group) == 1
            and getattr(partition, "final_location", None) != OffloadDeviceEnum.nvme
            and not hasattr(partition, "ds_quant_scale") and param.ds_secondary_tensor is None)


def _remember_whole(param) -> bool:
    whole = param.__dict__[_WHOLE_ATTR] = _partition_is_whole(param)
    return whole


class WholeParamShards:
    """One coordinator's gather and release of params on the path of [A shard that is the whole param]."""

    def __init__(self, coordinator, private_prefix: str, released_data):
        self._coordinator = coordinator
        # The coordinator's name-mangled attributes, named once (a fetch reads them for every module).
        self._counter_attr = private_prefix + "n_available_params"
        self._all_gather_attr = private_prefix + "all_gather_params"
        self._inflight_attr = private_prefix + "inflight_param_registry"
        self._stream_attr = private_prefix + "allgather_stream"
        self._step_attr = private_prefix + "step_id"
        self._device = torch.device(get_accelerator().current_device_name())
        self._released_data = released_data  # kept_partition_release.ReleasedData
        self._covered = (None, False)  # (the params last asked about, the answer)

    def _whole(self, param) -> bool:
        whole = param.__dict__.get(_WHOLE_ATTR)
        if whole is None:
            whole = _remember_whole(param)
        return whole and param.ds_tensor.device == self._device

    def gather(self, params):
        """Gather the params on this path; returns the other partitioned ones, for upstream's all-gather (which
        passes over a param that is available or in flight)."""
        rest = []
        elements = 0
        device = self._device
        for param in params:
            if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
                continue
            whole = param.__dict__.get(_WHOLE_ATTR)  # self._whole(param), inlined: the loop runs for every param
            if whole is None:
                whole = _remember_whole(param)
            if whole and param.ds_tensor.device == device:
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
        return not self.release_all((param, ))

    def release_all(self, params) -> list:
        """Release the gathered, unheld ``params`` on this path; returns the others, in order."""
        rest = []
        elements = 0
        released_data = self._released_data
        device = self._device
        for param in params:
            whole = param.__dict__.get(_WHOLE_ATTR)  # self._whole(param), inlined as in gather
            if whole is None:
                whole = _remember_whole(param)
            if whole and param.ds_tensor.device == device:
                param.data = released_data[param.dtype]
                param.ds_status = ZeroParamStatus.NOT_AVAILABLE
                elements += param.ds_numel
            else:
                rest.append(param)
        if elements:
            setattr(self._coordinator, self._counter_attr, getattr(self._coordinator, self._counter_attr) - elements)
        return rest

    def views_its_shard(self, param) -> bool:
        """Whether ``param`` is gathered on this path and its data is its shard's, where the shard is now."""
        return (param.ds_status == ZeroParamStatus.AVAILABLE and self._whole(param)
                and param.data_ptr() == param.ds_tensor.data_ptr() and param.shape == param.ds_shape)

    def covers(self, params) -> bool:
        """Whether a model with these params fetches on the path of [A fetch of whole shards]; answered
        once per list (``model_params`` keeps one per tree shape), not by a walk of the model per step."""
        if params is not self._covered[0]:
            self._covered = (params, not self._coordinator.fast_sharding_for_leaf_module and bool(params)
                             and all(self._whole(param) for param in params))
        return self._covered[1]

    def fetch(self, params, forward: bool) -> None:
        """A module's fetch of ``params`` when its model is covered (see [A fetch of whole shards])."""
        coordinator = self._coordinator
        getattr(coordinator, self._all_gather_attr)(params, forward)
        inflight = getattr(coordinator, self._inflight_attr)
        if inflight:
            accelerator = get_accelerator()
            stream = getattr(coordinator, self._stream_attr)
            waited = False
            for param in params:
                if param in inflight:
                    with accelerator.stream(stream):
                        inflight.pop(param).wait()
                    waited = True
            if waited and not accelerator.resolves_data_dependency():
                accelerator.current_stream().wait_stream(stream)
        setattr(coordinator, self._step_attr, getattr(coordinator, self._step_attr) + 1)
