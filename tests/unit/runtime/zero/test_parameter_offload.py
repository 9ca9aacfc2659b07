"""The fork's module hooks (``parameter_offload.py``): calls with nothing to hold get no backward slot
(Note [Calls with nothing to hold]), except the engine's root module (Note [The root's outputs and
DeepSpeed's accumulation hooks])."""

import copy

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (DIM, LR, CheckpointedStack, FrozenLoraBlock, assert_close_deltas,
                                               assert_fork_state, fork_disabled, make_engine, micro_batches,
                                               named_values, reference_deltas, zero_config)

GAS = 2


class Wrapper(torch.nn.Module):
    """A module with no params of its own around another, as PEFT's ``PeftModel`` and ``LoraModel`` are."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def wrapped_stack_case():
    from zero3_ac.runtime.zero.parameter_offload import lifecycle_hooks
    assert_fork_state()
    torch.manual_seed(5)
    model = Wrapper(Wrapper(CheckpointedStack()))
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD([param for param in reference.parameters() if param.requires_grad], lr=LR)
    engine = make_engine(model, zero_config(3))
    hooks = lifecycle_hooks(engine.optimizer.parameter_offload)
    subscriptions = []
    for step in range(2):
        x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(step))  # needs no grad, as token ids
        loss = engine(x)
        if hooks is not None:
            subscriptions.append(sum(len(slots) for slots in hooks._slots_awaiting_grad.values()))
        expected = reference(x)
        assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-7), f"step {step}: {loss} vs {expected}"
        engine.backward(loss)
        engine.step()
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    return subscriptions


@pytest.mark.stock_fails  # stock up to 0.19.2: CheckpointError in the stack's non-reentrant recompute
def test_wrappers_with_no_params_of_their_own_wait_for_no_gradient():
    """The first block (its input needs no grad) waits for its one trainable param's gradient; the root,
    the inner wrapper and the stack, with no params of their own, wait for none (the root keeps a slot,
    which the drain at the end of its backward closes)."""
    subscriptions = run_distributed(1, wrapped_stack_case)[0]
    if not fork_disabled():
        assert subscriptions == [1, 1], subscriptions


class LossAndLogits(torch.nn.Module):
    """No params of its own, and returns its loss beside the logits it computed it from, as an HF causal LM."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(FrozenLoraBlock(DIM) for _ in range(2))
        self.head = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return {"loss": logits.float().pow(2).mean(), "logits": logits}


def loss_and_logits_case():
    assert_fork_state()
    torch.manual_seed(7)
    model = LossAndLogits()
    batches = micro_batches(2 * GAS, 1)
    expected = reference_deltas(model, batches, GAS, forward=lambda module, x, index: module(x)["loss"])
    engine = make_engine(model, zero_config(3, gas=GAS))
    initial = named_values(engine)
    for row in batches:
        engine.backward(engine(row[0])["loss"])
        engine.step()
    final = named_values(engine)
    assert_close_deltas({name: final[name] - initial[name] for name in expected}, expected, torch.float32)


def test_a_root_returning_its_loss_and_logits_is_scaled_for_accumulation_once():
    """On DeepSpeed 0.18.5 to 0.19.2 the engine hooks both outputs; without the root's slot the loss's gradient
    would be divided by the accumulation steps twice (half the update at GAS 2)."""
    run_distributed(1, loss_and_logits_case)
