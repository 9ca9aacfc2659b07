"""stage3_gradients.py's copy of reduced gradients into their partitions (``_copy_into_partitions``): one
copy for all the params of a bucket gives every rank's partitions, its record of reduced params and its
params' gradients exactly as upstream's ``partition_grads`` leaves them, a partition with no element on a
rank included."""

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (DIM, CheckpointedStack, assert_fork_state, fork_disabled,
                                               make_engine, micro_batches, zero_config)

_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


class StackWithScalarHead(CheckpointedStack):
    """A trainable one-element bias: at two ranks, the second rank's partition of it holds no element."""

    def __init__(self):
        super().__init__(blocks=2)
        self.scalar = torch.nn.Linear(DIM, 1)

    def forward(self, x):
        return super().forward(x) + self.scalar(x).pow(2).mean()


def partitions_case(through_upstream, upstream_reduce_scatter=False):
    """One backward's gradient partitions; upstream's copy into them and upstream's reduce-scatter when asked."""
    import deepspeed.comm as dist
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero import stage3
    from zero3_ac.runtime.zero import stage3_gradients
    assert_fork_state()
    fork_copy, fork_reduce_scatter = stage3_gradients._copy_into_partitions, stage3.reduce_scatter_coalesced
    if through_upstream:
        stage3_gradients._copy_into_partitions = lambda optimizer, stock, params, grads: stock(optimizer, params, grads)
    if upstream_reduce_scatter:
        stage3.reduce_scatter_coalesced = coalesced_collectives.reduce_scatter_coalesced
    try:
        torch.manual_seed(3)
        engine = make_engine(StackWithScalarHead(), zero_config(3))
        optimizer = engine.optimizer
        row = micro_batches(1, dist.get_world_size(), seed=4)[0]
        engine(row[0]).backward()
    finally:  # the workers outlive the test
        stage3_gradients._copy_into_partitions, stage3.reduce_scatter_coalesced = fork_copy, fork_reduce_scatter
    name_of = {param.ds_id: name for name, param in engine.module.named_parameters()}  # ds_ids run on across cases
    partitions = {name_of[ds_id]: partition.clone() for ds_id, partition in getattr(optimizer, _PARTITIONS).items()}
    active = sorted(name_of[ds_id] for ds_id in getattr(optimizer, "_offload_boundary_param_ids", ()))
    grads_left = [name for name, param in engine.module.named_parameters() if param.grad is not None]
    empty = [name for name, param in engine.module.named_parameters()
             if param.requires_grad and param.partition_numel() * dist.get_rank() >= param.ds_numel]
    return partitions, active, grads_left, empty


@pytest.mark.parametrize("world_size", [1, 2])
def test_one_copy_leaves_the_partitions_upstreams_copy_leaves(world_size):
    if fork_disabled():
        pytest.skip("compares the fork's copy with upstream's")
    forks = run_distributed(world_size, partitions_case, False)
    upstreams = run_distributed(world_size, partitions_case, True)
    for rank, (fork, upstream) in enumerate(zip(forks, upstreams)):
        partitions, active, grads_left, empty = fork
        assert partitions.keys() == upstream[0].keys()
        for name, partition in partitions.items():
            assert torch.equal(partition, upstream[0][name]), f"rank {rank}, {name}"
        assert active == upstream[1] and grads_left == upstream[2] == []
        assert any(partition.abs().sum() > 0 for partition in partitions.values())
    if world_size == 2:
        assert forks[1][3], "no partition without elements on the second rank: the case does not test one"
