"""The CUDA accelerator's stream query: extends upstream ``accelerator/cuda_accelerator.py``.

Note: [The current stream of no device in particular]
    ZeRO-3 asks ``get_accelerator().current_stream()`` for every param it frees (``free_param``
    records the freed data on it) and twice for every gradient it buckets: about 3,000 calls a step
    on an 8B LoRA model. Given no device, ``torch.cuda.current_stream`` finds the current device
    through ``torch.cuda.is_available()`` (an environment lookup and a device count) on every call,
    and with a device it still runs ``_lazy_init`` and ``_get_device_index``, about ten Python calls in
    all. Once CUDA is initialized, the stream is read the way ``torch.cuda.current_stream`` reads it
    (``torch._C._cuda_getCurrentStream`` of the current device, ``torch._C._cuda_getDevice``) and
    wrapped in a ``torch.cuda.Stream`` of the same stream; the wrapper of a stream seen before is
    returned again, as building one is most of the call's cost (``benchmarks/cuda_stream_cost.py``).
    Before CUDA is initialized, and for a device named by the caller, torch's own function answers.
"""

import torch

_MAX_STREAMS = 64  # wrappers kept; torch takes its streams from small pools, so few are ever seen
_streams = {}  # (stream id, device index, device type) -> the torch.cuda.Stream of that stream


def current_stream(accelerator, device_index=None):
    """Replacement of ``CUDA_Accelerator.current_stream``: ``None`` means the current device."""
    if device_index is None and torch.cuda.is_initialized():
        key = torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())
        stream = _streams.get(key)
        if stream is None:
            if len(_streams) >= _MAX_STREAMS:
                _streams.clear()
            stream = _streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        return stream
    return torch.cuda.current_stream(device_index)
