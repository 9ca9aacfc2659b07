"""Unit and property tests of the gather-unit rules (invocation_lifecycle's [Gather units]).

Modules are string keys of a tree given as a dict of children; what the adapter reads from a
model (leaf marks, candidates, param counts, parents) is given as plain sets and dicts.
"""

import collections

from hypothesis import given
from hypothesis import strategies as st

from zero3_ac.runtime.zero.invocation_lifecycle import choose_gather_units, leaves_inside

BUDGET = 100


def units(tree, leaves=(), candidates=(), numel=None, budget=BUDGET, root="root"):
    numel = numel or {}
    parents = collections.Counter(child for kids in tree.values() for child in set(kids))

    def numel_under(module):
        seen, stack, total = set(), [module], 0
        while stack:
            node = stack.pop()
            if node not in seen:
                seen.add(node)
                total += numel.get(node, 0)
                stack.extend(tree.get(node, ()))
        return total

    return choose_gather_units(root,
                               children=lambda module: tree.get(module, []),
                               is_leaf=lambda module: module in leaves,
                               is_candidate=lambda module: module in candidates,
                               numel_under=numel_under,
                               parent_count=parents.__getitem__,
                               max_live_numel=budget)


LLAMA = {
    "root": ["embed", "layers", "head"],
    "layers": ["layer0", "layer1"],
    "layer0": ["attn0", "mlp0"],
    "layer1": ["attn1", "mlp1"],
    "attn0": ["q0", "lora0"],
}


def test_no_candidates_no_leaves_means_no_units():
    assert units(LLAMA) == []


def test_each_checkpointed_block_is_a_unit_in_model_order():
    assert units(LLAMA, candidates={"layer0", "layer1"}) == ["layer0", "layer1"]


def test_a_user_leaf_is_a_unit_whatever_the_setting_or_budget():
    assert units(LLAMA, leaves={"mlp1"}, numel={"mlp1": 10 * BUDGET}) == ["mlp1"]


def test_the_outermost_candidate_wins_and_nothing_inside_it_is_a_unit():
    assert units(LLAMA, leaves={"lora0"}, candidates={"layers", "layer0", "attn0"}) == ["layers"]


def test_a_candidate_over_the_live_budget_gathers_module_by_module_and_inner_candidates_may_be_units():
    numel = {"q0": 60, "lora0": 1, "mlp0": 60, "attn1": 10}
    assert units(LLAMA, candidates={"layer0", "attn0", "layer1"}, numel=numel) == ["attn0", "layer1"]


def test_a_candidate_at_the_budget_is_a_unit():
    assert units(LLAMA, candidates={"layer0"}, numel={"q0": BUDGET}) == ["layer0"]


def test_a_candidate_with_a_module_shared_with_the_rest_of_the_model_is_not_a_unit():
    tree = dict(LLAMA, head=["q0"])  # q0 hangs under attn0 and under head
    assert units(tree, candidates={"layer0", "layer1", "attn0"}) == ["layer1"]


def test_a_shared_candidate_itself_may_be_a_unit():
    tree = dict(LLAMA, head=["layer1"])  # layer1 is called from two places; its hooks are its own
    assert units(tree, candidates={"layer1"}) == ["layer1"]


def test_a_module_reached_again_through_its_second_parent_is_walked_once_and_the_walk_goes_on():
    tree = {"root": ["a", "b", "c"], "a": ["shared"], "b": ["shared"]}
    assert units(tree, candidates={"c"}) == ["c"]
    assert units(tree, leaves={"shared"}, candidates={"c"}) == ["shared", "c"]


def test_the_root_may_be_a_unit():
    assert units(LLAMA, candidates={"root", "layer0"}) == ["root"]


def test_a_users_leaf_inside_a_unit_is_found_for_its_gradient_reduction():
    assert units(LLAMA, leaves={"mlp0", "lora0"}, candidates={"layer0"}) == ["layer0"]
    assert leaves_inside("layer0", children=lambda module: LLAMA.get(module, []),
                         is_leaf=lambda module: module in {"mlp0", "lora0", "attn0"}) == ["attn0", "mlp0"]


def test_a_unit_is_not_inside_itself():
    assert leaves_inside("layer0", children=lambda module: LLAMA.get(module, []), is_leaf=lambda module: True) == [
        "attn0", "mlp0"
    ]


# ---------------------------------------------------------------------------------------------
# properties over random trees (with shared modules)


@st.composite
def models(draw):
    size = draw(st.integers(1, 12))
    names = [f"m{index}" for index in range(size)]
    tree = {name: [] for name in names}
    for index in range(1, size):
        tree[names[draw(st.integers(0, index - 1))]].append(names[index])
    for _ in range(draw(st.integers(0, 2))):  # a module also hung under an earlier one: sharing
        child = draw(st.integers(1, size - 1)) if size > 1 else 0
        parent = draw(st.integers(0, child - 1)) if child else 0
        if child and names[child] not in tree[names[parent]]:
            tree[names[parent]].append(names[child])
    pick = st.sets(st.sampled_from(names))
    numel = draw(st.dictionaries(st.sampled_from(names), st.integers(0, 60)))
    return tree, draw(pick), draw(pick), numel, names[0]


def _under(tree, module):
    seen, stack = set(), list(tree.get(module, ()))
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(tree.get(node, ()))
    return seen


@given(models())
def test_units_do_not_nest_every_unit_is_reached_by_a_path_through_no_other_unit(model):
    """A module shared into a user's leaf from outside it is still reached from outside: it can be a unit."""
    tree, leaves, candidates, numel, root = model
    chosen = units(tree, leaves, candidates, numel, root=root)
    assert len(chosen) == len(set(chosen))
    reached, stack = set(), [root]
    while stack:
        module = stack.pop()
        if module not in reached:
            reached.add(module)
            if module not in chosen:
                stack.extend(tree.get(module, ()))
    assert set(chosen) <= reached
    for unit in chosen:
        if unit not in leaves:
            assert not _under(tree, unit) & set(chosen)


@given(models())
def test_every_unit_is_a_leaf_or_an_admissible_candidate_and_every_admissible_module_is_covered(model):
    tree, leaves, candidates, numel, root = model
    chosen = units(tree, leaves, candidates, numel, root=root)
    parents = collections.Counter(child for kids in tree.values() for child in set(kids))

    def admissible(module):
        if module in leaves:
            return True
        total = sum(numel.get(node, 0) for node in _under(tree, module) | {module})
        return (module in candidates and total <= BUDGET
                and all(parents[node] <= 1 for node in _under(tree, module)))

    assert all(admissible(unit) for unit in chosen)
    # Walking down from the root, the first admissible module on a path is a unit.
    stack = [root]
    while stack:
        module = stack.pop()
        if admissible(module):
            assert module in chosen
            continue
        stack.extend(tree.get(module, ()))


@given(models())
def test_the_leaves_inside_a_unit_are_the_outermost_leaves_strictly_below_it(model):
    tree, leaves, candidates, numel, root = model
    for unit in units(tree, leaves, candidates, numel, root=root):
        inside = leaves_inside(unit, children=lambda module: tree.get(module, []), is_leaf=leaves.__contains__)
        assert len(inside) == len(set(inside)) and set(inside) <= leaves & _under(tree, unit)
        # Every leaf below the unit is one of them or lies under one of them.
        covered = set(inside).union(*(_under(tree, leaf) for leaf in inside))
        assert leaves & _under(tree, unit) <= covered
