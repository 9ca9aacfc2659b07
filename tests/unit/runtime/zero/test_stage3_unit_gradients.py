"""A gather unit's gradients enter ZeRO-3's reduce bucket together (``stage3_unit_gradients``, Note [A
unit's gradients enter the reduce bucket together]): the step is plain PyTorch's, the buckets reduce
the params in the order their gradients arrived, and upstream's per-param move into the bucket runs
only for params outside the units (on stock: for every trainable param)."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (DIM, FrozenLoraBlock, assert_close_deltas, assert_fork_state,
                                               fork_disabled, make_engine, micro_batches, named_values,
                                               reference_deltas, zero_config)

BLOCKS = 3
TRAINABLE = 2 * BLOCKS + 1  # each reduced once per backward however often it is used (non-reentrant)
STEPS = 2


class TwoAdapterBlock(FrozenLoraBlock):
    """Two trainable matrices per block: a unit's run can fill a bucket half-way."""

    def __init__(self, dim=DIM):
        super().__init__(dim)
        self.lora_up = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x, skip_up):
        if skip_up:  # a branch the data skips: the unit's second matrix gets no gradient
            return super().forward(x)
        return super().forward(x) + self.lora_up(torch.tanh(x))


class Stack(torch.nn.Module):

    def __init__(self, use_reentrant, repeat_first):
        super().__init__()
        self.blocks = torch.nn.ModuleList(TwoAdapterBlock() for _ in range(BLOCKS))
        self.head = torch.nn.Linear(DIM, DIM, bias=False)
        self.use_reentrant = use_reentrant
        self.repeat_first = repeat_first

    def forward(self, x, skip_up=False):
        blocks = [*self.blocks, self.blocks[0]] if self.repeat_first else self.blocks
        for block in blocks:
            x = checkpoint(block, x, skip_up, use_reentrant=self.use_reentrant)
        return self.head(x).pow(2).mean()


def _recording(optimizer_class, name, record):
    mangled = f"_{optimizer_class.__name__}__{name}"
    stock = getattr(optimizer_class, mangled)

    def wrapper(self, *args, **kwargs):
        record(self, *args)
        return stock(self, *args, **kwargs)

    setattr(optimizer_class, mangled, wrapper)
    return lambda: setattr(optimizer_class, mangled, stock)


def unit_gradients_case(world_size, gas, bucket_size, use_reentrant=False, repeat_first=False, skip_odd=False,
                        offload=False):
    import deepspeed.comm as dist
    import zero3_ac
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    assert_fork_state()
    torch.manual_seed(7)
    model = Stack(use_reentrant, repeat_first)
    for block in model.blocks:
        torch.nn.init.normal_(block.lora.weight, std=0.2)
        torch.nn.init.normal_(block.lora_up.weight, std=0.2)
    batches = micro_batches(STEPS * gas, world_size, requires_grad=use_reentrant, seed=3)

    def skips(index):
        return skip_odd and index % 2 == 1

    expected = reference_deltas(model, batches, gas, forward=lambda model, x, index: model(x, skips(index)))
    zero3_ac.set_gather_units(model, [TwoAdapterBlock.__name__])
    config = zero_config(3, gas=gas, reduce_bucket_size=bucket_size,
                         **({"offload_optimizer": {"device": "cpu"}} if offload else {}))
    config["zero_force_ds_cpu_optimizer"] = False  # torch SGD on the offloaded partitions
    engine = make_engine(model, config)
    initial = named_values(engine)
    adds, reduced, arrived = [0], [], []
    restores = [
        _recording(DeepSpeedZeroOptimizer_Stage3, "add_grad_to_ipg_bucket",
                   lambda opt, param: adds.__setitem__(0, adds[0] + 1)),
        _recording(DeepSpeedZeroOptimizer_Stage3, "reduce_and_partition_ipg_grads",
                   lambda opt, dtype: reduced.extend(param.ds_id for param in opt.ipg_buckets[dtype].params)),
    ]
    for param in engine.module.parameters():  # registered after ZeRO-3's hook: runs after it
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda param: arrived.append(param.ds_id))
    try:
        rank = dist.get_rank()
        for index, row in enumerate(batches):
            engine.backward(engine(row[rank], skips(index)))
            engine.step()
    finally:
        for restore in restores:
            restore()
    final = named_values(engine)
    assert_close_deltas({name: final[name] - initial[name] for name in expected}, expected, torch.float32)
    return {"adds": adds[0], "reduced": reduced, "arrived": arrived, "backwards": len(batches)}


@pytest.mark.parametrize("world_size,gas", [(1, 1), (2, 2)])
def test_unit_gradients_move_together_and_train_like_pytorch(world_size, gas):
    for result in run_distributed(world_size, unit_gradients_case, world_size, gas, 10**6):
        assert result["reduced"] == result["arrived"]
        if fork_disabled():
            assert result["adds"] == TRAINABLE * result["backwards"], result["adds"]
        else:
            assert result["adds"] == result["backwards"], result["adds"]  # the head, in no unit


@pytest.mark.parametrize("bucket_size", [3 * DIM * DIM - 1, 2 * DIM * DIM - 1])
def test_a_bucket_that_fills_inside_a_unit_or_is_smaller_than_one_keeps_stocks_reductions(bucket_size):
    """A bucket of just under three matrices fills half-way through a unit's run (upstream reduces it
    and takes the next param itself); a unit over the bucket size is not batched."""
    result = run_distributed(2, unit_gradients_case, 2, 1, bucket_size)[0]
    assert result["reduced"] == result["arrived"]
    if bucket_size < 2 * DIM * DIM and not fork_disabled():
        assert result["adds"] == TRAINABLE * result["backwards"], result["adds"]


@pytest.mark.parametrize("use_reentrant", [False, pytest.param(True, marks=pytest.mark.stock_fails)])
def test_a_unit_called_twice_reduces_the_summed_gradient(use_reentrant):
    """Reentrant: the first block's params get their gradient twice in one backward (once per region;
    stock asserts that a bucket holds distinct params, stage3_gradients' Note [A gradient that arrives
    twice in one backward])."""
    result = run_distributed(2, unit_gradients_case, 2, 2, 10**6, use_reentrant, True)[0]
    if not use_reentrant:
        assert result["reduced"] == result["arrived"]


@pytest.mark.parametrize("offload", [False, pytest.param(True, marks=pytest.mark.stock_fails)])
def test_a_unit_whose_branch_the_data_skips_moves_at_the_next_arrival(offload):
    """Every other micro-batch skips each unit's second matrix: the unit never completes, and its
    pending gradient moves when the next unit's first gradient arrives (the last unit's: when the
    head's does). Offloaded, stock loses the second matrices' gradients, which were not reduced in
    the boundary micro-batch (stage3_gradients' Note [Micro-step 0 copies, and nothing else clears
    the gradient partitions])."""
    result = run_distributed(2, unit_gradients_case, 2, 2, 10**6, False, False, True, offload)[0]
    assert result["reduced"] == result["arrived"]
