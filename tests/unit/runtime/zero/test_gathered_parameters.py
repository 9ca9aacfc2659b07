"""``deepspeed.zero.GatheredParameters(param, fwd_module=module)`` inside ``module``'s forward (2 gloo ranks).

DeepSpeed's own docs show it: a module gathers a child's weight for another child, and registers it
as its own external param, so that ZeRO-3 gathers it again for the module's backward. From the
second step on, the module's own fetch has gathered the param before its forward runs (it is an
external param now), and the context's exit finds it held by the running module: stock DeepSpeed
raises ``Cannot free a ZeRO-3 parameter while it is still active in submodules``. PEFT AdaLoRA's
orthogonal regulariser gathers this way in its first step only, because it asks whether the
param is partitioned first. Each case trains against plain PyTorch (where the context does
nothing) for several steps and checks that nothing is left gathered or held.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.test_checkpoint_lifecycle import train_and_check
from tests.unit.runtime.zero.zero_case import DIM

WORLD_SIZE = 2
STEPS = 3


class WeightTakingLayer(torch.nn.Module):
    """A layer whose forward takes another layer's weight, as in DeepSpeed's example."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.own = torch.nn.Linear(dim, dim)

    def forward(self, x, weight):
        return self.own(x) + torch.nn.functional.linear(x, weight)


class GathersForAnotherLayer(torch.nn.Module):
    """``layer2`` uses ``layer1``'s weight, which the module gathers with ``fwd_module=self``."""

    def __init__(self, frozen, checkpointing, dim=DIM):
        super().__init__()
        self.layer1 = torch.nn.Linear(dim, dim)
        self.layer2 = WeightTakingLayer(dim)
        self.head = torch.nn.Linear(dim, dim, bias=False)
        self.layer1.requires_grad_(not frozen)
        self.checkpointing = checkpointing

    def body(self, x):
        import deepspeed
        x = torch.tanh(self.layer1(x))
        with deepspeed.zero.GatheredParameters(self.layer1.weight, fwd_module=self):
            return torch.tanh(self.layer2(x, self.layer1.weight))

    def forward(self, x):
        if self.checkpointing == "none":
            h = self.body(x)
        else:
            h = checkpoint(self.body, x, use_reentrant=self.checkpointing == "reentrant")
        return self.head(h).float().pow(2).mean()


def gathered_for_another_layer_case(frozen, checkpointing):
    torch.manual_seed(70)
    train_and_check(GathersForAnotherLayer(frozen, checkpointing), steps=STEPS, check_regather=False)


@pytest.mark.stock_fails
@pytest.mark.parametrize("frozen, checkpointing", [(False, "none"), (True, "none"), (False, "reentrant"),
                                                   (True, "nonreentrant")])
def test_gathered_parameters_with_fwd_module_inside_the_forward(frozen, checkpointing):
    run_distributed(WORLD_SIZE, gathered_for_another_layer_case, frozen, checkpointing)


class BroadcastsIntoAHeldParam(torch.nn.Module):
    """Opens ``GatheredParameters(..., modifier_rank=0, fwd_module=self)`` in its forward."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.layer1 = torch.nn.Linear(dim, dim)
        self.layer2 = WeightTakingLayer(dim)

    def forward(self, x):
        import deepspeed
        x = torch.tanh(self.layer1(x))
        with deepspeed.zero.GatheredParameters(self.layer1.weight, modifier_rank=0, fwd_module=self):
            return self.layer2(x, self.layer1.weight).pow(2).mean()


def broadcast_into_held_param_case():
    import deepspeed.comm as dist
    from tests.unit.runtime.zero.zero_case import assert_fork_state, make_engine, micro_batches, zero_config
    assert_fork_state()
    torch.manual_seed(71)
    engine = make_engine(BroadcastsIntoAHeldParam(), zero_config(3))
    x = micro_batches(1, dist.get_world_size())[0][dist.get_rank()]
    try:
        engine.backward(engine(x))  # the first forward gathers the param itself: nothing holds it
        engine.step()
        with pytest.raises(RuntimeError, match="outside the engine's forward and backward"):
            engine(x)
    finally:
        engine.destroy()


@pytest.mark.stock_fails
def test_an_update_broadcast_into_a_param_a_module_holds_is_refused_with_the_fix():
    run_distributed(WORLD_SIZE, broadcast_into_held_param_case)
