"""Unit and property tests of the pure per-invocation lifecycle (invocation_lifecycle.py).

The module imports neither torch nor DeepSpeed: modules and params are plain string keys here
("m1", "w1"). The rules under test are those of the module's Notes: [Invocations and holds],
[Backward slots and the ownership map], [Slots that will not open], [Several forwards before a
backward], [Borrows a recompute re-reads] and [Aborted forwards], plus the hand-off budget.
"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from zero3_ac.runtime.zero.invocation_lifecycle import InvocationLifecycle, Phase, State

# ---------------------------------------------------------------------------------------------
# helpers


def forward(lc, module, params=(), **kwargs):
    """Open a plain forward invocation of ``module`` holding ``params``."""
    inv = lc.open_forward(module, in_backward=False, **kwargs)
    lc.hold(inv, params)
    return inv


def recompute(lc, module, params=(), replay=False, **kwargs):
    """Open a recompute (forward inside a backward) of ``module`` holding ``params``."""
    inv = lc.open_forward(module, in_backward=True, replay=replay, **kwargs)
    lc.hold(inv, params)
    return inv


def replay_handoff(lc, module, params, slot=None):
    """A replay recompute of ``module`` that hands ``params`` off to ``slot`` (made if not given)."""
    slot = slot if slot is not None else lc.new_slot(module)
    inv = recompute(lc, module, params, replay=True)
    assert lc.close_forward(inv) == []
    assert params == set() or slot.holds >= set(params)
    return slot


# ---------------------------------------------------------------------------------------------
# [Invocations and holds]: forward invocations


def test_forward_close_returns_params_it_was_last_holder_of():
    lc = InvocationLifecycle()
    inv = forward(lc, "m1", ["w1", "w2"])
    assert inv.phase is Phase.FORWARD and inv.state is State.OPEN
    assert lc.holders("w1") == {inv.id} and lc.is_held("w2")
    assert sorted(lc.close_forward(inv)) == ["w1", "w2"]
    assert inv.state is State.CLOSED and inv.holds == set()
    assert not lc.is_held("w1") and lc.holders("w1") == set()
    assert lc.live() == [] and lc.call_stack == []


def test_param_held_by_two_invocations_is_freed_only_when_both_closed():
    lc = InvocationLifecycle()
    outer = forward(lc, "m1", ["w1", "shared"])
    inner = forward(lc, "m2", ["w2", "shared"])
    assert lc.holders("shared") == {outer.id, inner.id}
    assert sorted(lc.close_forward(inner)) == ["w2"]
    assert lc.holders("shared") == {outer.id}
    assert sorted(lc.close_forward(outer)) == ["shared", "w1"]
    assert not lc.is_held("shared")


def test_param_held_by_two_invocations_freed_when_both_closed_in_any_order():
    lc = InvocationLifecycle()
    a = forward(lc, "m1", ["shared"])
    b = forward(lc, "m2", ["shared"])
    # closing the outer one first pops (and retires) the inner one too: both close in one call
    assert lc.close_forward(a) == ["shared"]
    assert b.state is State.CLOSED


def test_invocation_ids_are_unique_and_negative():
    lc = InvocationLifecycle()
    invs = [forward(lc, "m1"), lc.new_slot("m1"), recompute(lc, "m2"), lc.new_slot("m2")]
    lc.drain()
    invs += [forward(lc, "m1"), lc.new_slot("m3")]
    ids = [inv.id for inv in invs]
    assert len(set(ids)) == len(ids)
    assert all(i < 0 for i in ids)


def test_hold_is_idempotent_for_one_invocation():
    lc = InvocationLifecycle()
    inv = forward(lc, "m1", ["w1"])
    lc.hold(inv, ["w1", "w1"])
    assert lc.holders("w1") == {inv.id}
    assert lc.close_forward(inv) == ["w1"]


def test_close_forward_of_a_closed_invocation_returns_nothing():
    lc = InvocationLifecycle()
    inv = forward(lc, "m1", ["w1"])
    assert lc.close_forward(inv) == ["w1"]
    assert lc.close_forward(inv) == []


# ---------------------------------------------------------------------------------------------
# [Backward slots and the ownership map]: replay recompute


def test_replay_recompute_hands_its_holds_to_the_slot_of_its_module():
    lc = InvocationLifecycle()
    f = forward(lc, "m1", ["w1"])
    slot = lc.new_slot("m1")
    assert slot.phase is Phase.BACKWARD and slot.state is State.PENDING
    assert lc.close_forward(f, own_slot=slot) == ["w1"]  # a plain forward frees at close

    r = recompute(lc, "m1", ["w1", "w2"], replay=True)
    assert r.phase is Phase.RECOMPUTE and r.replay
    assert lc.close_forward(r) == []  # nothing freed: handed off
    assert r.state is State.CLOSED and r.holds == set()
    assert slot.holds == {"w1", "w2"} and slot.matched
    assert lc.holders("w1") == {slot.id} and lc.holders("w2") == {slot.id}

    assert lc.open_backward(slot) == []
    assert sorted(lc.close_backward(slot)) == ["w1", "w2"]
    assert slot.state is State.CLOSED and not lc.is_held("w1") and not lc.is_held("w2")


def test_replay_recompute_picks_the_newest_unclosed_unmatched_slot_of_its_module():
    lc = InvocationLifecycle()
    old = lc.new_slot("m1")
    new = lc.new_slot("m1")
    other = lc.new_slot("m2")  # newer, but another module
    closed = lc.new_slot("m1")
    lc.close_backward(closed)

    r = recompute(lc, "m1", ["w1"], replay=True)
    lc.close_forward(r)
    assert new.holds == {"w1"} and new.matched
    assert old.holds == set() and not old.matched
    assert other.holds == set() and closed.holds == set()


def test_two_slots_two_replays_each_slot_matched_once_params_held_until_both_closed():
    lc = InvocationLifecycle()
    s1 = lc.new_slot("m1")
    s2 = lc.new_slot("m1")
    r1 = recompute(lc, "m1", ["w1"], replay=True)
    assert lc.close_forward(r1) == []
    r2 = recompute(lc, "m1", ["w1"], replay=True)
    assert lc.close_forward(r2) == []
    assert s1.matched and s2.matched
    assert s1.holds == {"w1"} and s2.holds == {"w1"}
    assert lc.holders("w1") == {s1.id, s2.id}

    assert lc.close_backward(s2) == []
    assert lc.is_held("w1") and lc.holders("w1") == {s1.id}
    assert lc.close_backward(s1) == ["w1"]
    assert not lc.is_held("w1")


def test_third_replay_after_both_slots_matched_frees_at_close():
    lc = InvocationLifecycle()
    lc.new_slot("m1")
    lc.new_slot("m1")
    for _ in range(2):
        lc.close_forward(recompute(lc, "m1", ["w1"], replay=True))
    r3 = recompute(lc, "m1", ["w2"], replay=True)
    assert lc.close_forward(r3) == ["w2"]


def test_replay_recompute_can_be_consumed_by_an_open_slot():
    lc = InvocationLifecycle()
    slot = lc.new_slot("m1")
    lc.open_backward(slot)
    r = recompute(lc, "m1", ["w1"], replay=True)
    assert lc.close_forward(r) == []
    assert slot.holds == {"w1"}
    assert lc.close_backward(slot) == ["w1"]


def test_replay_recompute_with_no_slot_for_its_module_frees_at_close():
    lc = InvocationLifecycle()
    other = lc.new_slot("m2")
    r = recompute(lc, "m1", ["w1"], replay=True)
    assert lc.close_forward(r) == ["w1"]
    assert other.holds == set() and not other.matched
    assert not lc.is_held("w1")


def test_replay_recompute_ignores_own_slot_and_uses_the_module_slots():
    lc = InvocationLifecycle()
    module_slot = lc.new_slot("m1")
    unrelated = lc.new_slot("m2")
    r = recompute(lc, "m1", ["w1"], replay=True)
    assert lc.close_forward(r, own_slot=unrelated) == []
    assert module_slot.holds == {"w1"} and unrelated.holds == set()


def test_replay_recompute_with_only_closed_slots_frees_at_close():
    lc = InvocationLifecycle()
    s = lc.new_slot("m1")
    lc.open_backward(s)
    lc.close_backward(s)
    r = recompute(lc, "m1", ["w1"], replay=True)
    assert lc.close_forward(r) == ["w1"]


# ---------------------------------------------------------------------------------------------
# reentrant recompute and plain forward


def test_reentrant_recompute_hands_off_to_own_slot():
    lc = InvocationLifecycle()
    r = recompute(lc, "m1", ["w1", "w2"], replay=False)
    own = lc.new_slot("m1")
    assert lc.close_forward(r, own_slot=own) == []
    assert own.holds == {"w1", "w2"}
    assert lc.holders("w1") == {own.id}
    assert sorted(lc.close_backward(own)) == ["w1", "w2"]


def test_reentrant_recompute_without_own_slot_frees_at_close():
    lc = InvocationLifecycle()
    lc.new_slot("m1")  # a slot of the same module is not a reentrant recompute's consumer
    r = recompute(lc, "m1", ["w1"], replay=False)
    assert lc.close_forward(r) == ["w1"]


def test_reentrant_recompute_with_a_closed_own_slot_frees_at_close():
    lc = InvocationLifecycle()
    own = lc.new_slot("m1")
    lc.close_backward(own)
    r = recompute(lc, "m1", ["w1"], replay=False)
    assert lc.close_forward(r, own_slot=own) == ["w1"]


def test_plain_forward_never_hands_off_even_with_own_slot():
    lc = InvocationLifecycle()
    slot_m1 = lc.new_slot("m1")
    f = forward(lc, "m1", ["w1"])
    own = lc.new_slot("m1")
    assert lc.close_forward(f, own_slot=own) == ["w1"]
    assert own.holds == set() and slot_m1.holds == set()
    assert not own.matched and not slot_m1.matched


# ---------------------------------------------------------------------------------------------
# [Slots that will not open]


def _dead_slots_lifecycle(dead):
    return InvocationLifecycle(will_open=lambda slot: slot not in dead)


@pytest.mark.parametrize("event", ["open_backward", "close_backward", "reap_aborted"])
def test_replay_for_a_slot_that_will_not_open_holds_until_the_next_backward_event(event):
    dead = []
    lc = _dead_slots_lifecycle(dead)
    unreached = lc.new_slot("aux")
    dead.append(unreached)
    trigger = lc.new_slot("m9")
    r = recompute(lc, "aux", ["w_aux"], replay=True)
    assert lc.close_forward(r) == []
    assert lc.is_held("w_aux") and unreached.holds == set()
    assert lc.size()["unconsumed_replays"] == 1
    freed = lc.reap_aborted() if event == "reap_aborted" else getattr(lc, event)(trigger)
    assert freed == ["w_aux"] and not lc.is_held("w_aux")
    assert lc.size()["unconsumed_replays"] == 0


def test_reaped_replay_for_a_slot_that_will_not_open_is_freed_by_the_reap():
    dead = []
    lc = _dead_slots_lifecycle(dead)
    dead.append(lc.new_slot("aux"))
    recompute(lc, "aux", ["w_aux"], replay=True)
    assert lc.reap_aborted() == ["w_aux"]
    assert lc.live() == dead


def test_will_open_is_asked_only_for_pending_slots_of_replays():
    asked = []
    lc = InvocationLifecycle(will_open=lambda slot: asked.append(slot) or False)
    opened = lc.new_slot("m1")
    lc.open_backward(opened)
    r = recompute(lc, "m1", ["w1"], replay=True)
    assert lc.close_forward(r) == [] and opened.holds == {"w1"}
    own = lc.new_slot("m2")
    reentrant = recompute(lc, "m2", ["w2"], replay=False)
    assert lc.close_forward(reentrant, own_slot=own) == [] and own.holds == {"w2"}
    assert asked == []


def test_drain_forgets_unconsumed_replays():
    dead = []
    lc = _dead_slots_lifecycle(dead)
    dead.append(lc.new_slot("aux"))
    lc.close_forward(recompute(lc, "aux", ["w_aux"], replay=True))
    assert lc.drain().params == ["w_aux"]
    assert not any(lc.size().values())


# ---------------------------------------------------------------------------------------------
# [Aborted forwards]


@pytest.mark.parametrize("event", ["open_backward", "close_backward", "reap_aborted"])
def test_aborted_forward_is_reaped_by_any_backward_event(event):
    lc = InvocationLifecycle()
    slot = lc.new_slot("m9")
    f = forward(lc, "m1", ["w1"])
    inner = forward(lc, "m2", ["w2"])
    freed = lc.reap_aborted() if event == "reap_aborted" else getattr(lc, event)(slot)
    assert sorted(freed) == ["w1", "w2"]
    assert f.state is State.CLOSED and inner.state is State.CLOSED
    assert lc.call_stack == [] and not lc.is_held("w1")
    assert lc.close_forward(f) == []  # a late post-hook finds it closed


@pytest.mark.parametrize("event", ["open_backward", "close_backward", "reap_aborted"])
def test_reaped_replay_recompute_hands_off_like_a_normal_close(event):
    lc = InvocationLifecycle()
    consumer = lc.new_slot("m1")
    trigger = lc.new_slot("m9")
    r = recompute(lc, "m1", ["w1"], replay=True)
    freed = lc.reap_aborted() if event == "reap_aborted" else getattr(lc, event)(trigger)
    assert freed == []
    assert r.state is State.CLOSED
    assert consumer.holds == {"w1"} and consumer.matched
    assert lc.holders("w1") == {consumer.id}


def test_reaped_reentrant_recompute_frees_since_it_has_no_own_slot_yet():
    lc = InvocationLifecycle()
    lc.new_slot("m1")
    recompute(lc, "m1", ["w1"], replay=False)
    assert lc.reap_aborted() == ["w1"]


def test_reap_with_nothing_on_the_call_stack_is_a_no_op():
    lc = InvocationLifecycle()
    slot = lc.new_slot("m1")
    assert lc.reap_aborted() == []
    assert slot.state is State.PENDING and lc.live() == [slot]


def test_closing_an_outer_invocation_pops_and_retires_inner_unclosed_ones():
    lc = InvocationLifecycle()
    outer = forward(lc, "m1", ["w1"])
    middle = forward(lc, "m2", ["w2"])
    inner = forward(lc, "m3", ["w3"])
    assert sorted(lc.close_forward(outer)) == ["w1", "w2", "w3"]
    assert middle.state is State.CLOSED and inner.state is State.CLOSED
    assert lc.call_stack == []


def test_closing_an_outer_invocation_lets_an_inner_replay_hand_off():
    lc = InvocationLifecycle()
    slot = lc.new_slot("m2")
    outer = recompute(lc, "m1", ["w1"], replay=True)  # m1 has no slot: frees
    recompute(lc, "m2", ["w2"], replay=True)  # aborted inside: handed to m2's slot
    assert lc.close_forward(outer) == ["w1"]
    assert slot.holds == {"w2"}


def test_closing_an_inner_invocation_leaves_the_outer_on_the_stack():
    lc = InvocationLifecycle()
    outer = forward(lc, "m1", ["w1"])
    inner = forward(lc, "m2", ["w2"])
    assert lc.close_forward(inner) == ["w2"]
    assert lc.call_stack == [outer] and outer.state is State.OPEN


def test_stack_depth_is_kept_on_the_invocation():
    lc = InvocationLifecycle()
    a = lc.open_forward("m1", in_backward=False, stack_depth=3)
    b = lc.open_forward("m2", in_backward=True, replay=True, stack_depth=7)
    c = lc.open_forward("m3", in_backward=False)
    assert (a.stack_depth, b.stack_depth, c.stack_depth) == (3, 7, -1)


def test_innermost_forward_is_the_newest_open_invocation_of_the_module():
    lc = InvocationLifecycle()
    assert lc.innermost_forward("m1") is None
    first = forward(lc, "m1")
    second = forward(lc, "m1")
    other = forward(lc, "m2")
    assert lc.innermost_forward("m1") is second
    assert lc.innermost_forward("m2") is other
    assert lc.innermost_forward("m3") is None
    lc.close_forward(second)  # pops `other` too
    assert lc.innermost_forward("m1") is first
    assert lc.innermost_forward("m2") is None
    lc.reap_aborted()
    assert lc.innermost_forward("m1") is None


def test_a_forward_is_running_from_its_pre_hook_until_it_closes_or_is_reaped():
    lc = InvocationLifecycle()
    assert not lc.forward_running()
    inv = forward(lc, "m1")
    assert lc.forward_running()
    lc.close_forward(inv)
    assert not lc.forward_running()
    forward(lc, "m1")
    lc.reap_aborted()
    assert not lc.forward_running()


def test_inside_replay_asks_the_innermost_running_forward():
    lc = InvocationLifecycle()
    assert not lc.inside_replay()
    recompute(lc, "m1", replay=True)
    assert lc.inside_replay()
    recompute(lc, "m2", replay=False)
    assert not lc.inside_replay()
    innermost = recompute(lc, "m3", replay=True)
    assert lc.inside_replay()
    lc.close_forward(innermost)
    assert not lc.inside_replay()
    lc.reap_aborted()
    assert not lc.inside_replay()


def test_innermost_forward_treats_modules_as_hashable_keys():
    lc = InvocationLifecycle()
    key, equal_key = "".join(["m", "1"]), "".join(["m", "1"])
    assert key == equal_key and key is not equal_key
    inv = lc.open_forward(key, in_backward=False)
    assert lc.innermost_forward(equal_key) is inv


# ---------------------------------------------------------------------------------------------
# drain


def test_drain_retires_every_live_invocation_and_returns_what_was_held():
    lc = InvocationLifecycle()
    pending = lc.new_slot("m2")
    replay_handoff(lc, "m2", {"w2"}, slot=pending)  # pending slot holding a hand-off
    opened = lc.new_slot("m3")
    lc.open_backward(opened)
    lc.hold(opened, ["w3", "w1"])
    forward(lc, "m1", ["w1"])  # open forward
    recompute(lc, "m4", ["w4"], replay=True)  # open recompute
    lc.new_slot("m5")  # empty pending slot
    live_before = len(lc.live())

    report = lc.drain()
    assert report.invocations == live_before == 5
    assert sorted(report.params) == ["w1", "w2", "w3", "w4"]
    assert not any(lc.size().values()), lc.size()
    assert all(not lc.is_held(p) and lc.holders(p) == set() for p in ["w1", "w2", "w3", "w4"])
    assert lc.live() == [] and lc.call_stack == [] and lc.pending_slots("m2") == []
    assert pending.state is State.CLOSED and opened.state is State.CLOSED


def test_drain_of_an_empty_lifecycle_reports_nothing():
    report = InvocationLifecycle().drain()
    assert report.invocations == 0 and report.params == []


# ---------------------------------------------------------------------------------------------
# [Several forwards before a backward]


def test_drain_keeps_reachable_pending_slots_without_their_holds():
    lc = InvocationLifecycle()
    first, second = lc.new_slot("m1"), lc.new_slot("m1")
    replay_handoff(lc, "m1", {"w1"}, slot=second)
    stuck = forward(lc, "m2", ["w2"])
    report = lc.drain(reachable=lambda slot: slot is second or slot is first)
    assert sorted(report.params) == ["w1", "w2"] and report.invocations == 2
    assert stuck.state is State.CLOSED
    assert first.state is State.PENDING and second.state is State.PENDING and second.holds == set()
    assert not second.matched, "a kept slot may be matched by the next backward's replay"
    assert lc.pending_slots("m1") == [first, second]


def test_drain_counts_every_kept_slot_that_lost_holds():
    lc = InvocationLifecycle()
    for module, param in [("m1", "w1"), ("m2", "w2")]:
        lc.hold(lc.new_slot(module), [param])
    report = lc.drain(reachable=lambda slot: True)
    assert report.invocations == 2 and sorted(report.params) == ["w1", "w2"]
    assert len(lc.live()) == 2


def test_replay_skips_a_newer_slot_this_backward_will_not_open():
    wont_open = set()
    lc = InvocationLifecycle(will_open=lambda slot: slot.id not in wont_open)
    older, newer = lc.new_slot("m1"), lc.new_slot("m1")  # two forwards; the backward of the older runs
    wont_open.add(newer.id)
    replay_handoff(lc, "m1", {"f1"}, slot=older)
    assert older.matched and not newer.matched and newer.holds == set()


def test_replay_with_only_unopened_slots_keeps_its_holds_until_the_next_backward_event():
    lc = InvocationLifecycle(will_open=lambda slot: False)
    slot = lc.new_slot("m1")
    inv = recompute(lc, "m1", ["f1"], replay=True)
    assert lc.close_forward(inv) == [] and lc.is_held("f1") and not slot.matched
    assert lc.open_backward(lc.new_slot("m2")) == ["f1"]


def test_retire_unreachable_retires_a_pending_slot_only():
    lc = InvocationLifecycle()
    pending, opened = lc.new_slot("m1"), lc.new_slot("m2")
    lc.hold(pending, ["w1"])
    lc.open_backward(opened)
    assert lc.retire_unreachable(pending) == ["w1"] and pending.state is State.CLOSED
    assert lc.retire_unreachable(opened) == [] and opened.state is State.OPEN
    assert lc.pending_slots("m1") == []


def test_lifecycle_is_usable_after_drain():
    lc = InvocationLifecycle()
    lc.new_slot("m1")
    lc.drain()
    r = recompute(lc, "m1", ["w1"], replay=True)  # the drained slot is gone
    assert lc.close_forward(r) == ["w1"]


# ---------------------------------------------------------------------------------------------
# the hand-off budget

NUMEL = {"w1": 1, "w2": 2, "w3": 3, "w4": 4, "f1": 5, "f2": 6}


def budget_lc(budget, frozen=()):
    return InvocationLifecycle(numel=NUMEL.__getitem__,
                               frozen=lambda p: p in frozen,
                               max_handoff_numel=budget)


def test_handoff_numel_counts_distinct_params_kept_only_by_pending_slots():
    lc = budget_lc(None)
    s1 = replay_handoff(lc, "m1", {"w1", "w2"})
    s2 = replay_handoff(lc, "m2", {"w2", "w3"})
    assert lc.handoff_numel() == 1 + 2 + 3  # w2 counted once
    f = forward(lc, "m9", ["w3"])  # also held by a live forward: not kept *only* by hand-offs
    assert lc.handoff_numel() == 1 + 2
    lc.close_forward(f)
    assert lc.handoff_numel() == 1 + 2 + 3
    lc.open_backward(s2)  # an open slot's params are not counted
    assert lc.handoff_numel() == 1
    lc.close_backward(s2)
    assert lc.handoff_numel() == 1 + 2
    lc.close_backward(s1)
    assert lc.handoff_numel() == 0


def test_handoff_numel_ignores_params_a_slot_holds_without_a_handoff():
    lc = budget_lc(None)
    slot = lc.new_slot("m1")
    lc.hold(slot, ["w4"])
    assert lc.handoff_numel() == 0


def start_new_batch(lc):
    """End the running recompute batch and start another (a backward event, then a recompute)."""
    lc.reap_aborted()
    lc.close_forward(recompute(lc, "next-region", [], replay=True))


def test_evict_drops_oldest_handoffs_first_until_under_budget():
    lc = budget_lc(3)
    s1 = replay_handoff(lc, "m1", {"w1"})
    s2 = replay_handoff(lc, "m2", {"w2"})
    start_new_batch(lc)
    s3 = replay_handoff(lc, "m3", {"w3"})
    assert lc.handoff_numel() == 6
    assert lc.evict_over_budget() == ["w1", "w2"]  # 6 -> 5 -> 3
    assert s1.holds == set() and s2.holds == set() and s3.holds == {"w3"}
    assert lc.handoff_numel() == 3
    assert not lc.is_held("w1") and lc.is_held("w3")
    assert lc.evict_over_budget() == []  # already within budget


def test_evict_within_budget_evicts_nothing_even_from_older_batches():
    lc = budget_lc(10)
    slot = replay_handoff(lc, "m1", {"w1", "w2"})
    start_new_batch(lc)
    assert lc.handoff_numel() == 3
    assert lc.evict_over_budget() == []
    assert slot.holds == {"w1", "w2"}


def test_a_handoff_stamped_again_does_not_shield_older_ones_from_eviction():
    """A re-stamp moves the hand-off to the end of the eviction queue, behind the older ones."""
    lc = budget_lc(0)
    reentrant = recompute(lc, "m1", ["w1"])
    own = lc.new_slot("m1")
    lc.close_forward(reentrant, own_slot=own)  # (own, w1), batch 0
    other = replay_handoff(lc, "m2", {"w2"})  # (other, w2), batch 0, queued after it
    lc.reap_aborted()
    lc.close_forward(recompute(lc, "m1", ["w1"], replay=True))  # matches own: (own, w1) stamped with batch 1
    assert own.matched and own.holds == {"w1"}
    assert lc.evict_over_budget() == ["w2"]
    assert other.holds == set() and own.holds == {"w1"}


def test_evict_with_no_budget_evicts_nothing():
    lc = budget_lc(None)
    replay_handoff(lc, "m1", {"w1", "w2", "w3"})
    lc.reap_aborted()
    assert lc.evict_over_budget() == []
    assert lc.handoff_numel() == 6


def test_evicted_param_still_held_by_another_slot_is_not_returned():
    lc = budget_lc(0)
    s1 = replay_handoff(lc, "m1", {"w1"})
    s2 = replay_handoff(lc, "m2", {"w1"})
    start_new_batch(lc)
    assert lc.evict_over_budget() == ["w1"]  # both hand-offs dropped, freed once
    assert s1.holds == set() and s2.holds == set()


def test_evict_keeps_a_handoff_whose_param_a_live_forward_also_holds_out_of_the_count():
    lc = budget_lc(0)
    replay_handoff(lc, "m1", {"w1"})
    forward(lc, "m9", ["w1"])
    assert lc.handoff_numel() == 0
    assert lc.evict_over_budget() == []


def test_handoffs_of_the_latest_recompute_batch_are_never_evicted():
    lc = budget_lc(0, frozen={"f1"})
    slot = replay_handoff(lc, "m1", {"f1", "w1"})
    assert lc.evict_over_budget() == []  # running: frozen and trainable stay
    lc.reap_aborted()
    assert lc.evict_over_budget() == []  # finished, but its backward is the next consumer
    assert slot.holds == {"f1", "w1"} and lc.is_held("f1")


def test_frozen_handoffs_stay_across_recomputes_of_the_same_batch():
    lc = budget_lc(0, frozen={"f1", "f2"})
    s1 = replay_handoff(lc, "m1", {"f1"})
    s2 = replay_handoff(lc, "m2", {"f2"})
    assert lc.evict_over_budget() == []
    assert s1.holds == {"f1"} and s2.holds == {"f2"}


@pytest.mark.parametrize("end_of_batch", ["reap_aborted", "open_backward", "close_backward"])
def test_frozen_handoffs_may_be_evicted_once_a_newer_batch_runs(end_of_batch):
    lc = budget_lc(0, frozen={"f1"})
    slot = replay_handoff(lc, "m1", {"f1"})
    other = lc.new_slot("m9")
    if end_of_batch == "reap_aborted":
        lc.reap_aborted()
    else:
        getattr(lc, end_of_batch)(other)
    lc.close_forward(recompute(lc, "next-region", [], replay=True))
    assert lc.evict_over_budget() == ["f1"]
    assert slot.holds == set() and not lc.is_held("f1")


def test_frozen_handoff_of_an_older_batch_is_evicted_during_a_new_batch():
    lc = budget_lc(0, frozen={"f1", "f2"})
    old = replay_handoff(lc, "m1", {"f1"})
    lc.reap_aborted()
    new = replay_handoff(lc, "m2", {"f2"})
    assert lc.evict_over_budget() == ["f1"]
    assert old.holds == set() and new.holds == {"f2"}


def test_trainable_handoffs_of_the_running_batch_stay_too():
    lc = budget_lc(0)
    slot = replay_handoff(lc, "m1", {"w1"})
    running = recompute(lc, "m2", [], replay=True)  # batch still running, recompute still open
    assert lc.evict_over_budget() == []
    assert slot.holds == {"w1"}
    assert running.state is State.OPEN


def test_an_open_slot_is_never_evicted_from():
    lc = budget_lc(0)
    slot = replay_handoff(lc, "m1", {"w1", "w2"})
    lc.open_backward(slot)
    assert lc.evict_over_budget() == []
    assert slot.holds == {"w1", "w2"}
    assert lc.handoff_numel() == 0


def test_an_open_slot_is_skipped_while_evicting_newer_pending_handoffs():
    lc = budget_lc(0)
    opened = replay_handoff(lc, "m1", {"w1"})  # the oldest hand-off...
    lc.open_backward(opened)  # ...but its slot is open now
    pending = replay_handoff(lc, "m2", {"w2"})
    start_new_batch(lc)
    assert lc.evict_over_budget() == ["w2"]
    assert opened.holds == {"w1"} and pending.holds == set()
    assert lc.is_held("w1")


def test_eviction_leaves_the_slot_pending_and_closable():
    lc = budget_lc(0)
    slot = replay_handoff(lc, "m1", {"w1"})
    start_new_batch(lc)
    assert lc.evict_over_budget() == ["w1"]
    assert slot.state is State.PENDING
    lc.open_backward(slot)
    lc.hold(slot, ["w1"])  # the slot gathers its param again when it opens
    assert lc.close_backward(slot) == ["w1"]
    assert lc.size()["handoffs"] == 0


def test_evict_stops_once_handoff_numel_is_within_budget():
    lc = InvocationLifecycle(max_handoff_numel=1)
    direct = lc.new_slot("m0")
    lc.hold(direct, ["w1"])  # a pending slot holding w1 itself (not through a hand-off)
    replay_handoff(lc, "m1", {"w1"})
    late = replay_handoff(lc, "m2", {"w2"})
    start_new_batch(lc)
    assert lc.handoff_numel() == 2
    lc.evict_over_budget()
    # dropping the hand-off of w1 already brings the size to 1 <= budget: w2 must stay
    assert late.holds == {"w2"}
    assert lc.handoff_numel() == 1


def test_frozen_param_handed_again_to_the_same_slot_is_not_evicted_during_the_new_batch():
    lc = budget_lc(0, frozen={"f1"})
    # batch 0: a reentrant recompute of m1 hands f1 to the slot it made itself
    r1 = recompute(lc, "m1", ["f1"], replay=False)
    own = lc.new_slot("m1")
    lc.close_forward(r1, own_slot=own)
    lc.reap_aborted()  # batch 0 ends
    # batch 1: a replay recompute of m1 matches that (unmatched) slot and hands f1 to it again
    r2 = recompute(lc, "m1", ["f1"], replay=True)
    lc.close_forward(r2)
    assert own.holds == {"f1"} and own.matched
    # the batch of r2 is still running: f1 must not be evicted
    assert lc.evict_over_budget() == []


# ---------------------------------------------------------------------------------------------
# holder_set


def test_holder_set_receives_the_holder_ids():
    sets = {}
    lc = InvocationLifecycle(holder_set=lambda p: sets.setdefault(p, set()))
    f = forward(lc, "m1", ["w1"])
    assert sets["w1"] == {f.id}
    slot = lc.new_slot("m2")
    r = recompute(lc, "m2", ["w1", "w2"], replay=True)
    assert sets["w1"] == {f.id, r.id} and sets["w2"] == {r.id}
    lc.close_forward(r)
    assert sets["w1"] == {f.id, slot.id} and sets["w2"] == {slot.id}
    assert lc.close_forward(f) == []
    assert sets["w1"] == {slot.id}
    assert sorted(lc.close_backward(slot)) == ["w1", "w2"]
    assert sets["w1"] == set() and sets["w2"] == set()


def test_holder_set_is_emptied_by_drain_and_eviction():
    sets = {}
    lc = InvocationLifecycle(holder_set=lambda p: sets.setdefault(p, set()), max_handoff_numel=0)
    replay_handoff(lc, "m1", {"w1"})
    start_new_batch(lc)
    forward(lc, "m2", ["w2"])
    assert lc.evict_over_budget() == ["w1"]
    assert sets["w1"] == set()
    lc.drain()
    assert sets["w2"] == set()


def test_a_param_never_held_has_no_holders_whatever_its_holder_set_has():
    """Stock code puts module ``ds_id`` values into ``ds_active_sub_modules`` too: they are no invocations."""
    lc = InvocationLifecycle(holder_set={"w1": {7}}.__getitem__)
    assert lc.holders("w1") == set() and not lc.is_held("w1")


def test_a_param_whose_holder_set_stock_code_cleared_is_freed_once():
    """Upstream's ``release_and_reset_all`` clears ``ds_active_sub_modules``: the first close that finds the
    param without holders returns it, the later ones do not."""
    sets = {}
    lc = InvocationLifecycle(holder_set=lambda p: sets.setdefault(p, set()))
    outer = forward(lc, "m1", ["w1"])
    inner = forward(lc, "m2", ["w1"])
    sets["w1"].clear()
    assert lc.close_forward(inner) == ["w1"]
    assert lc.close_forward(outer) == []
    assert lc.drain().params == []


def test_an_open_slots_handoff_does_not_count_once_stock_code_cleared_the_holder_set():
    sets = {}
    lc = InvocationLifecycle(holder_set=lambda p: sets.setdefault(p, set()))
    slot = replay_handoff(lc, "m1", {"w1"})
    lc.open_backward(slot)
    sets["w1"].clear()
    assert lc.handoff_numel() == 0


# ---------------------------------------------------------------------------------------------
# errors


def test_hold_on_a_closed_invocation_raises():
    lc = InvocationLifecycle()
    inv = forward(lc, "m1")
    lc.close_forward(inv)
    with pytest.raises(ValueError, match="is closed and cannot hold params"):
        lc.hold(inv, ["w1"])
    assert not lc.is_held("w1")


def test_hold_on_a_closed_slot_raises():
    lc = InvocationLifecycle()
    slot = lc.new_slot("m1")
    lc.close_backward(slot)
    with pytest.raises(ValueError, match="is closed and cannot hold params"):
        lc.hold(slot, ["w1"])


def test_replay_outside_a_backward_raises():
    lc = InvocationLifecycle()
    with pytest.raises(ValueError, match="^a replay recompute runs inside a backward$"):
        lc.open_forward("m1", in_backward=False, replay=True)
    assert lc.live() == [] and lc.call_stack == []


def test_close_forward_on_a_backward_slot_raises():
    lc = InvocationLifecycle()
    slot = lc.new_slot("m1")
    with pytest.raises(ValueError, match="is not a forward invocation"):
        lc.close_forward(slot)
    assert slot.state is State.PENDING


def test_close_forward_with_a_forward_as_its_own_slot_raises():
    lc = InvocationLifecycle()
    inv = recompute(lc, "m1", ["w1"])
    with pytest.raises(ValueError, match="is not a backward slot"):
        lc.close_forward(inv, own_slot=forward(lc, "m2"))
    assert inv.state is State.OPEN and lc.is_held("w1")


# ---------------------------------------------------------------------------------------------
# [Borrows a recompute re-reads]: lent holds


def test_a_lent_hold_ends_when_its_scope_is_over_and_the_param_is_freed_if_unheld():
    lc = InvocationLifecycle()
    slot = lc.new_slot("borrower")
    lc.lend(slot, {"w": "region"})
    lc.open_backward(slot)
    lc.hold(slot, ["w", "own"])
    asked = []
    assert lc.end_borrows(lambda param, scope: asked.append((param, scope)) or False) == []
    assert asked == [("w", "region")] and slot.holds == {"w", "own"}
    assert lc.end_borrows(lambda param, scope: True) == ["w"]
    assert slot.holds == {"own"} and not lc.is_held("w") and not lc.lending()
    assert lc.close_backward(slot) == ["own"]


def test_a_lent_hold_of_a_param_another_invocation_holds_frees_nothing():
    lc = InvocationLifecycle()
    slot = lc.new_slot("borrower")
    lc.lend(slot, {"w": None})
    lc.open_backward(slot)
    lc.hold(slot, ["w"])
    owner = lc.new_slot("owner")
    lc.open_backward(owner)
    lc.hold(owner, ["w"])
    assert lc.end_borrows(lambda param, scope: True) == []
    assert lc.holders("w") == {owner.id}
    assert lc.close_backward(owner) == ["w"]


def test_lent_holds_end_only_in_open_slots_and_go_with_the_slot():
    lc = InvocationLifecycle()
    pending = lc.new_slot("borrower")
    lc.lend(pending, {"w": None})
    lc.hold(pending, ["w"])  # a hand-off before the slot opens
    assert lc.end_borrows(lambda param, scope: True) == []
    assert lc.close_backward(pending) == ["w"]
    assert not lc.lending() and lc.size()["lending_slots"] == 0


def test_the_lent_holds_of_every_open_slot_end_whatever_pending_slots_lend_too():
    lc = InvocationLifecycle()
    opened = []
    for index in range(10):
        pending = lc.new_slot(f"pending{index}")
        lc.lend(pending, {f"p{index}": None})
        lc.hold(pending, [f"p{index}"])
        slot = lc.new_slot(f"open{index}")
        lc.lend(slot, {f"o{index}": None})
        lc.open_backward(slot)
        lc.hold(slot, [f"o{index}"])
        opened.append(slot)
    assert sorted(lc.end_borrows(lambda param, scope: True)) == sorted(f"o{index}" for index in range(10))
    assert all(slot.holds == set() for slot in opened)
    assert lc.size()["lending_slots"] == 10


def test_a_param_lent_but_not_held_is_not_asked_about():
    lc = InvocationLifecycle()
    slot = lc.new_slot("borrower")
    lc.lend(slot, {"w": None})
    lc.open_backward(slot)
    assert lc.end_borrows(lambda param, scope: pytest.fail("asked about a param the slot does not hold")) == []
    assert lc.lending()


def test_lend_to_a_closed_slot_or_a_forward_raises():
    lc = InvocationLifecycle()
    slot = lc.new_slot("borrower")
    lc.close_backward(slot)
    with pytest.raises(ValueError, match="is not a live backward slot"):
        lc.lend(slot, {"w": None})
    with pytest.raises(ValueError, match="is not a live backward slot"):
        lc.lend(forward(lc, "m"), {"w": None})


# ---------------------------------------------------------------------------------------------
# property tests: a reference model of the lifecycle driven by random event sequences

PARAMS = ("w0", "w1", "w2", "f0", "f1")
FROZEN = frozenset({"f0", "f1"})
PARAM_NUMEL = {"w0": 1, "w1": 2, "w2": 1, "f0": 1, "f1": 2}
MODULES = ("m0", "m1", "m2")


class LifecycleMachine(RuleBasedStateMachine):
    """Drives the public API at random and checks it against a small reference model.

    The model mirrors holds, the call stack, slots, matching and hand-off stamps; eviction is
    checked against the spec (oldest evictable first, only from pending slots, never a frozen
    param handed off by the running batch, stop once within budget) rather than mirrored.
    """

    def __init__(self):
        super().__init__()
        self.lc = None

    @initialize(budget=st.sampled_from([None, 0, 1, 2, 3]), external=st.booleans())
    def setup(self, budget, external):
        self.external_sets = {} if external else None
        holder_set = (lambda p: self.external_sets.setdefault(p, set())) if external else None
        self.budget = budget
        self.wont_open = set()  # slot ids the running backward will not open
        self.unreachable = set()  # slot ids whose graph is gone
        self.lc = InvocationLifecycle(numel=PARAM_NUMEL.__getitem__,
                                      frozen=FROZEN.__contains__,
                                      holder_set=holder_set,
                                      max_handoff_numel=budget,
                                      will_open=lambda slot: slot.id not in self.wont_open)
        self.invs = {}  # every invocation ever made, by id
        self.state = {}  # model state by id
        self.holds = {}  # live id -> set of params
        self.stack = []  # ids of open forwards, outermost first
        self.slots = {}  # module -> slot ids in creation order
        self.matched = set()
        self.keys = {}  # (slot id, param) -> (batch, hand-off number): the hand-off stamps
        self.handoff_events = 0
        self.batch = 0
        self.latest_recompute_batch = 0
        self.recompute_since_backward = False
        self.batch_handoffs = {}  # (slot id, param) -> stale?, hand-offs of the running batch
        self.unconsumed = []  # replays whose slot will not open: they keep their holds until a reap
        self.freed = set()  # returned as freed and not held since
        self.lent = {}  # slot id -> params lent

    # ------------------------------------------------------------------ model helpers
    def _track(self, inv, state):
        assert inv.id < 0, inv
        assert inv.id not in self.invs, f"id {inv.id} reused"
        self.invs[inv.id] = inv
        self.state[inv.id] = state
        self.holds[inv.id] = set()

    def _live_holders(self, param):
        return {i for i, held in self.holds.items() if param in held}

    def _retire(self, i):
        self.lent.pop(i, None)
        held = self.holds.pop(i)
        for p in held:
            self.keys.pop((i, p), None)
            self.batch_handoffs.pop((i, p), None)
        self.state[i] = State.CLOSED
        return {p for p in held if not self._live_holders(p)}

    def _retire_forward(self, i, own):
        if self.state[i] is State.CLOSED:
            return set()
        inv = self.invs[i]
        consumer = None
        if inv.phase is Phase.RECOMPUTE:
            if inv.replay:
                unopened = None
                for s in reversed(self.slots.get(inv.module, [])):
                    if self.state[s] is State.CLOSED or s in self.matched:
                        continue
                    if self.state[s] is State.OPEN or s not in self.wont_open:
                        consumer = s
                        self.matched.add(s)
                        break
                    unopened = unopened or s
                if consumer is None and unopened is not None:
                    self.unconsumed.append(i)  # [Slots that will not open]: kept until a reap
                    return set()
            elif own is not None and self.state[own.id] is not State.CLOSED:
                consumer = own.id
        if consumer is None:
            return self._retire(i)
        self.handoff_events += 1
        for p in self.holds.pop(i):
            stale = False
            if p not in self.holds[consumer]:
                self.holds[consumer].add(p)
                self.keys[(consumer, p)] = (self.batch, self.handoff_events)
            elif (consumer, p) in self.keys and self.keys[(consumer, p)][0] != self.batch:
                stale = True
            key = (consumer, p)
            self.batch_handoffs[key] = self.batch_handoffs.get(key, True) and stale
        self.state[i] = State.CLOSED
        return set()

    def _reap(self):
        freed = set()
        while self.stack:
            freed |= self._retire_forward(self.stack.pop(), None)
        while self.unconsumed:
            freed |= self._retire(self.unconsumed.pop())
        if self.recompute_since_backward:
            self.recompute_since_backward = False
            self.batch += 1
        self.batch_handoffs = {}
        return freed

    def _check_freed(self, returned, expected):
        assert len(returned) == len(set(returned)), f"freed twice in one call: {returned}"
        assert set(returned) == expected, (returned, expected)
        for p in returned:
            assert not self.lc.is_held(p) and self.lc.holders(p) == set(), p
            assert p not in self.freed, f"{p} freed twice without being held in between"
            self.freed.add(p)

    def _pick(self, data, ids):
        return self.invs[data.draw(st.sampled_from(sorted(ids, reverse=True)))]

    def _slot_ids(self, open_only=False):
        return [i for i, inv in self.invs.items() if inv.phase is Phase.BACKWARD and
                (not open_only or self.state[i] is not State.CLOSED)]

    def _evictable(self):
        """Hand-offs the budget may drop (pending slot, older than the latest recompute batch)."""
        out = set()
        for (s, p), (batch, _) in self.keys.items():
            if self.state[s] is not State.PENDING:
                continue
            if batch >= self.latest_recompute_batch:
                continue
            out.add((s, p))
        return out

    def _model_handoff_numel(self):
        params = set()
        for (s, p) in self.keys:
            if self.state[s] is State.PENDING and all(self.state[h] is State.PENDING for h in self._live_holders(p)):
                params.add(p)
        return sum(PARAM_NUMEL[p] for p in params)

    # ------------------------------------------------------------------ rules
    @rule(module=st.sampled_from(MODULES), in_backward=st.booleans(), replay=st.booleans(),
          depth=st.integers(-1, 5), params=st.sets(st.sampled_from(PARAMS), max_size=3))
    def open_forward(self, module, in_backward, replay, depth, params):
        """A pre-hook: open, then hold what the module gathered (as the adapter does)."""
        replay = replay and in_backward
        inv = self.lc.open_forward(module, in_backward=in_backward, replay=replay, stack_depth=depth)
        self._track(inv, State.OPEN)
        self.lc.hold(inv, sorted(params))
        self.holds[inv.id] |= params
        self.freed -= params
        assert inv.state is State.OPEN and inv.stack_depth == depth and inv.replay == replay
        assert inv.phase is (Phase.RECOMPUTE if in_backward else Phase.FORWARD)
        self.stack.append(inv.id)
        if in_backward:
            self.recompute_since_backward = True
            self.latest_recompute_batch = self.batch
        assert self.lc.innermost_forward(module) is inv

    @rule(module=st.sampled_from(MODULES))
    def new_slot(self, module):
        slot = self.lc.new_slot(module)
        self._track(slot, State.PENDING)
        assert slot.phase is Phase.BACKWARD and slot.state is State.PENDING
        self.slots.setdefault(module, []).append(slot.id)

    @precondition(lambda self: self.lc is not None and self.holds)
    @rule(data=st.data(), params=st.sets(st.sampled_from(PARAMS), max_size=3))
    def hold(self, data, params):
        inv = self._pick(data, self.holds)
        self.lc.hold(inv, sorted(params))
        self.holds[inv.id] |= params
        self.freed -= params

    @precondition(lambda self: self.lc is not None and any(s is State.CLOSED for s in self.state.values()))
    @rule(data=st.data())
    def hold_closed_raises(self, data):
        inv = self._pick(data, [i for i, s in self.state.items() if s is State.CLOSED])
        with pytest.raises(ValueError):
            self.lc.hold(inv, ["w0"])

    @precondition(lambda self: self.lc is not None and self.stack)
    @rule(data=st.data(), innermost=st.booleans(), make_own_slot=st.booleans())
    def close_forward(self, data, innermost, make_own_slot):
        i = self.stack[-1] if innermost else data.draw(st.sampled_from(self.stack))
        inv = self.invs[i]
        own = None
        if make_own_slot:  # as the adapter does: the post-hook makes the call's slot first
            own = self.lc.new_slot(inv.module)
            self._track(own, State.PENDING)
            self.slots.setdefault(inv.module, []).append(own.id)
        idx = self.stack.index(i)
        above, self.stack = self.stack[idx + 1:], self.stack[:idx]
        expected = set()
        for a in reversed(above):
            expected |= self._retire_forward(a, None)
        expected |= self._retire_forward(i, own)
        self._check_freed(self.lc.close_forward(inv, own_slot=own), expected)

    @precondition(lambda self: self.lc is not None and any(
        s is State.CLOSED and self.invs[i].phase is not Phase.BACKWARD for i, s in self.state.items()))
    @rule(data=st.data())
    def close_closed_forward(self, data):
        inv = self._pick(data, [i for i, s in self.state.items()
                                if s is State.CLOSED and self.invs[i].phase is not Phase.BACKWARD])
        assert self.lc.close_forward(inv) == []

    @precondition(lambda self: self.lc is not None and self._slot_ids())
    @rule(data=st.data())
    def open_backward(self, data):
        slot = self._pick(data, self._slot_ids())
        expected = self._reap()
        if self.state[slot.id] is State.PENDING:
            self.state[slot.id] = State.OPEN
        self._check_freed(self.lc.open_backward(slot), expected)

    @precondition(lambda self: self.lc is not None and self._slot_ids())
    @rule(data=st.data())
    def close_backward(self, data):
        slot = self._pick(data, self._slot_ids())
        expected = self._reap()
        if self.state[slot.id] is not State.CLOSED:
            expected |= self._retire(slot.id)
        self._check_freed(self.lc.close_backward(slot), expected)

    @precondition(lambda self: self.lc is not None)
    @rule()
    def reap_aborted(self):
        expected = self._reap()
        self._check_freed(self.lc.reap_aborted(), expected)

    @precondition(lambda self: self.lc is not None)
    @rule()
    def evict_over_budget(self):
        before = {i: set(h) for i, h in self.holds.items()}
        evictable = self._evictable()
        within_budget = self.budget is not None and self.lc.handoff_numel() <= self.budget
        returned = self.lc.evict_over_budget()
        removed = {(i, p) for i, held in before.items() for p in held - self.invs[i].holds}
        for i, held in before.items():
            assert self.invs[i].holds <= held, "eviction added holds"
        if self.budget is None:
            assert returned == [] and removed == set()
            return
        # never a frozen param handed off by the running batch
        protected = {p for (s, p), stale in self.batch_handoffs.items()
                     if p in FROZEN}
        assert not (set(returned) & protected), (returned, protected)
        # only evictable hand-offs (to pending slots), the oldest first (one hand-off's params
        # are equally old)
        assert removed <= evictable, (removed, evictable)
        assert not (within_budget and removed), f"evicted {removed} while within budget"
        kept = evictable - removed
        if removed and kept:
            assert max(self.keys[k][1] for k in removed) <= min(self.keys[k][1] for k in kept), \
                (removed, kept, self.keys)
        for (i, p) in removed:
            self.holds[i].discard(p)
            del self.keys[(i, p)]
            self.batch_handoffs.pop((i, p), None)
        expected = {p for (_, p) in removed if not self._live_holders(p)}
        self._check_freed(returned, expected)
        # it stops only once within budget, or when nothing evictable is left
        if self._evictable():
            assert self.lc.handoff_numel() <= self.budget

    @precondition(lambda self: self.lc is not None and self._slot_ids(open_only=True))
    @rule(data=st.data(), params=st.sets(st.sampled_from(PARAMS), min_size=1, max_size=3))
    def lend(self, data, params):
        slot = self._pick(data, self._slot_ids(open_only=True))
        self.lc.lend(slot, {p: slot.id for p in params})
        self.lent.setdefault(slot.id, set()).update(params)

    @precondition(lambda self: self.lc is not None)
    @rule(over=st.sets(st.sampled_from(PARAMS)))
    def end_borrows(self, over):
        expected_ends = set()
        for i, params in self.lent.items():
            if self.state[i] is State.OPEN:
                expected_ends |= {(i, p) for p in params & over & self.holds[i]}
        asked = []

        def is_over(param, scope):
            asked.append((scope, param))
            return param in over

        returned = self.lc.end_borrows(is_over)
        assert {(i, p) for i, p in asked if p in over} == expected_ends
        for i, p in expected_ends:
            self.holds[i].discard(p)
            self.lent[i].discard(p)
            self.keys.pop((i, p), None)
            self.batch_handoffs.pop((i, p), None)
        self.lent = {i: params for i, params in self.lent.items() if params}
        self._check_freed(returned, {p for _, p in expected_ends if not self._live_holders(p)})

    @precondition(lambda self: self.lc is not None and self._slot_ids(open_only=True))
    @rule(data=st.data())
    def toggle_will_open(self, data):
        slot = self._pick(data, self._slot_ids(open_only=True))
        self.wont_open ^= {slot.id}

    @precondition(lambda self: self.lc is not None and self._slot_ids(open_only=True))
    @rule(data=st.data())
    def graph_freed(self, data):
        """[Several forwards before a backward]: the graph of a pending slot's call is gone."""
        slot = self._pick(data, self._slot_ids(open_only=True))
        self.unreachable.add(slot.id)
        expected = self._retire(slot.id) if self.state[slot.id] is State.PENDING else set()
        self._check_freed(self.lc.retire_unreachable(slot), expected)

    @precondition(lambda self: self.lc is not None)
    @rule(keep_reachable=st.booleans())
    def drain(self, keep_reachable):
        live = list(self.holds)
        kept = {i for i in live if keep_reachable and self.invs[i].phase is Phase.BACKWARD
                and self.state[i] is State.PENDING and i not in self.unreachable}
        expected = set().union(*(self.holds[i] for i in live))
        drained = len([i for i in live if i not in kept or self.holds[i]])
        for i in live:
            if i in kept:
                for p in self.holds[i]:
                    self.keys.pop((i, p), None)
                self.holds[i] = set()
            else:
                self._retire(i)
        reachable = (lambda slot: slot.id not in self.unreachable) if keep_reachable else (lambda slot: False)
        report = self.lc.drain(reachable)
        assert report.invocations == drained
        self._check_freed(report.params, expected)
        assert not any(self.lc.is_held(p) for p in PARAMS)
        assert {inv.id for inv in self.lc.live()} == kept
        self.matched -= kept
        self.stack, self.keys, self.batch_handoffs, self.unconsumed = [], {}, {}, []
        self.recompute_since_backward = False

    # ------------------------------------------------------------------ invariants
    @invariant()
    def holds_match_the_model(self):
        if self.lc is None:
            return
        live = self.lc.live()
        assert {inv.id for inv in live} == set(self.holds)
        for inv in live:
            assert inv.state is self.state[inv.id] and inv.state is not State.CLOSED
            assert inv.holds == self.holds[inv.id], (inv, inv.holds, self.holds[inv.id])
        for p in PARAMS:
            holders = {inv.id for inv in live if p in inv.holds}
            assert self.lc.is_held(p) == bool(holders), p
            assert self.lc.holders(p) == holders, (p, self.lc.holders(p), holders)
            if self.external_sets is not None:
                assert self.external_sets.get(p, set()) == holders

    @invariant()
    def closed_invocations_hold_nothing(self):
        if self.lc is None:
            return
        live = {inv.id for inv in self.lc.live()}
        for i, inv in self.invs.items():
            if self.state[i] is State.CLOSED:
                assert inv.state is State.CLOSED and inv.holds == set() and i not in live
            else:
                assert inv.state is self.state[i]

    @invariant()
    def bookkeeping_matches_the_model(self):
        if self.lc is None:
            return
        assert [inv.id for inv in self.lc.call_stack] == self.stack
        size = self.lc.size()
        assert size["invocations"] == len(self.holds)
        assert size["held_params"] == sum(1 for p in PARAMS if self._live_holders(p))
        assert size["call_stack"] == len(self.stack)
        assert size["unconsumed_replays"] == len(self.unconsumed)
        assert size["handoffs"] == len(self.keys)
        assert size["lending_slots"] == len(self.lent)
        assert size["slot_modules"] == sum(
            1 for ids in self.slots.values() if any(self.state[s] is not State.CLOSED for s in ids))
        for m in MODULES:
            assert [s.id for s in self.lc.pending_slots(m)] == [
                s for s in self.slots.get(m, []) if self.state[s] is not State.CLOSED]
            inner = next((i for i in reversed(self.stack) if self.invs[i].module == m), None)
            assert self.lc.innermost_forward(m) is (self.invs[inner] if inner is not None else None)
        assert self.lc.handoff_numel() == self._model_handoff_numel()


TestLifecycleMachine = LifecycleMachine.TestCase
TestLifecycleMachine.settings = settings(max_examples=200,
                                         stateful_step_count=40,
                                         deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
