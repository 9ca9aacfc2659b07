"""Lifecycle accounting: re-gathers, agreement with the stock-neutral meter, the per-step log line."""

import logging

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (DIM, CheckpointedStack, assert_fork_state, fork_disabled, make_engine,
                                               micro_batches, zero_config)
from zero3_ac.runtime.zero.accounting import StepAccounting

WORLD_SIZE = 2
LEAN = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}


def fork_only():
    if fork_disabled():
        pytest.skip("the lifecycle accounting is the fork's (stock DeepSpeed has none)")


# ---------------------------------------------------------------------------- counting rules
def test_a_regather_is_a_gather_after_a_release_in_the_same_pass():
    step = StepAccounting()
    frozen, trainable = 1, 2
    step.record_gather("forward", True, ds_id=frozen, numel=4, nbytes=16)
    step.record_gather("forward", False, ds_id=trainable, numel=4, nbytes=16)
    step.record_release("forward", frozen, 16)
    step.record_gather("forward", True, ds_id=frozen, numel=4, nbytes=16)  # forward->forward
    step.record_release("forward", frozen, 16)
    step.record_release("forward", trainable, 16)
    step.record_gather("recompute", True, ds_id=frozen, numel=4, nbytes=16)  # the expected recompute gather
    step.record_release("recompute", frozen, 16)
    step.record_gather("backward", True, ds_id=frozen, numel=4, nbytes=16)  # recompute->backward
    step.record_release("backward", frozen, 16)
    step.record_gather("backward", True, ds_id=frozen, numel=4, nbytes=16)  # backward->backward
    step.record_release("recompute", trainable, 16)  # kept from the forward, released by its recompute
    step.record_gather("backward", False, ds_id=trainable, numel=4, nbytes=16)  # recompute->backward
    assert dict(step.regathered_params) == {
        "forward->forward/frozen": 1,
        "recompute->backward/frozen": 1,
        "backward->backward/frozen": 1,
        "recompute->backward/trainable": 1,
    }
    assert dict(step.regathered_bytes) == {key: 16 for key in step.regathered_params}
    assert step.frozen_backward_regathers() == {frozen: 2}


def test_peak_and_backward_peak_follow_gathers_and_releases():
    step = StepAccounting()
    step.record_gather("forward", True, ds_id=1, numel=1, nbytes=10)
    step.record_gather("forward", True, ds_id=2, numel=1, nbytes=20)
    step.record_release("forward", 1, 10)
    step.record_release("forward", 2, 20)
    step.record_gather("recompute", True, ds_id=1, numel=1, nbytes=10)
    step.record_gather("forward", True, ds_id=3, numel=1, nbytes=5, persistent=True)
    assert (step.peak_live_bytes, step.backward_peak_live_bytes, step.live_bytes) == (30, 10, 10)
    assert not step.regathered_params


# ---------------------------------------------------------------------------- on an engine
class TwiceCalled(torch.nn.Module):
    """A trainable input layer, then one frozen Linear called twice, then a trainable head."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(DIM, DIM)
        self.shared = torch.nn.Linear(DIM, DIM)
        self.shared.requires_grad_(False)
        self.head = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        return self.head(self.shared(torch.tanh(self.shared(self.inner(x))))).pow(2).mean()


def regather_case(model_name):
    import deepspeed.comm as dist
    import zero3_ac
    from zero3_ac.utils.gather_meter import GatherMeter
    assert_fork_state()
    torch.manual_seed(5)
    model = TwiceCalled() if model_name == "twice" else CheckpointedStack(blocks=3, use_reentrant=False)
    engine = make_engine(model, zero_config(3, **LEAN))
    meter = GatherMeter(engine)
    rank = dist.get_rank()
    for row in micro_batches(2, dist.get_world_size(), requires_grad=True):
        meter.reset()
        engine(row[rank]).backward()
        engine.step()
    shared_ids = [p.ds_id for p in engine.module.shared.parameters()] if model_name == "twice" else []
    stats = zero3_ac.lifecycle_stats(engine)
    engine.destroy()
    if stats is None:  # stock DeepSpeed: the meter alone
        return dict(meter.step.regathered_params), shared_ids
    step = stats["current"]
    assert step["gathered_bytes"] == dict(meter.step.gathered_bytes), "the accounting and the meter disagree"
    assert step["regathered_params"] == dict(meter.step.regathered_params)
    return step["regathered_params"], shared_ids


def test_a_module_called_twice_under_a_zero_reuse_distance_is_regathered_in_forward():
    regathered, shared_ids = run_distributed(WORLD_SIZE, regather_case, "twice")[0]
    assert regathered.get("forward->forward/frozen") == len(shared_ids), regathered


@pytest.mark.stock_fails
def test_no_param_is_regathered_in_the_backward_of_non_reentrant_checkpoints():
    regathered, _ = run_distributed(WORLD_SIZE, regather_case, "checkpointed")[0]
    backward_pass = {key: n for key, n in regathered.items() if not key.startswith("forward->")}
    assert not backward_pass, f"re-gathered in the backward pass: {backward_pass}"


def step_log_case():
    import deepspeed.comm as dist
    import zero3_ac
    from deepspeed.utils import logger
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    zero3_ac.set_step_logging(True)
    try:
        engine = make_engine(CheckpointedStack(blocks=2), zero_config(3))
        for row in micro_batches(3, dist.get_world_size(), requires_grad=True):
            engine(row[dist.get_rank()]).backward()
            engine.step()
        engine.destroy()
    finally:
        zero3_ac.set_step_logging(False)
        logger.removeHandler(handler)
        logger.setLevel(level)
    return [record.getMessage() for record in records if "zero3_ac step" in record.getMessage()]


def test_step_logging_writes_one_line_per_finished_step_on_rank_zero():
    fork_only()
    lines = run_distributed(WORLD_SIZE, step_log_case)
    assert [len(rank_lines) for rank_lines in lines] == [2, 0], lines
    assert "zero3_ac step 1: gathered MiB fwd/rec/bwd" in lines[0][0] and "re-gathered 0 params" in lines[0][0], lines
