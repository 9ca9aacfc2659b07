"""The gradient norm's fp64 copies made in one batch, and the norm computed without upstream's loop
(``stage3_grad_norm``, Notes [The gradient norm's fp64 copies] and [The gradient norm without upstream's
per-gradient loop]): every norm and every step are upstream's bit for bit; the norm's kernels get aligned
views of one buffer for the gradients the plan stages and casts of the others; the buffer stays within the
fp32 copy of the gradients that the step makes next; upstream's function runs only where its texts may
compute different things (the inf norm, another p, a model-parallel group)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (CheckpointedStack, assert_fork_state, fork_disabled, make_engine,
                                               micro_batches, named_values, stock_deepspeed, zero_config)
from zero3_ac.runtime.zero.stage3_grad_norm import (ALIGNMENT_BYTES, FLAT_COPY_BYTES_PER_ELEMENT, padded,
                                                    plan_sizes)

BLOCKS = 7
STEPS = 3
NORM_BYTES = 8


def _staged_bytes(stageable, chosen):
    return sum(padded(stageable[index], NORM_BYTES) for index in chosen) * NORM_BYTES


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=40), st.lists(st.integers(0, 5000), max_size=5),
       st.integers(0, 3000))
def test_the_plan_stays_within_the_steps_fp32_copy_and_stages_the_smallest_first(stageable, cast, uncast):
    total = sum(stageable) + sum(cast) + uncast
    chosen = plan_sizes(stageable, cast, total, NORM_BYTES)
    staged = set(chosen)
    assert len(staged) == len(chosen) and staged <= set(range(len(stageable)))
    left = [stageable[index] for index in range(len(stageable)) if index not in staged]
    if chosen:
        assert max(stageable[index] for index in chosen) <= min(left, default=float("inf"))
        largest_left = max(cast + left, default=0) * NORM_BYTES
        assert _staged_bytes(stageable, chosen) + largest_left <= FLAT_COPY_BYTES_PER_ELEMENT * total
    if left:  # one more would not fit, whichever is left out then
        more = chosen + [min(set(range(len(stageable))) - staged, key=stageable.__getitem__)]
        still_left = [stageable[index] for index in range(len(stageable)) if index not in set(more)]
        largest_left = max(cast + still_left, default=0) * NORM_BYTES
        assert _staged_bytes(stageable, more) + largest_left > FLAT_COPY_BYTES_PER_ELEMENT * total


def test_the_plan_leaves_a_large_gradient_to_upstream():
    lora = [16 * 2048] * 9 + [256 * 16] * 2 + [16 * 5632, 5632 * 16, 5632 * 16]
    chosen = plan_sizes(lora, [], sum(lora), NORM_BYTES)
    assert sorted(lora[index] for index in chosen) == [256 * 16] * 2 + [16 * 2048] * 5
    assert plan_sizes([2000] * 4 + [64] * 10, [], 8640, NORM_BYTES) == list(range(4, 14))
    # upstream's cast of a gradient of more than half the elements alone exceeds the fp32 copy
    assert plan_sizes([10**6] + [64] * 10, [], 10**6 + 640, NORM_BYTES) == []
    assert plan_sizes([64] * 4, [10**6], 256 + 10**6, NORM_BYTES) == []
    assert padded(1, NORM_BYTES) * NORM_BYTES == ALIGNMENT_BYTES and padded(64, NORM_BYTES) == 64


def norm_case(world_size, dtype, sub_group_size, stock):
    """Train ``STEPS`` steps with clipping that applies (all of it under ``stock_deepspeed()`` if ``stock``):
    the final params, each step's norm, and what upstream's norm received."""
    assert_fork_state()
    if stock:
        with stock_deepspeed():
            return _train(world_size, dtype, sub_group_size)
    return _train(world_size, dtype, sub_group_size)


def _received(gradients):
    """What upstream's norm got: per gradient its dtype, and for one of the norm dtype its byte offset in
    its storage and the storage's address."""
    return [(str(gradient.dtype), gradient.data_ptr() - gradient.untyped_storage().data_ptr(),
             gradient.untyped_storage().data_ptr(), gradient.numel()) for gradient in gradients]


