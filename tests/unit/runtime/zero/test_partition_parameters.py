"""partition_parameters.py: ``print_rank_0`` checking its flags first (Note [Debug printing that prints nothing]),
and the blocking gather of several params on 2 gloo ranks (Note [A blocking gather of several params waits
for each])."""

import pytest
import torch

from tests.unit.common import run_distributed

from zero3_ac.runtime.zero.partition_parameters import print_rank_0_checking_flags_first


@pytest.mark.parametrize("debug, force, prints", [(False, False, False), (True, False, True), (False, True, True)])
def test_upstream_print_runs_exactly_when_it_would_print(debug, force, prints):
    calls = []
    quiet = print_rank_0_checking_flags_first(lambda message, debug=False, force=False: calls.append(
        (message, debug, force)))
    quiet("message", debug=debug, force=force)
    assert calls == ([("message", debug, force)] if prints else [])


def test_positional_flags_reach_upstream_print():
    calls = []
    quiet = print_rank_0_checking_flags_first(lambda message, debug=False, force=False: calls.append(force))
    quiet("message", False, True)
    assert calls == [True]


# Note [A blocking gather of several params waits for each]: a large param gathered together with a small one
# after it (the order of ds_id), read the moment ``GatheredParameters`` has entered. Stock 0.18.5 and 0.19.2
# wait for the small one's all-gather only; gloo has then rarely finished the large one's 64 MiB.
LARGE_DIM, READS = 4096, 8


def read_at_once_case():
    import deepspeed
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        large = torch.nn.Linear(LARGE_DIM, LARGE_DIM, bias=False)
        small = torch.nn.Linear(2, 2, bias=False)
    with deepspeed.zero.GatheredParameters([large.weight]):
        expected = large.weight.data.clone()
    wrong = 0
    for _ in range(READS):
        with deepspeed.zero.GatheredParameters([large.weight, small.weight]):
            wrong += not torch.equal(large.weight.data, expected)
    return wrong


@pytest.mark.stock_fails
def test_a_gather_of_several_params_has_each_in_full_when_it_returns():
    assert run_distributed(2, read_at_once_case) == [0, 0]
