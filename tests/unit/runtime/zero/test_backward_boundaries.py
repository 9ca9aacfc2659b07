"""The autograd boundaries around a call (``backward_boundaries``): an output's boundary opens the call's slot in
the backward before the call's own nodes; the inputs' boundaries close it once their gradients are computed,
through the one input's node or a multi-grad hook over several; a removed closer closes nothing; a tensor passed
twice is wrapped once; a slot waits only for the gradients the running backward computes. Driven with plain
autograd graphs and a recorder in the place of the module hooks."""

import pytest
import torch

from zero3_ac.runtime.zero.backward_boundaries import InputBoundary, OpenSlotOnGrad, SlotContext


class Recorder:
    """Stands where ``ModuleInvocationHooks`` stands: records the slot events in order."""

    def __init__(self):
        self.events = []

    def open_slot(self, slot):
        self.events.append(("open", slot))

    def close_slot(self, slot):
        self.events.append(("close", slot))


def _call(hooks, inputs, slot="call"):
    """A call of ``sum(inputs) * weight`` with its boundaries; returns its output and the input hook handle."""
    boundary = InputBoundary()
    wrapped = [boundary.wrap(tensor) for tensor in inputs]
    weight = torch.tensor(2.0, requires_grad=True)
    weight.register_hook(lambda grad: hooks.events.append(("weight grad", slot)))
    output = sum(wrapped) * weight
    handle = boundary.close_slot_when_done(hooks, slot)
    return OpenSlotOnGrad.apply(hooks, slot, output), handle, wrapped


@pytest.mark.parametrize("inputs", [1, 2, 3])
def test_a_slot_opens_before_the_calls_nodes_and_closes_after_its_input_gradients(inputs):
    hooks = Recorder()
    tensors = [torch.ones(3, requires_grad=True) for _ in range(inputs)]
    output, handle, _ = _call(hooks, tensors)
    output.sum().backward()
    assert hooks.events == [("open", "call"), ("weight grad", "call"), ("close", "call")]
    assert all(torch.equal(tensor.grad, torch.full((3, ), 2.0)) for tensor in tensors)
    handle.remove()


def test_the_one_input_closer_is_its_handle_and_a_removed_one_closes_nothing():
    hooks = Recorder()
    output, handle, _ = _call(hooks, [torch.ones(3, requires_grad=True)])
    assert not isinstance(handle, torch.utils.hooks.RemovableHandle)  # no multi-grad hook for one input
    handle.remove()
    output.sum().backward()
    assert hooks.events == [("open", "call"), ("weight grad", "call")]


def test_a_removed_multi_grad_hook_closes_nothing():
    hooks = Recorder()
    output, handle, _ = _call(hooks, [torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)])
    handle.remove()
    output.sum().backward()
    assert hooks.events == [("open", "call"), ("weight grad", "call")]


def test_a_tensor_passed_twice_is_wrapped_once_and_frozen_ones_not_at_all():
    hooks = Recorder()
    shared, frozen = torch.ones(3, requires_grad=True), torch.ones(3)
    output, handle, wrapped = _call(hooks, [shared, shared, frozen])
    assert wrapped[0] is wrapped[1] and wrapped[0] is not shared and wrapped[2] is frozen
    output.sum().backward()
    assert hooks.events[-1] == ("close", "call") and torch.equal(shared.grad, torch.full((3, ), 4.0))
    handle.remove()


def test_two_calls_sharing_an_input_each_close_their_own_slot():
    hooks = Recorder()
    shared = torch.ones(3, requires_grad=True)
    first, first_handle, _ = _call(hooks, [shared], slot="first")
    second, second_handle, _ = _call(hooks, [shared], slot="second")
    (first.sum() + (second * first.detach()).sum()).backward()
    closes = [slot for event, slot in hooks.events if event == "close"]
    assert sorted(closes) == ["first", "second"]
    first_handle.remove()
    second_handle.remove()


def test_a_slot_awaits_only_the_gradients_the_running_backward_computes():
    used, unused = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    context = SlotContext(awaited_params=[used, unused])
    seen = []

    def on_opening(grads):  # inside the backward, as the slot's opening is
        context.await_only_computed_grads()
        seen.append(set(context.awaiting_grads))

    loss = (used * 3).sum()
    loss.grad_fn.register_prehook(on_opening)
    loss.backward()
    assert seen == [{used}]
    assert context.awaited_params == (used, unused)
