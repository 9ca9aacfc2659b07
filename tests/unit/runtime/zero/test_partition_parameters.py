"""``print_rank_0`` checking its flags first (partition_parameters.py, Note [Debug printing that prints nothing])."""

import pytest

from zero3_ac.runtime.zero.partition_parameters import print_rank_0_checking_flags_first


@pytest.mark.parametrize("debug, force, prints", [(False, False, False), (True, False, True), (False, True, True)])
def test_upstream_print_runs_exactly_when_it_would_print(debug, force, prints):
    calls = []
    quiet = print_rank_0_checking_flags_first(lambda message, debug=False, force=False: calls.append(
        (message, debug, force)))
    quiet("message", debug=debug, force=force)
    assert calls == ([("message", debug, force)] if prints else [])


def test_positional_flags_reach_upstream_print():
    calls = []
    quiet = print_rank_0_checking_flags_first(lambda message, debug=False, force=False: calls.append(force))
    quiet("message", False, True)
    assert calls == [True]
