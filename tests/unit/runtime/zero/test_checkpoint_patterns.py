"""Checkpointing patterns that stock ZeRO-3 gets wrong, frozen params or not (ZeRO-3, 2 gloo ranks).

Each case trains against plain PyTorch (same init, data and accumulation) and checks after every
backward and step that nothing is left gathered (``train_and_check``).
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.test_checkpoint_lifecycle import train_and_check
from tests.unit.runtime.zero.zero_case import DIM, CheckpointedStack, FrozenLoraBlock

WORLD_SIZE = 2


class TrainableBlock(torch.nn.Module):
    """A block with no frozen param at all."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.linear(self.norm(x))


BLOCKS = {"frozen": FrozenLoraBlock, "trainable": TrainableBlock}


# ---------------------------------------------------------------------------- early stop off
def early_stop_off_case(block):
    torch.manual_seed(20)
    train_and_check(CheckpointedStack(blocks=3, block=BLOCKS[block]),
                    forward_context=lambda: set_checkpoint_early_stop(False))


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_early_stop_off(block):
    run_distributed(WORLD_SIZE, early_stop_off_case, block)


# ---------------------------------------------------------------------------- outputs backward never reaches
class ExtraOutputBlock(FrozenLoraBlock):
    """Returns a second output that requires grad; the caller drops it."""

    def __init__(self, dim=DIM):
        super().__init__(dim)
        self.extra = torch.nn.Linear(dim, dim)

    def forward(self, x):
        h = self.norm(x)
        return x + self.frozen(h) + self.lora(h), self.extra(h)


class AuxHeadBlock(FrozenLoraBlock):
    """Ends with an aux head whose output nobody uses; the head is frozen or trainable."""

    def __init__(self, dim=DIM, aux_trainable=True):
        super().__init__(dim)
        self.aux = torch.nn.Linear(dim, dim)
        self.aux.requires_grad_(aux_trainable)
        self.aux_output = None

    def forward(self, x):
        out = super().forward(x)
        self.aux_output = self.aux(out)
        return out


class RegionStack(torch.nn.Module):
    """Checkpointed blocks; only each block's first output is used."""

    def __init__(self, make_block, blocks=3, dim=DIM):
        super().__init__()
        self.blocks = torch.nn.ModuleList(make_block() for _ in range(blocks))
        self.head = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        for block in self.blocks:
            out = checkpoint(block, x, use_reentrant=False)
            x = out[0] if isinstance(out, tuple) else out
        return self.head(x).float().pow(2).mean()


UNREACHED = {
    "extra_output": ExtraOutputBlock,
    "trainable_aux_head": lambda: AuxHeadBlock(aux_trainable=True),
    "frozen_aux_head": lambda: AuxHeadBlock(aux_trainable=False),
}


def unreached_output_case(kind, early_stop):
    torch.manual_seed(21)
    train_and_check(RegionStack(UNREACHED[kind]), forward_context=lambda: set_checkpoint_early_stop(early_stop))


@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "no_early_stop"])
@pytest.mark.parametrize("kind", sorted(UNREACHED))
def test_outputs_backward_never_reaches(kind, early_stop):
    run_distributed(WORLD_SIZE, unreached_output_case, kind, early_stop)


# ---------------------------------------------------------------------------- DeepSpeed's checkpoint API
class DeepSpeedCheckpointedStack(CheckpointedStack):

    def forward(self, x):
        import deepspeed
        for block in self.blocks:
            x = deepspeed.checkpointing.non_reentrant_checkpoint(block, x)
        return self.head(x).float().pow(2).mean()


def deepspeed_checkpoint_case(block):
    import deepspeed
    deepspeed.checkpointing.configure(None)
    torch.manual_seed(22)
    train_and_check(DeepSpeedCheckpointedStack(blocks=3, block=BLOCKS[block]))


def _deepspeed_checkpoint_runs_here() -> bool:
    """DeepSpeed 0.19.2's non_reentrant_checkpoint opens an accelerator stream, which the CPU one lacks."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from packaging.version import Version
    return Version(deepspeed.__version__) >= Version("0.19.3") or get_accelerator().Stream is not None


@pytest.mark.skipif(not _deepspeed_checkpoint_runs_here(),
                    reason="this DeepSpeed's non_reentrant_checkpoint needs accelerator streams (none on CPU)")
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_deepspeed_non_reentrant_checkpoint(block):
    run_distributed(WORLD_SIZE, deepspeed_checkpoint_case, block)


# ---------------------------------------------------------------------------- the module stack
def module_stack_case(use_reentrant):
    from deepspeed.runtime.zero import parameter_offload
    depths = []
    torch.manual_seed(23)
    train_and_check(RegionStack(UNREACHED["trainable_aux_head"]) if not use_reentrant else CheckpointedStack(
        blocks=3, use_reentrant=True),
                    steps=4,
                    after_backward=lambda engine, index: depths.append(len(parameter_offload.FWD_MODULE_STACK)))
    assert len(set(depths)) == 1, f"DeepSpeed's forward-module stack changed size across backwards: {depths}"


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_module_stack_stays_flat(use_reentrant):
    run_distributed(WORLD_SIZE, module_stack_case, use_reentrant)
