"""``profile_step.gap_sites``: GPU idle time charged to the launching thread's Python stack, on a made-up trace."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
from profile_step import gap_sites  # noqa: E402

SP = os.sep + "site-packages" + os.sep


def _kernel(ts, dur, correlation):
    return {"cat": "kernel", "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def _launch(ts, tid, correlation):
    return {"cat": "cuda_runtime", "ts": ts, "dur": 1, "tid": tid, "args": {"correlation": correlation}}


def _frame(ts, dur, tid, name):
    return {"cat": "python_function", "ts": ts, "dur": dur, "tid": tid, "name": name}


def test_an_idle_interval_goes_to_the_frames_open_on_the_thread_that_launches_the_next_kernel():
    trace = {"traceEvents": [
        _kernel(0, 10, 1), _launch(0, 7, 1),
        _kernel(110, 10, 2), _launch(105, 8, 2),  # a 100 us gap, launched from thread 8
        _kernel(121, 4, 3), _launch(100, 7, 3),   # 1 us: below the threshold
        _frame(5, 200, 7, f"/x{SP}deepspeed/runtime/engine.py(1): forward"),
        _frame(10, 100, 8, f"/x{SP}deepspeed/runtime/engine.py(2): backward"),
        _frame(20, 90, 8, f"/x{SP}zero3_ac/runtime/zero/parameter_offload.py(3): pre_forward"),
        _frame(30, 50, 8, f"/x{SP}torch/nn/modules/module.py(4): __call__"),  # ends at 80, before the middle
        _frame(50, 20, 8, f"/x{SP}torch/_tensor.py(5): __hash__"),
        _frame(55, 10, 8, f"/x{SP}torch/_tensor.py(6): __hash__"),  # open at the middle (60)
    ]}
    busy, idle, own, innermost = gap_sites(trace)
    assert (busy, idle) == (24, 100)
    assert own == {os.path.join("zero3_ac", "runtime", "zero", "parameter_offload.py(3): pre_forward"): 100}
    assert innermost == {os.path.join("torch", "_tensor.py(6): __hash__"): 100}


def test_overlapping_gpu_events_are_busy_once_and_leave_no_gap():
    trace = [_kernel(0, 50, 1), _kernel(10, 20, 2), _kernel(40, 30, 3), _kernel(80, 10, 4)]
    busy, idle, own, innermost = gap_sites(trace)
    assert (busy, idle) == (80, 10)
    assert own == {"(none)": 10} and innermost == {"(no Python frame)": 10}
