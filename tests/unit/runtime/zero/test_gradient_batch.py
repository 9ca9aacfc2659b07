"""Unit and property tests of invocation_lifecycle's ``GradientBatch`` (Note [A unit's gradients enter
the reduce bucket together]). Params are strings, units small ints."""

from hypothesis import given
from hypothesis import strategies as st

from zero3_ac.runtime.zero.invocation_lifecycle import GradientBatch

UNITS = {"a0": (0, 0, 2), "a1": (0, 1, 2), "b0": (1, 0, 3), "b1": (1, 1, 3), "b2": (1, 2, 3), "c0": (2, 0, 1)}
ALONE = ("head", "embed")  # params in no unit


def feed(arrivals):
    """What enters the bucket, in order, for an arrival sequence followed by the end of the backward."""
    batch, bucket = GradientBatch(), []
    for param in arrivals:
        if param in UNITS:
            bucket += batch.arrive(param, *UNITS[param])
        else:
            bucket += batch.arrive(param, None)
            bucket.append(param)
    return bucket + batch.take(), batch


def test_a_unit_moves_once_all_its_params_have_arrived():
    batch = GradientBatch()
    assert batch.arrive("b1", *UNITS["b1"]) == []
    assert batch.arrive("b0", *UNITS["b0"]) == []
    assert batch.arrive("b2", *UNITS["b2"]) == ["b1", "b0", "b2"]
    assert batch.pending == [] and batch.unit is None


def test_a_unit_of_one_param_moves_at_once():
    assert GradientBatch().arrive("c0", *UNITS["c0"]) == ["c0"]


def test_an_arrival_from_another_unit_moves_the_pending_ones_first():
    batch = GradientBatch()
    batch.arrive("b0", *UNITS["b0"])
    assert batch.arrive("a0", *UNITS["a0"]) == ["b0"]
    assert batch.pending == ["a0"]


def test_an_arrival_outside_any_unit_moves_the_pending_ones_first():
    batch = GradientBatch()
    batch.arrive("a0", *UNITS["a0"])
    assert batch.arrive("head", None) == ["a0"]
    assert batch.pending == []


def test_a_param_that_arrives_again_while_pending_moves_once():
    batch = GradientBatch()
    batch.arrive("b0", *UNITS["b0"])
    assert batch.arrive("b0", *UNITS["b0"]) == []
    batch.arrive("b1", *UNITS["b1"])
    assert batch.arrive("b2", *UNITS["b2"]) == ["b0", "b1", "b2"]


def test_take_empties_the_batch():
    batch = GradientBatch()
    batch.arrive("b0", *UNITS["b0"])
    assert batch.take() == ["b0"]
    assert batch.take() == []
    assert batch.arrive("b0", *UNITS["b0"]) == []  # a new round for the unit


def _without_repeats_while_pending(arrivals):
    """The stock order: each arrival, except one for a param already waiting in the same unit's batch."""
    expected, pending_unit, pending = [], None, set()
    for param in arrivals:
        unit = UNITS.get(param, (None,))[0]
        if unit is None or unit != pending_unit:
            pending_unit, pending = unit, set()
        if unit is not None and param in pending:
            continue
        expected.append(param)
        if unit is not None:
            pending.add(param)
            if len(pending) == UNITS[param][2]:
                pending_unit, pending = None, set()
    return expected


@given(st.lists(st.sampled_from(sorted(UNITS) + list(ALONE)), max_size=40))
def test_the_bucket_sees_the_arrival_order_and_nothing_is_left_pending(arrivals):
    bucket, batch = feed(arrivals)
    assert bucket == _without_repeats_while_pending(arrivals)
    assert batch.pending == [] and batch.unit is None


@given(st.lists(st.sampled_from(sorted(UNITS) + list(ALONE)), max_size=40))
def test_at_most_one_unit_is_pending_and_it_holds_each_param_once(arrivals):
    batch = GradientBatch()
    for param in arrivals:
        batch.arrive(param, *UNITS.get(param, (None,)))
        assert len(set(batch.pending)) == len(batch.pending)
        assert {UNITS[param][0] for param in batch.pending} <= {batch.unit}
        if batch.unit is not None:
            assert len(batch.pending) < UNITS[batch.pending[0]][2]