def _recording_staged(received):
    """Patches the plan's ``staged`` to append what it returns to ``received``; returns the undo."""
    from zero3_ac.runtime.zero import stage3_grad_norm
    staged = stage3_grad_norm._Plan.staged

    def recording(plan, gradients):
        result = staged(plan, gradients)
        received.append(_received(result))
        return result

    stage3_grad_norm._Plan.staged = recording
    return lambda: setattr(stage3_grad_norm._Plan, "staged", staged)


def _train(world_size, dtype, sub_group_size):
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from zero3_ac import activation
    torch.manual_seed(13)
    # reentrant checkpointing: stock before 0.19.3 raises CheckpointError under the non-reentrant one
    model = CheckpointedStack(blocks=BLOCKS, use_reentrant=True)
    for index, block in enumerate(model.blocks):
        torch.nn.init.normal_(block.lora.weight, std=0.2 * (index + 1))
    batches = micro_batches(STEPS, world_size, dtype=dtype, requires_grad=True, seed=7)
    config = zero_config(3, dtype=dtype, sub_group_size=sub_group_size)
    config["gradient_clipping"] = 1e-3
    engine = make_engine(model, config)
    received, upstream_calls = [], []
    key = (DeepSpeedZeroOptimizer_Stage3, "get_grad_norm_direct")
    upstream = activation._originals.get(key)
    if upstream is not None:

        def counting(optimizer, gradients, params, norm_type=2):
            upstream_calls.append(len(gradients))
            return upstream(optimizer, gradients, params, norm_type)

        activation._originals[key] = counting
        undo_staged = _recording_staged(received)
    try:
        rank = dist.get_rank()
        norms = []
        for row in batches:
            engine.backward(engine(row[rank]))
            engine.step()
            norms.append(float(engine.get_global_grad_norm()))
    finally:
        if upstream is not None:
            activation._originals[key] = upstream
            undo_staged()
    return {"values": named_values(engine), "norms": norms, "received": received, "upstream_calls": upstream_calls,
            "sub_groups": [len(group) for group in engine.optimizer.fp16_groups]}


@pytest.mark.parametrize("world_size,dtype,sub_group_size", [(1, torch.float32, 1024), (2, torch.float32, 1e9),
                                                              (1, torch.bfloat16, 1e9), (2, torch.bfloat16, 1e9)])
def test_the_norms_and_the_steps_are_upstreams(world_size, dtype, sub_group_size):
    args = (world_size, dtype, sub_group_size)
    ours = run_distributed(world_size, norm_case, *args, stock=False)
    theirs = run_distributed(world_size, norm_case, *args, stock=True)
    for rank, (mine, stock) in enumerate(zip(ours, theirs)):
        assert mine["norms"] == stock["norms"], f"rank {rank}"
        assert stock["norms"][0] > 1e-3, "the clipping must apply for the norm to reach the params"
        for name, value in mine["values"].items():
            assert torch.equal(value, stock["values"][name]), f"rank {rank}: {name} differs from stock's"
        if fork_disabled():
            continue
        assert mine["upstream_calls"] == [], "the fork computes these norms itself"
        assert len(mine["received"]) == STEPS * len(mine["sub_groups"])
        assert len(mine["sub_groups"]) > 1 or sub_group_size >= 1e9, mine["sub_groups"]
        staged = 0
        for gradients in mine["received"]:
            copies = [entry for entry in gradients if entry[0] == "torch.float64"]
            staged += len(copies)
            assert len(copies) < len(gradients), gradients  # at most half of the bytes: the budget
            assert len({storage for _, _, storage, _ in copies}) <= 1, "one buffer"
            assert all(offset % ALIGNMENT_BYTES == 0 for _, offset, _, _ in copies), copies
            budget = FLAT_COPY_BYTES_PER_ELEMENT * sum(numel for *_, numel in gradients)
            assert sum(padded(numel, NORM_BYTES) for *_, numel in copies) * NORM_BYTES <= budget
        assert staged >= STEPS, mine["received"]


