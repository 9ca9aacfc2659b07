"""The CUDA accelerator's stream query (zero3_ac/accelerator/cuda_accelerator.py): the stream torch
names, with and without a device, on the default stream and inside another stream's context."""

import pytest
import torch

from zero3_ac.accelerator.cuda_accelerator import current_stream

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_no_device_names_the_current_stream_of_the_current_device():
    side = torch.cuda.Stream()
    assert current_stream(None) == torch.cuda.current_stream()
    with torch.cuda.stream(side):
        assert current_stream(None) == side == torch.cuda.current_stream()
        assert current_stream(None, torch.cuda.current_device()) == side
    assert current_stream(None) == torch.cuda.current_stream() != side


def test_a_stream_seen_before_is_answered_with_its_wrapper_and_a_new_one_with_its_own():
    first = current_stream(None)
    assert current_stream(None) is first
    for _ in range(3):
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            assert current_stream(None) == side and current_stream(None) is current_stream(None)
    assert current_stream(None) is first == torch.cuda.current_stream()


def test_the_installed_accelerator_uses_it_once_the_fork_runs_a_zero3_engine():
    import zero3_ac
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from zero3_ac import activation
    if not zero3_ac.is_active():
        pytest.skip("the fork is not active (ZERO3_AC_DISABLE)")
    activation._start_process_wide_changes()  # what the fork's first ZeRO-3 engine does
    assert CUDA_Accelerator.current_stream is current_stream
