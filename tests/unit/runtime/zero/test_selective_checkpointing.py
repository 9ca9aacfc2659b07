"""Selective activation checkpointing (``create_selective_checkpoint_contexts``) under ZeRO-3.

ZeRO-3 replaces ``torch.nn.functional.linear`` with its memory-efficient linear: DeepSpeed 0.19.3+
at ``deepspeed.initialize``, 0.19.2 inside ``deepspeed.zero.Init``, and in both for the rest of the
process. The blocks get 3-d inputs (batch, sequence, features) and a policy that saves the matmuls,
and the updates must match plain PyTorch's, computed with torch's own linear.
"""

import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (DIM, assert_close_deltas, assert_fork_state, assert_nothing_drained,
                                               assert_partitioned, make_engine, micro_batches, named_values,
                                               reference_deltas, torch_linear, zero_config)

SEQUENCE = 3
GAS = 2
STEPS = 2
SAVED_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class MlpBlock(torch.nn.Module):
    """A residual MLP whose first linear may be frozen (a LoRA-like base weight)."""

    def __init__(self, frozen_up, dim=DIM):
        super().__init__()
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)
        self.up.requires_grad_(not frozen_up)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class SelectiveStack(torch.nn.Module):
    """Blocks each under a selective checkpoint that saves every matmul, then a trainable head."""

    def __init__(self, frozen_up, blocks=2, dim=DIM):
        super().__init__()
        self.blocks = torch.nn.ModuleList(MlpBlock(frozen_up, dim) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        h = x.view(x.shape[0], SEQUENCE, DIM)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False,
                           context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls))
        return self.head(h).pow(2).mean()


def build(frozen_up, zero_init, config):
    import deepspeed
    torch.manual_seed(13)
    if not zero_init:
        return SelectiveStack(frozen_up)
    with deepspeed.zero.Init(config_dict_or_path=config):
        return SelectiveStack(frozen_up)


def selective_checkpoint_case(frozen_up, zero_init):
    import deepspeed.comm as dist
    assert_fork_state()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    config = zero_config(3, gas=GAS)
    reference = build(frozen_up, zero_init=False, config=config)
    batches = micro_batches(STEPS * GAS, world_size, dim=SEQUENCE * DIM)
    with torch_linear():
        expected = reference_deltas(reference, batches, GAS)
    engine = make_engine(build(frozen_up, zero_init, config), config)
    initial = named_values(engine)
    for name, param in reference.named_parameters():
        assert torch.equal(initial[name], param.detach()), f"{name}: the ZeRO-3 model starts from other values"
    for index, row in enumerate(batches):
        loss = engine(row[rank])
        loss.backward()
        assert_partitioned(engine, f"after backward {index}")
        engine.step()
        assert_partitioned(engine, f"after step {index}")
    final = named_values(engine)
    assert_close_deltas({name: final[name] - initial[name] for name in expected}, expected, torch.float32)
    assert_nothing_drained(engine, "selective checkpointing")
    engine.destroy()


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("zero_init", [False, True], ids=["built_plain", "built_in_zero_init"])
@pytest.mark.parametrize("frozen_up", [False, True], ids=["all_trainable", "frozen_up"])
def test_selective_checkpointing_trains_like_pytorch(frozen_up, zero_init, world_size):
    run_distributed(world_size, selective_checkpoint_case, frozen_up, zero_init)