def mixed_gradients_case(norm_type, model_parallel=False, poison=None):
    """Upstream's norm and the fork's of gradients that are not all stageable: whether upstream's ran, what
    upstream got (where it ran) and what the norm's kernels got (where the fork staged)."""
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from zero3_ac import activation
    from zero3_ac.runtime.zero import stage3_grad_norm
    engine = make_engine(CheckpointedStack(blocks=2), zero_config(3))
    optimizer = engine.optimizer
    if model_parallel:  # a model-parallel group of one rank: upstream all-reduces over it too
        optimizer.model_parallel_group = dist.new_group([0])
    upstream = activation._originals.get((DeepSpeedZeroOptimizer_Stage3, "get_grad_norm_direct"),
                                         DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct)
    generator = torch.Generator().manual_seed(3)
    gradients = [torch.randn(50, generator=generator), torch.randn(200, generator=generator),
                 torch.randn(30, generator=generator)[::3], torch.randn(4, 5, generator=generator),
                 torch.randn(6, generator=generator).double(), torch.randn(70, generator=generator).bfloat16(),
                 *(torch.randn(200, generator=generator) for _ in range(3))]
    if poison is not None:  # a staged and an unstaged gradient
        gradients[0][7] = gradients[7][3] = poison
    params = [optimizer.fp16_groups[0][0]] * len(gradients)
    received, staged = [], []

    def recording(optimizer, gradients, params, norm_type):
        received.append(list(gradients))
        return upstream(optimizer, gradients, params, norm_type)

    undo_staged = _recording_staged(staged)
    try:
        fork = stage3_grad_norm.get_grad_norm_direct(optimizer, recording, gradients, params, norm_type)
    finally:
        undo_staged()
    stock = upstream(optimizer, gradients, params, norm_type)
    result = {"equal": torch.equal(fork, stock) and fork.dtype == stock.dtype, "norm": float(stock),
              "upstream_ran": bool(received),
              "staged": staged}
    if received:
        result.update(same_objects=[got is given for got, given in zip(received[0], gradients)],
                      dtypes=[str(got.dtype) for got in received[0]], received=_received(received[0]))
    return result


def _assert_the_two_small_ones_staged(staged):
    # the two small ones staged (the budget leaves the four of 200 to the norm's own casts), in one buffer
    assert [staged[index][0] for index in range(9)] == ["torch.float64"] + ["torch.float32"] * 3 + \
        ["torch.float64"] * 2 + ["torch.float32"] * 3, staged
    copies = [staged[index] for index in (0, 5)]
    assert copies[0][2] == copies[1][2] and [offset for _, offset, _, _ in copies] == [0, ALIGNMENT_BYTES]


def test_the_fork_computes_the_2_norm_of_gradients_it_cannot_stage():
    result = run_distributed(1, mixed_gradients_case, 2)[0]
    assert result["equal"] and result["norm"] > 0
    if fork_disabled():
        return
    assert not result["upstream_ran"]
    assert len(result["staged"]) == 1
    _assert_the_two_small_ones_staged(result["staged"][0])


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_an_inf_or_nan_2_norm_is_minus_one_as_upstreams(poison):
    result = run_distributed(1, mixed_gradients_case, 2, False, poison)[0]
    assert result["equal"] and result["norm"] == -1.0
    assert fork_disabled() or not result["upstream_ran"]


@pytest.mark.parametrize("norm_type,model_parallel", [(3, False), (2, True)])
def test_upstream_computes_other_norms_and_model_parallel_ones_on_the_copies(norm_type, model_parallel):
    result = run_distributed(1, mixed_gradients_case, norm_type, model_parallel)[0]
    assert result["equal"] and result["norm"] > 0
    if fork_disabled():
        return
    assert result["upstream_ran"]
    # the strided, the 2-D and the fp64 gradient as they were; the two small ones staged
    assert result["same_objects"] == [False, True, True, True, True, False, True, True, True], result
    _assert_the_two_small_ones_staged(result["received"])


def test_the_inf_norm_is_upstreams_alone():
    result = run_distributed(1, mixed_gradients_case, float("inf"))[0]
    assert result["equal"]
    if not fork_disabled():
        assert result["upstream_ran"] and result["same_objects"] == [True] * 9 and result["staged"] == []
