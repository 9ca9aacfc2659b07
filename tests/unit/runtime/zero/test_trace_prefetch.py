"""Recompute invocations and ZeRO-3's module trace (ZeRO-3, 2 gloo ranks).

Upstream records the order in which modules fetch their params during one forward + backward,
and once that trace is complete it prefetches params ahead of the module that needs them; a
module arriving out of order invalidates the trace and turns prefetching off until a new one is
recorded. Recomputes fetch through the same path, so they are part of the trace: they must not
invalidate it, and the params a backward needs must already be there when it fetches them.
"""

import collections

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (CheckpointedStack, assert_fork_state, make_engine, micro_batches,
                                               zero_config)

WORLD_SIZE = 2
PREFETCH = {"stage3_prefetch_bucket_size": 10**6, "stage3_max_reuse_distance": 10**6}


def _phase(forward: bool) -> str:
    if torch._C._current_graph_task_id() == -1:
        return "forward"
    return "recompute" if forward else "backward"


def trace_case(use_reentrant, steps=5):
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
    assert_fork_state()
    torch.manual_seed(60)
    engine = make_engine(CheckpointedStack(blocks=4, use_reentrant=use_reentrant), zero_config(3, **PREFETCH))
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    invalidations, not_there = [0], collections.Counter()
    stock_invalidate, stock_fetch = coordinator._invalidate_trace, coordinator.fetch_sub_module

    def invalidate():
        invalidations[0] += 1
        return stock_invalidate()

    def fetch_sub_module(module, forward):
        for param in iter_params(module):
            if not param.ds_persist and param.ds_status == ZeroParamStatus.NOT_AVAILABLE:
                not_there[_phase(forward)] += 1
        return stock_fetch(module, forward)

    coordinator._invalidate_trace, coordinator.fetch_sub_module = invalidate, fetch_sub_module
    rank = dist.get_rank()
    for index, row in enumerate(micro_batches(steps, dist.get_world_size(), requires_grad=True)):
        invalidations[0] = 0
        not_there.clear()
        engine(row[rank]).backward()
        engine.step()
        if index >= 2:  # step 0 runs untraced, step 1 records the trace
            assert coordinator.is_complete_trace(), f"step {index}: the module trace is not complete"
            assert invalidations[0] == 0, f"step {index}: the trace was invalidated {invalidations[0]} times"
            assert not not_there["backward"], (
                f"step {index}: {not_there['backward']} params were not gathered yet when their backward fetched "
                f"them (a synchronous gather; all phases: {dict(not_there)})")
    engine.destroy()


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_recompute_keeps_the_trace_and_backward_finds_its_params(use_reentrant):
    run_distributed(WORLD_SIZE, trace_case, use_reentrant)
