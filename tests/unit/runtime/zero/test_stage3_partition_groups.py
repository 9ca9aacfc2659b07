"""Partition-group checks of runs of the optimizer's own params answered from facts taken once
(``stage3_partition_groups``, Note [Partition-group checks over the optimizer's own params]): the same
answers as upstream's, for the optimizer's params and for runs holding others, without asking each param
at every reduce and norm."""

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (CheckpointedStack, assert_fork_state, fork_disabled, make_engine,
                                               micro_batches, stock_deepspeed, zero_config)

pytestmark = pytest.mark.skipif(
    not hasattr(__import__("deepspeed.runtime.zero.stage3", fromlist=["x"]).DeepSpeedZeroOptimizer_Stage3,
                "_assert_same_partition_group"),
    reason="DeepSpeed before 0.19.3 has no partition-group checks")


BLOCKS = 8


def _outcome(function, *args):
    try:
        return ("returned", function(*args))
    except RuntimeError as error:
        return ("raised", str(error))


def partition_group_case(stock):
    """The answers of both methods for runs of own and foreign params, and how often a step asks a param
    (all of it under ``stock_deepspeed()`` if ``stock``)."""
    assert_fork_state()
    if stock:
        with stock_deepspeed():
            return _ask()
    return _ask()


def _ask():
    import deepspeed.comm as dist
    torch.manual_seed(3)
    engine = make_engine(CheckpointedStack(blocks=BLOCKS), zero_config(3))
    optimizer = engine.optimizer
    own = [param for group in optimizer.fp16_groups for param in group]
    other_group = dist.new_group(ranks=[0])
    foreign = torch.nn.Parameter(torch.zeros(2))
    foreign.ds_process_group = other_group
    expert = torch.nn.Parameter(torch.zeros(2))
    expert.ds_zero_placement_family = "autoep_expert"
    expert.ds_process_group = optimizer._get_param_partition_group(own[0])
    runs = {"own": own, "own, reversed": own[::-1], "one own": own[:1], "empty": [],
            "own then another group's": own + [foreign], "another group's first": [foreign] + own,
            "an expert alone": [expert], "own and an expert": own[:1] + [expert]}
    answers = {}
    for name, run in runs.items():
        answers[name] = (_outcome(optimizer._assert_same_partition_group, run),
                         _outcome(optimizer._autoep_expert_parallel_group, run))
    asked = []
    stock_group = type(optimizer)._get_param_partition_group

    def counting(self, param):
        asked.append(param)
        return stock_group(self, param)

    optimizer._get_param_partition_group = counting.__get__(optimizer)
    batch = micro_batches(1, 1, requires_grad=True, seed=4)[0][0]
    engine.backward(engine(batch))
    engine.step()
    return {"answers": answers, "asked_in_a_step": len(asked), "trainable": sum(p.requires_grad for p in own)}


def test_answers_are_upstreams_and_a_step_does_not_ask_every_param():
    result = run_distributed(1, partition_group_case, stock=False)[0]
    stock = run_distributed(1, partition_group_case, stock=True)[0]
    answers = result["answers"]
    assert answers == stock["answers"]
    for name in ("own", "own, reversed", "one own", "empty"):
        assert answers[name] == (("returned", None), ("returned", None)), name
    for name in ("own then another group's", "another group's first"):
        check, expert_group = answers[name]
        assert check[0] == "raised" and "mixes partition process groups" in check[1], (name, check)
        assert expert_group == ("returned", None), name
    # upstream's own answer for a run of experts: it looks up the run's expert-parallel group name
    assert answers["an expert alone"][1][0] == "raised", answers["an expert alone"]
    assert "missing an expert-parallel group name" in answers["an expert alone"][1][1]
    assert answers["own and an expert"] == (("returned", None), ("returned", None))
    # upstream asks every trainable param at the reduce, the reduce-scatter and the norm
    assert result["trainable"] >= BLOCKS and stock["asked_in_a_step"] >= 3 * stock["trainable"], stock
    if not fork_disabled():
        assert result["asked_in_a_step"] <= stock["asked_in_a_step"] - 3 * result["trainable"], (result, stock)
