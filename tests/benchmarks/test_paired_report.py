"""The paired report's statistics on made-up rows: the median paired ratio, its bootstrap interval, the A/A
verdict. A 5% difference under 3% noise is told apart; an A/A pair under the same noise passes."""

import os
import sys

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import paired_report  # noqa: E402

CONFIG = dict(shape="small", world=1, mode="lora", ac="nonreentrant")


def _rows(factors, cycles=16, block=5, noise=0.03, drift=0.5):
    """One round: every label's blocks of steps of 1 s times its factor, the host slowing by up to ``drift``
    over the round (the same for every label within a cycle), and ``noise`` independent jitter per step."""
    generator = numpy.random.default_rng(1)
    host = 1 + drift * numpy.linspace(0, 1, cycles)
    rows = []
    for label, factor in factors.items():
        blocks = [list(factor * host[c] * (1 + noise * generator.standard_normal(block))) for c in range(cycles)]
        rows.append(dict(CONFIG, round=0, label=label, system=label.split("#")[0], error=None, block_s=blocks,
                         step_s=[t for b in blocks for t in b], peak_mem_gib=1.0))
    return rows


def test_paired_ratio_tells_a_5_percent_difference_under_drift_apart():
    pairs = paired_report.pairs_summary(_rows({"fsdp2": 1.0, "fork": 1.05, "fork#2": 1.05}), "fork")
    found = {entry["second"]: entry for entry in pairs}
    assert found["fsdp2"]["pairs"] == 16 and not found["fsdp2"]["aa"]
    assert 1.0 < found["fsdp2"]["low"] < 1.05 < found["fsdp2"]["high"] < 1.1, found["fsdp2"]
    assert found["fork#2"]["aa"] and found["fork#2"]["aa_pass"], found["fork#2"]
    assert "inside [0.97, 1.03]" in paired_report.aa_verdicts(pairs)[0]


def test_aa_fails_when_the_copies_differ():
    pairs = paired_report.pairs_summary(_rows({"fork": 1.0, "fork#2": 1.06}), "fork")
    assert pairs[0]["aa"] and not pairs[0]["aa_pass"]
    assert "NOT inside" in paired_report.aa_verdicts(pairs)[0]


def test_a_copy_of_another_version_is_an_ab_pair_not_an_aa_check():
    pairs = paired_report.pairs_summary(_rows({"fork": 1.0, "fork#2": 1.06}), "fork", other_version=True)
    assert not pairs[0]["aa"] and "aa_pass" not in pairs[0] and 1.03 < 1 / pairs[0]["ratio"] < 1.09
    assert paired_report.aa_verdicts(pairs) == []


def test_bootstrap_interval_holds_the_median_and_is_deterministic():
    values = list(numpy.random.default_rng(2).normal(1.0, 0.05, 30))
    low, high = paired_report.bootstrap_median(values)
    assert low < numpy.median(values) < high
    assert (low, high) == paired_report.bootstrap_median(values)


def test_pairs_are_the_reference_against_each_other_then_the_other_systems():
    assert paired_report.pair_list(["plain", "fsdp2", "fork", "fork#2"], "fork") == [
        ("fork", "plain"), ("fork", "fsdp2"), ("fork", "fork#2"), ("fsdp2", "plain")]


def test_a_failing_aa_pair_is_told_the_cycles_that_would_pass_at_its_spread():
    # Four times the cycles halve the interval: an interval of +-6% over 40 cycles needs 160 for +-3%.
    entry = dict(ratio=1.0, low=0.94, high=1.06, pairs=40, aa=True, aa_pass=False, first="fork", second="fork#2",
                 **CONFIG)
    assert paired_report.cycles_for_band(entry) == 160
    # Off-centre, the nearer band edge decides: 1.01 [0.98, 1.04] has 2% of room above for 3% of half width.
    assert paired_report.cycles_for_band(dict(entry, ratio=1.01, low=0.98, high=1.04)) == 90
    assert paired_report.cycles_for_band(dict(entry, ratio=1.05, low=1.0, high=1.1)) is None
    entry["aa_cycles_for_band"] = paired_report.cycles_for_band(entry)
    assert "about 160 cycles at this spread (40 ran)" in paired_report.aa_verdicts([entry])[0]


def test_noisier_aa_rows_need_more_cycles():
    quiet, noisy = (paired_report.pairs_summary(_rows({"fork": 1.0, "fork#2": 1.0}, cycles=40, noise=noise), "fork")[0]
                    for noise in (0.05, 0.1))
    assert quiet["aa_cycles_for_band"] < noisy["aa_cycles_for_band"], (quiet, noisy)


def test_noise_columns_tell_a_slow_shared_drift_from_step_jitter():
    def summaries(drift):
        rows = _rows({"fork": 1.0, "fork#2": 1.0}, cycles=40, noise=0.05, drift=drift)
        return paired_report.systems_summary(rows)[0], paired_report.pairs_summary(rows, "fork")[0]

    jitter, jitter_pair = summaries(drift=0.0)
    assert 0.03 < jitter["step_cv"] < 0.07 and abs(jitter["step_lag1"]) < 0.2, jitter
    assert abs(jitter_pair["cycle_correlation"]) < 0.4, jitter_pair
    # The host's drift is shared by the steps of a block and by both systems of a cycle.
    drifting, drifting_pair = summaries(drift=2.0)
    assert drifting["step_cv"] > 0.2 and drifting["step_lag1"] > 0.8, drifting
    assert drifting_pair["cycle_correlation"] > 0.9, drifting_pair
    table = paired_report.markdown([drifting], [drifting_pair])
    assert f"| {drifting['step_cv']:.2f}, {drifting['step_lag1']:.2f} |" in table
    assert f"| {drifting_pair['cycle_correlation']:.2f} |" in table
