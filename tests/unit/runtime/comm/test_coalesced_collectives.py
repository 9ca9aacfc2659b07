"""The fork's ``reduce_scatter_coalesced`` (Note [A reduce-scatter over one rank]): with one rank it returns what
upstream's returns, bit for bit, without upstream's copy and collective; with two ranks it is upstream's."""

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.test_stage3_gradients import partitions_case
from tests.unit.runtime.zero.zero_case import fork_disabled

_SPECIAL = (float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.0e38)


def _gradients(seed, dtype, with_special):
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 40, (int(torch.randint(1, 6, (1, ), generator=generator)), ), generator=generator)
    gradients = [torch.randn(int(size), generator=generator).to(dtype) for size in sizes]
    if with_special:
        flat = gradients[0]
        for index, value in enumerate(_SPECIAL[:flat.numel()]):
            flat[index] = value
    return gradients


def _same_bits(actual, expected):
    """Equal values, NaN where the other has NaN (x / 1 may quiet a NaN's payload), the same shape and dtype."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[expected.dtype]
    assert torch.equal(actual[~nan].view(bits), expected[~nan].view(bits))


def returns_upstreams_values(cases):
    import deepspeed.comm as dist
    from deepspeed.runtime.comm import coalesced_collectives as upstream
    from zero3_ac.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
    calls = []
    stock = upstream.reduce_scatter_coalesced
    upstream.reduce_scatter_coalesced = lambda tensors, group=None: calls.append(len(tensors)) or stock(tensors, group)
    try:
        for seed, dtype, with_special in cases:
            gradients = [g + dist.get_rank() if dist.get_rank() else g for g in _gradients(seed, dtype, with_special)]
            expected = stock([g.clone() for g in gradients], None)
            actual = reduce_scatter_coalesced([g.clone() for g in gradients], None)
            assert len(actual) == len(expected)
            for got, want in zip(actual, expected):
                _same_bits(got, want)
    finally:
        upstream.reduce_scatter_coalesced = stock
    return len(calls)


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_reduce_scatter_returns_upstreams_values_and_runs_upstreams_collective_only_over_two_ranks(world_size):
    cases = [(seed, dtype, seed % 2 == 0) for seed in range(12) for dtype in (torch.float32, torch.bfloat16,
                                                                              torch.float16)]
    for rank, upstream_calls in enumerate(run_distributed(world_size, returns_upstreams_values, cases)):
        assert upstream_calls == (0 if world_size == 1 else len(cases)), f"rank {rank}"


def test_one_rank_training_leaves_the_gradient_partitions_upstreams_reduce_scatter_leaves():
    if fork_disabled():
        pytest.skip("compares the fork's reduce-scatter with upstream's")
    fork = run_distributed(1, partitions_case, False)[0]
    upstream = run_distributed(1, partitions_case, False, upstream_reduce_scatter=True)[0]
    assert fork[0].keys() == upstream[0].keys()
    for name, partition in fork[0].items():
        assert torch.equal(partition, upstream[0][name]), name
    assert fork[1:] == upstream[1:]
    assert any(partition.abs().sum() > 0 for partition in fork[0].values())
