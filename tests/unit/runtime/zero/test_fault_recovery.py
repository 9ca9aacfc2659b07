"""After a step that went wrong, the next step runs clean (ZeRO-3, 2 gloo ranks).

The faults raised inside a recompute or a backward are in ``test_checkpoint_lifecycle``; here: an
fp16 overflow that skips the step, and forwards whose backward never runs. Each case trains
against plain PyTorch on the clean steps only and checks that nothing is left gathered or held.
"""

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (CheckpointedStack, assert_close_deltas, assert_fork_state,
                                               assert_partitioned, make_engine, micro_batches, named_values,
                                               reference_deltas, zero_config)

WORLD_SIZE = 2


class ArmableStack(CheckpointedStack):
    """Its loss becomes infinite while ``overflow`` is set."""

    overflow = False

    def forward(self, x):
        loss = super().forward(x)
        return loss * float("inf") if self.overflow else loss


def assert_no_bookkeeping(engine, when):
    import zero3_ac
    from deepspeed.runtime.zero import parameter_offload
    stats = zero3_ac.lifecycle_stats(engine)
    if stats is not None:
        assert not any(stats["bookkeeping"].values()), f"{when}: bookkeeping left: {stats['bookkeeping']}"
    return len(parameter_offload.FWD_MODULE_STACK)


def train_after(fault, model, dtype, config):
    """Run ``fault(engine, batch)`` once, then train on clean batches and compare with PyTorch."""
    import deepspeed.comm as dist
    assert_fork_state()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = micro_batches(4, world_size, dtype, requires_grad=True)
    clean = batches[1:]
    expected = reference_deltas(model, clean, gas=1)
    engine = make_engine(model, config)
    initial = named_values(engine)
    fault(engine, batches[0][rank])
    assert_partitioned(engine, "after the fault")
    stack_depth = None
    for index, row in enumerate(clean):
        engine.backward(engine(row[rank]))
        assert_partitioned(engine, f"after backward {index}")
        engine.step()
        assert_partitioned(engine, f"after step {index}")
        depth = assert_no_bookkeeping(engine, f"after step {index}")
        assert stack_depth in (None, depth), f"DeepSpeed's module stack grew from {stack_depth} to {depth}"
        stack_depth = depth
    final = named_values(engine)
    assert_close_deltas({name: final[name] - initial[name] for name in expected}, expected, dtype)
    engine.destroy()


# ---------------------------------------------------------------------------- fp16 overflow
def _overflow(engine, batch):
    engine.module.overflow = True
    engine.backward(engine(batch))
    engine.module.overflow = False
    engine.step()
    assert engine.skipped_steps == 1, f"the overflowing step was not skipped ({engine.skipped_steps} skipped)"


def fp16_overflow_case(use_reentrant):
    torch.manual_seed(30)
    config = zero_config(3, torch.float16)
    config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
    train_after(_overflow, ArmableStack(blocks=3, use_reentrant=use_reentrant).half(), torch.float16, config)


def _fp16_on_cpu() -> bool:
    return torch.ops.mkldnn._is_mkldnn_fp16_supported()


@pytest.mark.skipif(not _fp16_on_cpu(), reason="the CPU accelerator has no fp16 here (covered on GPU)")
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_fp16_overflow_skips_the_step_and_the_next_runs_clean(use_reentrant):
    run_distributed(WORLD_SIZE, fp16_overflow_case, use_reentrant)


# ---------------------------------------------------------------------------- forward, no backward
def _forwards_without_backward(engine, batch):
    engine(batch)
    assert_partitioned(engine, "after a forward whose backward never runs")
    with torch.no_grad():
        engine(batch)
    engine.eval()
    engine(batch)
    engine.train()


def forward_only_case(use_reentrant):
    torch.manual_seed(31)
    train_after(_forwards_without_backward, CheckpointedStack(blocks=3, use_reentrant=use_reentrant), torch.float32,
                zero_config(3))


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_forward_without_backward_then_train(use_reentrant):
    run_distributed(WORLD_SIZE, forward_only_case, use_reentrant)
