"""The fork's module hooks (``parameter_offload.py``): calls with nothing to hold get no backward slot
(Note [Calls with nothing to hold])."""

import copy

import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (DIM, LR, CheckpointedStack, assert_fork_state, fork_disabled,
                                               make_engine, zero_config)


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


def test_wrappers_with_no_params_of_their_own_wait_for_no_gradient():
    """Only the first block waits for its param's gradient (its input needs no grad): not the two
    wrappers and the stack around it, which would each wait for all four trainable params."""
    subscriptions = run_distributed(1, wrapped_stack_case)[0]
    if not fork_disabled():
        assert subscriptions == [1, 1], subscriptions
