"""kept_partition_release.py: at two ranks the fork's releases free the gathered data without upstream's
``param.partition`` (Note [A release that frees only the gathered data]), leave the coordinator's count of
available elements where upstream's leave it, and train as plain PyTorch does."""

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (CheckpointedStack, assert_close_deltas, assert_fork_state,
                                               assert_partitioned, fork_disabled, make_engine, micro_batches,
                                               named_values, reference_deltas, zero_config)

STEPS = 3
_AVAILABLE_COUNT = "_PartitionedParameterCoordinator__n_available_params"


def release_case(use_reentrant, upstream_release=False):
    """Per step: the calls of upstream's ``param.partition`` and the coordinator's count of available
    elements after the step; the trained values are checked against plain PyTorch's."""
    import deepspeed.comm as dist
    assert_fork_state()
    torch.manual_seed(12)
    model = CheckpointedStack(blocks=3, use_reentrant=use_reentrant)
    batches = micro_batches(STEPS, dist.get_world_size(), requires_grad=use_reentrant)
    expected = reference_deltas(model, batches, gas=1)
    engine = make_engine(model, zero_config(3))
    assert all(getattr(param, "ds_zero_param_process_group", None) is None for param in engine.module.parameters()), (
        "partitioned with an hpZ group an earlier case left (Note [The hpZ group outlives its engine] in zero_case.py)")
    if upstream_release and not fork_disabled():
        from zero3_ac.runtime.zero.partitioned_param_coordinator import CoordinatorTap
        kept_partitions = CoordinatorTap.of(engine.optimizer.parameter_offload.get_param_coordinator()).kept_partitions
        kept_partitions.release = lambda param: False
        kept_partitions.release_all = lambda params: list(params)
    partitions = [0]
    for param in engine.module.parameters():
        def counted(*args, _partition=param.partition, **kwargs):
            partitions[0] += 1
            return _partition(*args, **kwargs)

        param.partition = counted
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    before = named_values(engine)
    per_step = []
    for index, row in enumerate(batches):
        partitions[0] = 0
        engine(row[dist.get_rank()]).backward()
        engine.step()
        assert_partitioned(engine, f"step {index}")
        per_step.append((partitions[0], getattr(coordinator, _AVAILABLE_COUNT)))
    after = named_values(engine)
    assert_close_deltas({name: after[name] - before[name] for name in expected}, expected, torch.float32)
    return per_step


@pytest.mark.stock_fails  # stock releases every param through its partition()
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_two_rank_releases_skip_upstreams_partition_and_train_as_plain_pytorch(use_reentrant):
    for rank, per_step in enumerate(run_distributed(2, release_case, use_reentrant)):
        assert all(partitions == 0 for partitions, _ in per_step), f"rank {rank}: {per_step}"
        assert all(available == 0 for _, available in per_step), f"rank {rank}: {per_step}"


def test_through_upstreams_release_the_same_case_calls_partition_and_counts_the_same():
    """The check above can fail: with the path turned off, upstream's partition() releases, to the same count."""
    for rank, per_step in enumerate(run_distributed(2, release_case, False, True)):
        assert all(partitions > 0 for partitions, _ in per_step), f"rank {rank}: {per_step}"
        assert all(available == 0 for _, available in per_step), f"rank {rank}: {per_step}"
