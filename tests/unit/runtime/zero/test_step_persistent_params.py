"""Persistent params across the optimizer's step (Note [Persistent params across the step] in
partitioned_param_coordinator.py): where a param's shard is the whole param, a persistent param stays
gathered through ``step()`` instead of being released and gathered again; the training is stock's, bit for
bit, a param whose data is not its shard any more is gathered again, and outside the step every param is
released as upstream does."""

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (CheckpointedStack, assert_fork_state, fork_disabled, make_engine,
                                               micro_batches, named_values, stock_deepspeed, zero_config)

STEPS = 3
PERSISTENT = 10**6  # every param of the model is under it


def persistent_case(world_size, detach_a_param, stock, offload=False):
    """Train ``STEPS`` steps with every param persistent (all of it under ``stock_deepspeed()`` if
    ``stock``); the final values, how many params each step gathered again at its end, and the status of
    every param after ``empty_partition_cache``."""
    assert_fork_state()
    if stock:
        with stock_deepspeed():
            return _train(world_size, detach_a_param, offload)
    return _train(world_size, detach_a_param, offload)


def _train(world_size, detach_a_param, offload):
    import deepspeed.comm as dist
    from deepspeed.runtime.zero import partition_parameters
    torch.manual_seed(7)
    # reentrant checkpointing: stock before 0.19.3 raises CheckpointError under the non-reentrant one
    model = CheckpointedStack(blocks=3, use_reentrant=True)
    config = zero_config(3, persistence=PERSISTENT)
    if offload:  # the fp32 optimizer on the host, the fp16 partitions on the device
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    engine = make_engine(model, config)
    lora = engine.module.blocks[1].lora.weight
    assert all(param.ds_persist for param in engine.module.parameters())
    regathered = []
    stock_all_gather = partition_parameters.Init._all_gather

    def counting_all_gather(self, param_list, *args, **kwargs):
        regathered[-1] += sum(param.ds_status == partition_parameters.ZeroParamStatus.NOT_AVAILABLE
                              for param in param_list)
        return stock_all_gather(self, param_list, *args, **kwargs)

    partition_parameters.Init._all_gather = counting_all_gather
    rank = dist.get_rank()
    try:
        for index, row in enumerate(micro_batches(STEPS, world_size, requires_grad=True, seed=9)):
            engine.backward(engine(row[rank]))
            if detach_a_param and index == 1:
                # the param's data is a copy now, not its shard: the step must not keep it
                lora.data = lora.data.clone()
            regathered.append(0)
            engine.step()
        after_step_values = lora.detach().clone()
        shard_values = lora.ds_tensor.detach().clone()
    finally:
        partition_parameters.Init._all_gather = stock_all_gather
    engine.empty_partition_cache()
    statuses = {param.ds_status.name for param in engine.module.parameters()}
    return {"values": named_values(engine), "regathered": regathered, "statuses_after_empty": statuses,
            "lora_after_step": after_step_values, "lora_shard": shard_values}


@pytest.mark.parametrize("detach_a_param,offload", [(False, False), (True, False), (False, True)])
def test_persistent_params_across_the_step(detach_a_param, offload):
    mine = run_distributed(1, persistent_case, 1, detach_a_param, stock=False, offload=offload)[0]
    stock = run_distributed(1, persistent_case, 1, detach_a_param, stock=True, offload=offload)[0]
    assert mine["values"].keys() == stock["values"].keys()
    for name, value in mine["values"].items():
        assert torch.equal(value, stock["values"][name]), f"{name} differs from stock's"
    assert torch.equal(mine["lora_after_step"], stock["lora_after_step"])
    # gathered after the step, the param is its updated shard
    assert torch.equal(mine["lora_after_step"].flatten(), mine["lora_shard"])
    assert mine["statuses_after_empty"] == stock["statuses_after_empty"] == {"NOT_AVAILABLE"}
    params = len(mine["values"])
    assert stock["regathered"] == [params] * STEPS, stock["regathered"]
    if fork_disabled():
        return
    if detach_a_param:
        # gathered again at the step after it was detached (upstream's gather of a single param makes a
        # copy, not a view, so it may be gathered again at later steps too)
        assert mine["regathered"][:2] == [0, 1] and max(mine["regathered"]) == 1, mine["regathered"]
    else:
        assert mine["regathered"] == [0] * STEPS, mine["regathered"]


def test_partitions_over_two_ranks_are_released_and_gathered_again():
    """No shard is the whole param: every persistent param is released and gathered again at each step,
    as upstream does. (Not compared with stock's values: DeepSpeed 0.18.5 and 0.19.2 read a coalesced gloo
    gather of several params before it completes: Note [A blocking gather of several params waits for each]
    in zero3_ac/runtime/zero/partition_parameters.py.)"""
    for result in run_distributed(2, persistent_case, 2, False, stock=False):
        assert result["regathered"] == [len(result["values"])] * STEPS, result["regathered"]
        assert result["statuses_after_empty"] == {"NOT_AVAILABLE"}
