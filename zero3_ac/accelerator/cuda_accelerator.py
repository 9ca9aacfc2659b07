"""The CUDA accelerator's stream query: extends upstream ``accelerator/cuda_accelerator.py``.

Note: [The current stream of no device in particular]
    ZeRO-3 asks ``get_accelerator().current_stream()`` for every param it frees (``free_param``
    records the freed data on it) and twice for every gradient it buckets: about 3,000 calls a step
    on an 8B LoRA model. Given no device, ``torch.cuda.current_stream`` finds the current device
    through ``torch.cuda.is_available()`` (an environment lookup and a device count) on every call;
    ``torch.cuda.current_device()`` names the same device and costs a fraction of that
    (``benchmarks/cuda_stream_cost.py``). The stream returned is the same.
"""

import torch


def current_stream(accelerator, device_index=None):
    """Replacement of ``CUDA_Accelerator.current_stream``: ``None`` means the current device."""
    if device_index is None:
        device_index = torch.cuda.current_device()
    return torch.cuda.current_stream(device_index)
