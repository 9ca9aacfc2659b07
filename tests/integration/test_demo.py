"""The demo's core (examples/demo.py, fewer steps) shows the difference on the installed DeepSpeed.

Stock and fork run in one test, each on fresh ranks whose environment decides the mode from
interpreter start-up, from the same initial weights. Before 0.19.3 stock crashes with
``CheckpointError`` and the fork trains; from 0.19.3 on stock gathers in the recompute and again in
the backward, the fork only once; the losses are equal, and plain PyTorch's.
"""

import importlib
import sys

import pytest
from packaging.version import Version

from tests.integration.test_examples import EXAMPLES
from zero3_ac import version_guard

STEPS = 2
STOCK_CRASHES = Version(version_guard.installed_deepspeed_version()) < Version("0.19.3")
LOSS_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def demo():
    """examples/demo.py as a module; examples/ stays on sys.path while its ranks start (they import it)."""
    sys.path.insert(0, EXAMPLES)
    try:
        yield importlib.import_module("demo")
    finally:
        sys.path.remove(EXAMPLES)


@pytest.fixture(scope="module")
def outcome(demo):
    return demo.run_demo(STEPS)


def test_the_fork_trains_like_plain_pytorch(demo, outcome):
    runs, plain, _ = outcome
    fork = runs["fork"]
    assert demo.fork_trained(fork, STEPS), fork
    losses = [row["loss"] for row in fork["rows"]]
    assert losses == pytest.approx(plain, abs=LOSS_TOLERANCE)
    for row in fork["rows"]:
        assert row["recompute"] == 0 and row["regathered"] == 0, row
        assert row["forward"] > 0 and row["backward"] > 0, row


def test_stock_ran_stock_in_fresh_ranks(outcome):
    runs, _, _ = outcome
    assert runs["stock"]["fork_active"] is False
    assert runs["stock"]["exit_codes"] == [0, 0]


@pytest.mark.skipif(not STOCK_CRASHES, reason="DeepSpeed 0.19.3+ no longer crashes")
def test_stock_crashes_with_a_checkpoint_error(outcome):
    runs, _, verdict = outcome
    crashes = runs["stock"]["crashes"]
    assert crashes and all(crash["error"] == "CheckpointError" and crash["step"] == 0 for crash in crashes), crashes
    assert "recomputed [0]" in crashes[0]["shapes"], crashes[0]
    assert "stock crashed in step 0: CheckpointError" in verdict[0]


@pytest.mark.skipif(STOCK_CRASHES, reason="DeepSpeed before 0.19.3 crashes")
def test_stock_gathers_again_in_recompute_and_backward_with_the_fork_s_losses(outcome):
    runs, plain, verdict = outcome
    stock, fork = runs["stock"], runs["fork"]
    assert not stock["crashes"] and len(stock["rows"]) == STEPS, stock
    for stock_row, fork_row in zip(stock["rows"], fork["rows"]):
        assert stock_row["recompute"] > 0 and stock_row["regathered"] > 0, stock_row
        assert (stock_row["recompute"] + stock_row["backward"] > fork_row["recompute"] + fork_row["backward"])
    assert [row["loss"] for row in stock["rows"]] == pytest.approx([row["loss"] for row in fork["rows"]],
                                                                 abs=LOSS_TOLERANCE)
    assert "stock trained but gathered" in verdict[0] and "0.000 again" in verdict[1]
