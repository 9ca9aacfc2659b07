"""coalesced_copy_out.py: a coalesced all-gather's params come out of its flat buffer in one op, with
upstream's values (Note [One copy-out per coalesced all-gather])."""

import pytest
import torch

from tests.unit.common import run_distributed

from zero3_ac.runtime.zero.coalesced_copy_out import rank_major_matrix


def test_consecutive_slices_of_one_buffer_are_its_rank_major_matrix():
    flat = torch.arange(12.0)
    matrix = rank_major_matrix([flat.narrow(0, 0, 4), flat.narrow(0, 4, 4), flat.narrow(0, 8, 4)])
    assert matrix.shape == (3, 4) and matrix.data_ptr() == flat.data_ptr()
    assert torch.equal(matrix, flat.view(3, 4))


@pytest.mark.parametrize("partitions", [
    lambda flat: [flat.narrow(0, 4, 4), flat.narrow(0, 0, 4)],  # out of rank order
    lambda flat: [flat.narrow(0, 0, 4), flat.narrow(0, 6, 4)],  # a gap
    lambda flat: [flat.narrow(0, 0, 4), flat.narrow(0, 4, 3)],  # unequal
    lambda flat: [flat.narrow(0, 0, 4), torch.zeros(4)],  # another buffer
    lambda flat: [flat[0:8:2], flat[1:9:2]],  # not contiguous
])
def test_anything_else_is_left_to_upstream(partitions):
    assert rank_major_matrix(partitions(torch.arange(12.0))) is None


# Param sizes: even and odd numels (rank 1's shard padded), one smaller than the world size, two dtypes
# (upstream coalesces each dtype on its own).
SHAPES = [((4, 6), torch.float32), ((5, 3), torch.float32), ((1,), torch.float32), ((7,), torch.bfloat16),
          ((3, 2), torch.bfloat16)]


class _CountingCats(torch.overrides.TorchFunctionMode):

    def __init__(self):
        super().__init__()
        self.cats = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.cats += func is torch.cat
        return func(*args, **(kwargs or {}))


def coalesced_gather_case():
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    torch.manual_seed(0)
    params = []
    for shape, dtype in SHAPES:  # Init casts what it partitions to its config's dtype
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                  "bf16": {"enabled": dtype == torch.bfloat16}}
        with deepspeed.zero.Init(config_dict_or_path=config):
            params.extend(torch.nn.ParameterList([torch.nn.Parameter(torch.randn(shape))]))
    expected = []
    for param in params:  # one param at a time: the sequential gather, not the coalesced one
        with deepspeed.zero.GatheredParameters([param]):
            expected.append(param.data.clone())
    handle = params[0].all_gather_coalesced(params)
    counting = _CountingCats()
    with counting:
        handle.wait()
    statuses = [param.ds_status == ZeroParamStatus.AVAILABLE for param in params]
    equal = [torch.equal(param.data, want) and param.dtype == want.dtype for param, want in zip(params, expected)]
    params[0].partition(params)
    return statuses, equal, counting.cats, [param.dtype for param in params]


@pytest.mark.stock_fails  # stock puts each param together with a torch.cat of its pieces
def test_every_param_comes_out_whole_with_upstreams_values_and_no_cat_per_param():
    for statuses, equal, cats, dtypes in run_distributed(2, coalesced_gather_case):
        assert dtypes == [dtype for _, dtype in SHAPES]
        assert statuses == [True] * len(SHAPES)
        assert equal == [True] * len(SHAPES)
        assert cats == 0
