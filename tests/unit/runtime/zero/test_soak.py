"""Soak: many steps of a tiny model with gradient accumulation; nothing may grow (ZeRO-3, 2 gloo ranks).

The short form runs in CI; the full 5,000 steps need ``--runslow``. Checked at every optimizer
step: the fork's bookkeeping (live invocations, held params, hand-offs, the ownership map) is
empty, DeepSpeed's forward-module stack keeps its size, and, between the end of warm-up and the
end of the run, neither the Python heap (objects the garbage collector tracks) nor the process
RSS grows beyond a small allowance.
"""

import gc
import os

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (CheckpointedStack, assert_fork_state, assert_partitioned,
                                               make_engine, micro_batches, zero_config)

WORLD_SIZE = 2
GAS = 4
RSS_ALLOWANCE = 16 * 2**20
OBJECTS_ALLOWANCE = 500


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _footprint():
    gc.collect()
    return _rss_bytes(), len(gc.get_objects())


def soak_case(steps):
    import deepspeed.comm as dist
    import zero3_ac
    from deepspeed.runtime.zero import parameter_offload
    assert_fork_state()
    torch.manual_seed(50)
    engine = make_engine(CheckpointedStack(blocks=3), zero_config(3, gas=GAS))
    rank = dist.get_rank()
    batches = [row[rank] for row in micro_batches(GAS, dist.get_world_size(), requires_grad=True)]
    warmup = max(steps // 10, 10)
    stack_depth, baseline = None, None
    for step in range(steps):
        for batch in batches:
            engine(batch).backward()
            engine.step()
        stats = zero3_ac.lifecycle_stats(engine)
        if stats is not None:
            assert not any(stats["bookkeeping"].values()), f"step {step}: bookkeeping left: {stats['bookkeeping']}"
        depth = len(parameter_offload.FWD_MODULE_STACK)
        assert stack_depth in (None, depth), f"step {step}: DeepSpeed's module stack grew from {stack_depth} to {depth}"
        stack_depth = depth
        if step + 1 == warmup:
            baseline = _footprint()
    assert_partitioned(engine, "after the soak")
    rss, objects = _footprint()
    engine.destroy()
    return {"steps": steps, "rss_growth": rss - baseline[0], "objects_growth": objects - baseline[1],
            "rss": rss}


def _check_soak(steps):
    results = run_distributed(WORLD_SIZE, soak_case, steps)
    for rank, result in enumerate(results):
        assert result["objects_growth"] <= OBJECTS_ALLOWANCE, f"rank {rank}: Python heap grew: {result}"
        assert result["rss_growth"] <= RSS_ALLOWANCE, f"rank {rank}: RSS grew: {result}"
    return results


def test_soak_short():
    _check_soak(100)


@pytest.mark.slow
def test_soak_5000_steps():
    print(_check_soak(5000))
