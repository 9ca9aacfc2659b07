"""Host cost of the CUDA stream queries ZeRO-3 makes per param (one GPU, no model).

DeepSpeed's CUDA accelerator asks ``torch.cuda.current_stream()`` with no device for every param it
frees and every gradient it buckets; torch resolves "no device" through ``torch.cuda.is_available()``
each time. This prints microseconds per call for that query and for the lean one the fork uses
(``zero3_ac/accelerator/cuda_accelerator.py``): the best of 5 rounds, the calls interleaved in each
round so that a warming machine favours none of them. Run it with ``ZERO3_AC_DISABLE=1`` to time
the accelerator as upstream ships it.

    python3 benchmarks/cuda_stream_cost.py
"""

import timeit

import torch


def main():
    torch.cuda.init()
    torch.cuda.set_device(0)
    side = torch.cuda.Stream()
    from deepspeed.accelerator import get_accelerator
    from zero3_ac.accelerator import cuda_accelerator
    accelerator = get_accelerator()
    calls = {
        "zero3_ac current_stream (the fork's CUDA_Accelerator.current_stream)":
        lambda: cuda_accelerator.current_stream(accelerator),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "torch.cuda.current_stream(torch.cuda.current_device())":
        lambda: torch.cuda.current_stream(torch.cuda.current_device()),
        "get_accelerator().current_stream()": lambda: accelerator.current_stream(),
        "torch.cuda.is_available()": lambda: torch.cuda.is_available(),
        "with torch.cuda.stream(side): pass": lambda: _enter_exit(torch.cuda.stream(side)),
        "with get_accelerator().stream(side): pass": lambda: _enter_exit(accelerator.stream(side)),
    }
    number = 20000
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(5):
        for name, call in calls.items():
            best[name] = min(best[name], timeit.timeit(call, number=number) / number)
    for name, seconds in best.items():
        print(f"{seconds * 1e6:7.2f} us  {name}")


def _enter_exit(context):
    with context:
        pass


if __name__ == "__main__":
    main()
