"""The timeline recorder on a real ZeRO-3 engine: its events add up to the accounting and balance out."""

import pytest

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (CheckpointedStack, assert_fork_state, fork_disabled, make_engine,
                                               micro_batches, zero_config)

WORLD_SIZE = 2
LEAN = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}


def recorded_step_case(use_reentrant):
    """One warm step, then one recorded step; the recorder's sums and the accounting's (or, on
    stock DeepSpeed, the gather meter's) counters of that step."""
    import deepspeed.comm as dist
    import torch
    import zero3_ac
    from zero3_ac.utils.gather_meter import GatherMeter
    from zero3_ac.utils.timeline import TimelineRecorder
    assert_fork_state()
    torch.manual_seed(4)
    engine = make_engine(CheckpointedStack(blocks=3, use_reentrant=use_reentrant), zero_config(3, **LEAN))
    meter = GatherMeter(engine)
    recorder = TimelineRecorder(engine)
    rank = dist.get_rank()
    warm, recorded = micro_batches(2, dist.get_world_size(), requires_grad=True)
    engine(warm[rank]).backward()
    engine.step()
    meter.reset()
    with recorder:
        engine(recorded[rank]).backward()
        engine.step()
    stats = zero3_ac.lifecycle_stats(engine)
    engine.destroy()
    counted = stats["current"]["gathered_bytes"] if stats is not None else dict(meter.step.gathered_bytes)
    return dict(counted=counted, recorded=recorder.gathered_bytes(), released=recorder.released_bytes(),
                still_gathered=recorder.still_gathered(), events=[vars(event) for event in recorder.events])


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_recorded_gathers_add_up_to_the_accounting_by_phase(use_reentrant):
    for result in run_distributed(WORLD_SIZE, recorded_step_case, use_reentrant):
        assert result["recorded"] == result["counted"]
        phases = {key.split("/")[0] for key in result["recorded"]}
        assert phases == {"forward", "recompute", "backward"}, result["recorded"]


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_releases_balance_gathers_at_the_end_of_the_step(use_reentrant):
    for result in run_distributed(WORLD_SIZE, recorded_step_case, use_reentrant):
        events = result["events"]
        assert [event["seq"] for event in events] == list(range(len(events)))
        assert all(event["live_bytes"] >= 0 for event in events)
        assert not result["still_gathered"], f"gathered in the step and never released: {result['still_gathered']}"
        assert sum(result["released"].values()) == sum(result["recorded"].values())
        assert events[-1]["live_bytes"] == 0
        holders = {event["invocation"] for event in events}
        if fork_disabled():
            assert holders == {None}
        else:
            assert None not in holders and all(holder < 0 for holder in holders), holders
