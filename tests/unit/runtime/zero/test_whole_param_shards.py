"""whole_param_shards.py: with one rank in every partition group, a module's fetch is the gather of its
params as views of their shards, and upstream's prefetch queue is never walked (Note [A fetch of whole
shards]); training is what it is through upstream's fetch."""

import copy

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.test_setups import OptionalTail
from tests.unit.runtime.zero.zero_case import (CheckpointedStack, assert_close_deltas, assert_fork_state,
                                               assert_partitioned, fork_disabled, make_engine, micro_batches,
                                               named_values, reference_deltas, zero_config)

STEPS = 4
PREFETCH = {"stage3_prefetch_bucket_size": 10**6, "stage3_max_reuse_distance": 0}
_QUEUE = "_PartitionedParameterCoordinator__param_queue"


def whole_shards_case(use_reentrant, upstream_fetch=False):
    import deepspeed.comm as dist
    assert_fork_state()
    torch.manual_seed(11)
    model = CheckpointedStack(blocks=3, use_reentrant=use_reentrant)
    batches = micro_batches(STEPS, dist.get_world_size(), requires_grad=use_reentrant)
    expected = reference_deltas(model, batches, gas=1)
    engine = make_engine(model, zero_config(3, **PREFETCH))
    if upstream_fetch and not fork_disabled():
        from zero3_ac.runtime.zero.parameter_offload import lifecycle_hooks
        params = lifecycle_hooks(engine.optimizer.parameter_offload).params
        params.start_step = lambda root_module: None  # never covered: every fetch is upstream's
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    invalidations = [0]
    stock_invalidate = coordinator._invalidate_trace

    def invalidate():
        invalidations[0] += 1
        return stock_invalidate()

    coordinator._invalidate_trace = invalidate
    before = named_values(engine)
    queue_left = []
    for index, row in enumerate(batches):
        invalidations[0] = 0
        engine(row[0]).backward()
        engine.step()
        assert_partitioned(engine, f"step {index}")
        if index >= 2:  # step 0 runs untraced, step 1 records the trace
            assert coordinator.is_complete_trace(), f"step {index}: the module trace is not complete"
            assert invalidations[0] == 0, f"step {index}: the trace was invalidated {invalidations[0]} times"
            queue_left.append(len(getattr(coordinator, _QUEUE)))
    after = named_values(engine)
    assert_close_deltas({name: after[name] - before[name] for name in expected}, expected, torch.float32)
    trace_params = len(set(entry.param for entry in getattr(coordinator, "_PartitionedParameterCoordinator__param_order")))
    return queue_left, trace_params


@pytest.mark.stock_fails  # stock walks the prefetch queue past every param it fetches
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_world_1_fetch_trains_as_upstreams_and_never_walks_the_prefetch_queue(use_reentrant):
    queue_left, trace_params = run_distributed(1, whole_shards_case, use_reentrant)[0]
    assert trace_params > 0
    assert all(left >= trace_params for left in queue_left), (queue_left, trace_params)


def test_through_upstreams_fetch_the_same_case_walks_the_queue():
    """The check above can fail: with the fork's fetch turned off, upstream's walks the queue to its end."""
    queue_left, _ = run_distributed(1, whole_shards_case, False, True)[0]
    assert queue_left and all(left == 0 for left in queue_left), queue_left


def late_module_case():
    """Two steps on the whole-shard path, then a module attached after ``initialize`` (plain torch params):
    the model is no longer covered, and its forwards and backwards are still plain PyTorch's."""
    import deepspeed.comm as dist
    assert_fork_state()
    torch.manual_seed(46)
    model = OptionalTail()
    engine = make_engine(model, zero_config(3))
    params = None
    if not fork_disabled():
        from zero3_ac.runtime.zero.parameter_offload import lifecycle_hooks
        params = lifecycle_hooks(engine.optimizer.parameter_offload).params
    batches = micro_batches(4, dist.get_world_size())
    for row in batches[:2]:
        engine.backward(engine(row[0]))
        engine.step()
    assert params is None or params._whole_model, "the ZeRO-3 model is not fetched as whole shards"
    reference = OptionalTail()
    with torch.no_grad():
        for name, param in engine.module.named_parameters():  # the trained values (one rank: the whole shard)
            reference.get_parameter(name).copy_(param.ds_tensor.view(param.ds_shape))
    engine.module.late = torch.nn.Linear(model.trunk.in_features, model.trunk.in_features)
    reference.late = copy.deepcopy(engine.module.late)
    for index, row in enumerate(batches[2:]):
        loss = engine(row[0])
        assert params is None or not params._whole_model, "a model with a plain param is fetched as whole shards"
        assert torch.allclose(loss, reference(row[0]), rtol=1e-5, atol=1e-7), f"forward {index}"
        engine.backward(loss)
        assert engine.module.late.weight.grad is not None
        assert_partitioned(engine, f"after backward {index}")


def test_a_module_attached_after_initialize_takes_the_model_off_the_whole_shard_fetch():
    from deepspeed.runtime.zero import parameter_offload
    if not hasattr(parameter_offload, "ensure_zero_ordered_dict"):
        pytest.skip("this DeepSpeed's own forward prologue fails on a module attached after initialize")
    run_distributed(1, late_module_case)
