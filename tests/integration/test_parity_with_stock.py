"""Clients that run one engine in more than one way per step, fork against stock DeepSpeed, under ``accelerate launch``.

- ``trl_dpo_lora.py``: TRL's DPOTrainer, PEFT policy, ``ref_model=None``: two forwards of the engine
  (the reference one under ``no_grad`` with the adapter disabled) before one backward.
- ``trl_grpo_lora.py``: TRL's GRPOTrainer: ``generate`` on the engine between optimizer steps.
- ``frozen_tower_lora.py``: a frozen ``nn.MultiheadAttention`` tower (query is key is value) with
  LoRA on the Llama behind it, HF Trainer.

Each runs 4 steps on 2 CPU ranks with non-reentrant checkpointing and must train with the fork as
the SFT examples do (tests/integration/test_examples.py: every rank exits 0, nothing left gathered,
no frozen re-gather, nothing released by the safety net), and log what stock DeepSpeed logs on the
same script. Stock is the reference where it runs that script: 0.19.3+. Earlier releases crash
under non-reentrant checkpointing with frozen params (CheckpointError), so there the reference is
stock with reentrant checkpointing: the same forward and backward maths, recomputed the other way.
The TRL examples keep non-reentrant checkpointing with ``KeepNonReentrantCheckpointing``, which
refuses to run on stock DeepSpeed; their reference is stock as TRL runs it (``--trl-default``:
TRL's forced ``use_reentrant=True``), on every release.

Before 0.19.8, stock's blocking gather of several params races on gloo (Note [A blocking gather of
several params waits for each] in zero3_ac/runtime/zero/partition_parameters.py): GRPO's gather of the
whole model for generation, at every step, then rarely samples from a half-written weight (seen once
in CI on 0.18.5: stock's step-1 reward 0.593, where stock and the fork give 0.557 in every other run).
There the reference runs with ``stage3_allgather_sequential``, stock's own setting that gathers param
by param, each gather blocking: the same values gathered, so the same logs, without the race.
"""

import json
import math

import pytest

from tests.integration.test_examples import (DS_CONFIG, STEPS, STOCK_CRASHES, WORLD_SIZE, _output,
                                             assert_exited_cleanly, assert_trained_with_the_fork, launch)
from zero3_ac.runtime.zero.partition_parameters import coalesced_gather_waits_for_last_only

# Fork and stock gather the same values and reduce the same gradients: the runs agree to the last
# bit in practice; the tolerance leaves room for a reduction order that differs, not for a wrong step.
RTOL = 1e-5
ATOL = 1e-6
STOCK_REFERENCE_REENTRANT = STOCK_CRASHES
STOCK_GATHER_RACES = coalesced_gather_waits_for_last_only()


def stock_reference_config(tmp_path):
    """The examples' DeepSpeed config, gathering param by param where stock's coalesced gather races."""
    if not STOCK_GATHER_RACES:
        return DS_CONFIG
    with open(DS_CONFIG) as config_file:
        config = json.load(config_file)
    config["zero_optimization"]["stage3_allgather_sequential"] = True
    path = tmp_path / "ds_config_stock_reference.json"
    path.write_text(json.dumps(config))
    return str(path)


def stock_reference(example, tmp_path, *args, trl=False):
    """The example on stock DeepSpeed (``ZERO3_AC_DISABLE=1``).

    Non-reentrant if stock runs it, else reentrant; a TRL example (``trl``) as TRL runs it on stock: reentrant.
    Its gathers are sequential where stock's coalesced one races (``stock_reference_config``).
    """
    if trl:
        mode, reentrant = ("--trl-default",), True
    else:
        mode, reentrant = ("--use-reentrant",) if STOCK_REFERENCE_REENTRANT else (), STOCK_REFERENCE_REENTRANT
    result, summaries = launch("accelerate", example, tmp_path / "stock", *args, *mode,
                               ds_config=stock_reference_config(tmp_path), ZERO3_AC_DISABLE="1")
    assert_exited_cleanly(result)
    assert sorted(summaries) == list(range(WORLD_SIZE)), _output(result)
    for rank, summary in summaries.items():
        context = f"stock rank {rank}: {summary}"
        assert summary["error"] is None and not summary["fork_active"] and not summary["engine_uses_fork"], context
        assert summary["use_reentrant"] is reentrant, context
        assert len(summary["logs"]) == STEPS, context
    return summaries


def assert_same_logs(fork, stock, keys):
    """Every rank logged, at every step, the same ``keys`` with the fork as on stock (within RTOL/ATOL)."""
    for rank in range(WORLD_SIZE):
        for step, (ours, theirs) in enumerate(zip(fork[rank]["logs"], stock[rank]["logs"], strict=True), start=1):
            for key in keys:
                assert math.isclose(ours[key], theirs[key], rel_tol=RTOL, abs_tol=ATOL), (
                    f"rank {rank} step {step} {key}: fork {ours[key]!r}, stock {theirs[key]!r}\n"
                    f"fork: {fork[rank]['logs']}\nstock: {stock[rank]['logs']}")


def run_fork_and_stock(example, tmp_path, *args, loss_decreases=True, trl=False):
    fork = launch("accelerate", example, tmp_path / "fork", *args)
    stock = stock_reference(example, tmp_path, *args, trl=trl)
    assert_trained_with_the_fork(*fork, loss_decreases=loss_decreases)
    return fork[1], stock


@pytest.mark.stock_fails
def test_trl_dpo_with_a_peft_policy_and_no_reference_model_trains_as_on_stock(tmp_path):
    pytest.importorskip("trl")
    fork, stock = run_fork_and_stock("trl_dpo_lora.py", tmp_path, trl=True)
    for summary in fork.values():  # the first step compares the policy with itself (LoRA B = 0): log 2
        assert math.isclose(summary["losses"][0], math.log(2), rel_tol=1e-6), summary
    assert_same_logs(fork, stock, ["loss", "grad_norm", "rewards/chosen", "rewards/rejected"])


@pytest.mark.stock_fails
def test_trl_grpo_generating_between_steps_trains_as_on_stock(tmp_path):
    pytest.importorskip("trl")
    # GRPO's loss is a group-normalised advantage, about 0 at every step: it need not decrease.
    fork, stock = run_fork_and_stock("trl_grpo_lora.py", tmp_path, loss_decreases=False, trl=True)
    for summary in fork.values():
        assert all(log["grad_norm"] > 0 and log["completions/mean_length"] > 0 for log in summary["logs"]), summary
    # The rewards score completions sampled from the weights of each step: equal rewards, equal updates.
    assert_same_logs(fork, stock, ["loss", "grad_norm", "reward", "reward_std"])


@pytest.mark.stock_fails
def test_frozen_multihead_attention_tower_with_lora_behind_it_trains_as_on_stock(tmp_path):
    fork, stock = run_fork_and_stock("frozen_tower_lora.py", tmp_path)
    assert_same_logs(fork, stock, ["loss", "grad_norm"])
