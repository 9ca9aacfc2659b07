"""Walks cached per tree shape (zero3_ac/utils/module_tree.py, Note [Module trees that change shape]).

Real ``torch.nn`` modules changed the ways models change after they are built (PEFT's module
replacement, tied weights, a param registered by name, a new child), in any order hypothesis picks:
the cached walk is always what a fresh walk gives, and is reused while nothing changed.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zero3_ac.utils import module_tree

ATTR = "_test_module_tree_params"


@pytest.fixture
def counting():
    was_counting = module_tree.generation() is not None
    module_tree.start_counting()
    yield
    if not was_counting:
        module_tree.stop_counting()


def walk(root):
    return root.parameters()


def cached(root):
    return module_tree.cached_walk(root, ATTR, walk)


def fresh(root):
    """A fresh walk's params, by identity (two different tensors do not compare as booleans)."""
    return [id(param) for param in walk(root)]


def ids(params):
    return [id(param) for param in params]


def tree():
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))


def _replace_child(root):  # what PEFT's get_peft_model does to each target layer
    root[1][0] = torch.nn.Linear(2, 3)


def _register_parameter(root):
    root[0].register_parameter("scale", torch.nn.Parameter(torch.ones(2)))


def _assign_parameter(root):
    root[1][0].bias = torch.nn.Parameter(torch.zeros(2))


def _tie_weights(root):  # what transformers' tie_weights does to the output embedding
    root[1][0].weight = root[0].weight


def _add_child(root):
    root.add_module(f"extra{len(root)}", torch.nn.Linear(1, 1))


def _touch_values(root):  # in-place updates, as an optimizer step makes, change no shape
    with torch.no_grad():
        for param in root.parameters():
            param.add_(1)


CHANGES = [_replace_child, _register_parameter, _assign_parameter, _tie_weights, _add_child]


def test_a_walk_is_reused_until_a_param_or_module_is_registered(counting):
    root = tree()
    first = cached(root)
    _touch_values(root)
    assert cached(root) is first
    _register_parameter(root)
    second = cached(root)
    assert second is not first and ids(second) == fresh(root)
    assert cached(root) is second


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(CHANGES + [_touch_values]), max_size=8))
def test_the_cached_walk_always_equals_a_fresh_walk(counting, changes):
    root = tree()
    for change in changes:
        before = cached(root)
        change(root)
        after = cached(root)
        assert ids(after) == fresh(root)
        if change is _touch_values:
            assert after is before


def test_nothing_is_reused_while_counting_is_stopped(counting):
    root = tree()
    module_tree.stop_counting()
    try:
        assert module_tree.generation() is None
        assert cached(root) is not cached(root)
    finally:
        module_tree.start_counting()


def test_counting_again_forgets_the_walks_cached_before(counting):
    root = tree()
    first = cached(root)
    module_tree.stop_counting()
    _assign_parameter(root)  # not seen: nothing was counting
    module_tree.start_counting()
    assert cached(root) is not first and ids(cached(root)) == fresh(root)


def test_a_slice_of_managed_layers_is_no_change_but_a_managed_container_gaining_one_is(counting):
    root = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)]))
    for number, module in enumerate(root.modules()):
        module.ds_id = number  # what ZeRO-3's hook registration gives every module it manages
    first = cached(root)
    layers = root[0][:2]  # transformers' decoders do this in every forward
    assert len(layers) == 2 and cached(root) is first
    root[0].append(root[0][0])  # a managed container gaining a (shared) layer is a change
    assert cached(root) is not first and ids(cached(root)) == fresh(root)


def test_a_torch_without_the_global_hooks_counts_nothing_and_reuses_nothing(counting, monkeypatch):
    module_tree.stop_counting()
    monkeypatch.delattr(module_tree.torch_module, "register_module_module_registration_hook")
    module_tree.start_counting()
    root = tree()
    assert module_tree.generation() is None and cached(root) is not cached(root)
    monkeypatch.undo()
    module_tree.start_counting()
