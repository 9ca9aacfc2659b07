"""A sub-group's reduced gradients enter the fp32 optimizer as one region of the flat gradient buffer
(``stage3_sub_group_gradients``, Note [A sub-group's gradient partitions are one region of the flat
buffer]): the step, the master gradients and the gradient buffer after the step are stock's, bit for
bit, and upstream flattens two views per sub-group instead of one per param (on stock: one per param)."""

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (CheckpointedStack, assert_fork_state, fork_disabled, make_engine,
                                               micro_batches, named_values, stock_deepspeed, zero_config)

BLOCKS = 3
STEPS = 3


def sub_group_case(world_size, clipping, sub_group_size, freeze_after_first_step, stock):
    """Train ``STEPS`` steps (all of it under ``stock_deepspeed()`` if ``stock``); the final params, the flat
    gradient buffer after every step, and the list lengths upstream's ``_prepare_fp32_grad_for_sub_group``
    flattened."""
    assert_fork_state()
    if stock:
        with stock_deepspeed():
            return _train(world_size, clipping, sub_group_size, freeze_after_first_step)
    return _train(world_size, clipping, sub_group_size, freeze_after_first_step)


def _train(world_size, clipping, sub_group_size, freeze_after_first_step):
    import deepspeed.comm as dist
    torch.manual_seed(11)
    # reentrant checkpointing: stock before 0.19.3 raises CheckpointError under the non-reentrant one
    model = CheckpointedStack(blocks=BLOCKS, use_reentrant=True)
    for block in model.blocks:
        torch.nn.init.normal_(block.lora.weight, std=0.2)
    batches = micro_batches(STEPS, world_size, requires_grad=True, seed=5)
    config = zero_config(3, sub_group_size=sub_group_size)
    config["gradient_clipping"] = clipping
    engine = make_engine(model, config)
    optimizer = engine.optimizer
    flattened, buffers = [], []
    stock_flatten = optimizer.flatten

    def flatten(tensors):
        flattened.append(len(tensors))
        return stock_flatten(tensors)

    optimizer.flatten = flatten
    rank = dist.get_rank()
    for index, row in enumerate(batches):
        engine.backward(engine(row[rank]))
        engine.step()
        buffers.append(optimizer.grad_partitions_flat_buffer.clone())
        if freeze_after_first_step and index == 0:
            engine.module.blocks[0].lora.weight.requires_grad_(False)
    return {"values": named_values(engine), "buffers": buffers, "flattened": flattened,
            "sub_groups": [len(group) for group in optimizer.fp16_groups]}


@pytest.mark.parametrize("world_size,clipping,sub_group_size", [(1, 1e-3, 1e9), (2, 1e-3, 300), (2, 0.0, 1e9)])
def test_the_step_is_stocks_with_one_region_per_sub_group(world_size, clipping, sub_group_size):
    args = (world_size, clipping, sub_group_size, False)
    ours = run_distributed(world_size, sub_group_case, *args, stock=False)
    theirs = run_distributed(world_size, sub_group_case, *args, stock=True)
    for rank, (mine, stock) in enumerate(zip(ours, theirs)):
        assert mine["values"].keys() == stock["values"].keys()
        for name, value in mine["values"].items():
            assert torch.equal(value, stock["values"][name]), f"rank {rank}: {name} differs from stock's"
        for step, (mine_buffer, stock_buffer) in enumerate(zip(mine["buffers"], stock["buffers"])):
            # a master gradient aliasing the buffer would carry the clipping's scaling into it
            assert torch.equal(mine_buffer, stock_buffer), f"rank {rank}: gradient buffer after step {step}"
        sizes = [size for _ in range(STEPS) for size in stock["sub_groups"]]
        assert stock["flattened"] == sizes
        if not fork_disabled():
            assert len(stock["sub_groups"]) > (1 if sub_group_size < 1e9 else 0)
            assert mine["flattened"] == [2 if size > 1 else 1 for size in sizes], mine["flattened"]


def test_a_param_frozen_mid_training_takes_stocks_per_param_list():
    ours = run_distributed(1, sub_group_case, 1, 1e-3, 1e9, True, stock=False)[0]
    theirs = run_distributed(1, sub_group_case, 1, 1e-3, 1e9, True, stock=True)[0]
    for name, value in ours["values"].items():
        assert torch.equal(value, theirs["values"][name]), name
    size = theirs["sub_groups"][0]
    assert theirs["flattened"] == [size] * STEPS
    if not fork_disabled():
        assert ours["flattened"] == [2, size, size]
