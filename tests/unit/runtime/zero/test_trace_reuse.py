"""Unit and property tests of the reuse-distance rule (invocation_lifecycle's [Reuse distance]).

Pure: params are strings, a trace is a list of fetches, each the ``(param, numel)`` pairs it gathers.
"""

from hypothesis import given
from hypothesis import strategies as st

from zero3_ac.runtime.zero.invocation_lifecycle import TraceReuse


def scan(trace, param, position, max_elements):
    """The rule as ZeRO-3 states it: walk the fetches from ``position`` on, counting the elements each
    gathers, and stop once ``max_elements`` are counted; the param is reused if a walked fetch gathers it."""
    counted = 0
    for fetched in trace[position:]:
        if counted >= max_elements:
            return False
        if any(p == param for p, _ in fetched):
            return True
        counted += sum(numel for _, numel in fetched)
    return False


def test_a_param_fetched_again_within_the_distance_is_reused():
    trace = [[("a", 4)], [("b", 4)], [("a", 4)]]
    reuse = TraceReuse(trace)
    assert reuse.reused_within("a", 1, max_elements=5)
    assert not reuse.reused_within("a", 1, max_elements=4)


def test_the_fetch_at_the_position_itself_counts_as_a_reuse():
    reuse = TraceReuse([[("a", 4)], [("b", 4)]])
    assert reuse.reused_within("b", 1, max_elements=1)
    assert not reuse.reused_within("b", 1, max_elements=0)


def test_a_param_no_later_fetch_gathers_is_not_reused():
    reuse = TraceReuse([[("a", 1)], [("b", 1)]])
    assert not reuse.reused_within("a", 1, max_elements=10**9)
    assert not reuse.reused_within("c", 0, max_elements=10**9)
    assert not reuse.reused_within("a", 5, max_elements=10**9)


def test_a_later_fetch_reuses_only_its_own_gather_set():
    """A unit's release: the root's later fetch gathers only the root's own param, not the unit's subtree."""
    unit = [("unit.w1", 8), ("unit.w2", 8)]
    trace = [[("root.bias", 1)], unit, [("head.w", 8)], [("root.bias", 1)], [("head.w", 8)]]
    reuse = TraceReuse(trace)
    assert not reuse.reused_within("unit.w1", 2, max_elements=10**9)
    assert reuse.reused_within("root.bias", 2, max_elements=10**9)


def test_a_fetch_counts_the_elements_of_every_param_it_gathers():
    reuse = TraceReuse([[("a", 4), ("b", 4)], [("c", 1)]])
    assert not reuse.reused_within("c", 0, max_elements=8)
    assert reuse.reused_within("c", 0, max_elements=9)


def test_len_is_the_trace_length():
    assert len(TraceReuse([[], [("a", 1)], []])) == 3


fetches = st.lists(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 5)), max_size=3), max_size=8)


@given(trace=fetches, param=st.sampled_from("abcdefg"), position=st.integers(0, 9), max_elements=st.integers(0, 30))
def test_the_index_answers_as_the_scan(trace, param, position, max_elements):
    # One numel per param, as in a model.
    numel = {}
    trace = [[(p, numel.setdefault(p, n)) for p, n in fetched] for fetched in trace]
    assert TraceReuse(trace).reused_within(param, position, max_elements) == scan(trace, param, position, max_elements)
