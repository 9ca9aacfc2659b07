"""The frozen-param checkpointing matrix: user backward (``loss.backward()``) under ZeRO 1-3."""

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (DIM, CheckpointedStack, assert_close_deltas, assert_fork_state,
                                               assert_no_backward_regather, assert_nothing_drained,
                                               assert_partitioned, make_engine, micro_batches, named_values,
                                               reference_deltas, zero_config)
from zero3_ac.utils.gather_meter import GatherMeter

STEPS = 2


def frozen_matrix_case(use_reentrant, stage, input_requires_grad, gas, dtype_name, persist_frozen_norm):
    import deepspeed.comm as dist
    assert_fork_state()
    dtype = getattr(torch, dtype_name)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    model = CheckpointedStack(use_reentrant=use_reentrant)
    batches = micro_batches(STEPS * gas, world_size, dtype, requires_grad=input_requires_grad)
    expected = reference_deltas(model, batches, gas)
    engine = make_engine(model, zero_config(stage, dtype, gas, persistence=DIM if persist_frozen_norm else 0))
    initial = named_values(engine)
    gathers = GatherMeter(engine) if stage == 3 else None
    for index, row in enumerate(batches):
        if gathers:
            gathers.reset()
        loss = engine(row[rank])
        loss.backward()
        assert_partitioned(engine, f"after backward {index}")
        if gathers and not use_reentrant:
            assert_no_backward_regather(gathers, f"backward {index}")
        engine.step()
        assert_partitioned(engine, f"after step {index}")
    final = named_values(engine)
    assert_close_deltas({name: final[name] - initial[name] for name in expected}, expected, dtype)
    assert_nothing_drained(engine, "frozen matrix")
    engine.destroy()


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("persist_frozen_norm", [False, True], ids=["persist0", "persistnorm"])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("gas", [1, 3], ids=["step_every", "step_delayed"])
@pytest.mark.parametrize("input_requires_grad", [True, False], ids=["input_grad", "input_nograd"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "nonreentrant"])
class TestZeroUserBackwardFrozenParamCheckpointing:

    def test_trains_like_pytorch_and_releases(self, use_reentrant, stage, input_requires_grad, gas, dtype_name,
                                              persist_frozen_norm, world_size):
        run_distributed(world_size, frozen_matrix_case, use_reentrant, stage, input_requires_grad, gas, dtype_name,
                        persist_frozen_norm)
