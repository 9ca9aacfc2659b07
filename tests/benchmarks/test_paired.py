"""The paired rounds' process layout (``benchmarks/paired.py``): the start order rotates by one a round, so
that no system is always the last to start, and ``--pin-cores`` gives each rank process cores of its own."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import paired  # noqa: E402


def test_the_start_order_rotates_by_one_a_round():
    labels = ["plain", "fsdp2", "fork", "fork#2"]
    orders = [paired.start_order(labels, round_index) for round_index in range(5)]
    assert orders[0] == labels and orders[4] == labels
    assert [order[-1] for order in orders[:4]] == ["fork#2", "plain", "fsdp2", "fork"]


def test_each_process_gets_cores_of_its_own(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    sets = paired.core_sets(4)
    assert sets == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    with pytest.raises(SystemExit, match="--pin-cores: 17 rank processes but 16 cores"):
        paired.core_sets(17)
