"""DeepSpeed's NVTX ranges: extends upstream ``utils/nvtx.py``.

Upstream's ``instrument_w_nvtx`` pushes and pops an NVTX range around every call of the functions
it decorates (``fetch_sub_module``, ``__release_param``, the gradient reduction, ...) whenever the
module-level ``enable_nvtx`` is True, which it is by default: thousands of ranges a step, that only
a profiler reads. The fork turns them off for the whole process when it takes over the first ZeRO-3
engine (Note: [Changes that reach beyond ZeRO-3] in ``zero3_ac/activation.py``);
``ZERO3_AC_NVTX=1``, read then, keeps them on for a profiling run (nsys, the PyTorch profiler's NVTX view).
"""

import os

ENV = "ZERO3_AC_NVTX"


def ranges_requested() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no")
