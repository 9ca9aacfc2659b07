"""QLoRA (``examples/qlora_lora.py``: a 4-bit NF4 base loaded by transformers + bitsandbytes, LoRA on every
linear layer, HF Trainer) under ``accelerate launch`` on 2 CPU ranks, non-reentrant checkpointing.

With the fork it must train as the other examples do (tests/integration/test_examples.py: every rank
exits 0, nothing left gathered after a step, no frozen re-gather, nothing released by the safety net
at the end of a backward), log what stock DeepSpeed logs (the reference of
tests/integration/test_parity_with_stock.py: non-reentrant on 0.19.3+, reentrant before), and log
the losses of the same quantized model trained without ZeRO (DeepSpeed's ZeRO stage 0: plain data
parallel, gradients all-reduced, every param whole on every rank), on stock DeepSpeed.
The 4-bit weights must be ZeRO-3 params, partitioned across the ranks, their quantization state
whole on every rank (Note: [4-bit weights under ZeRO-3] in examples/qlora_lora.py).
"""

import json
import math

import pytest

from tests.integration.test_examples import (DS_CONFIG, STEPS, WORLD_SIZE, _output, assert_exited_cleanly,
                                             assert_trained_with_the_fork, launch)
from tests.integration.test_parity_with_stock import assert_same_logs, stock_reference

pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (requirements/requirements-dev.txt)")

EXAMPLE = "qlora_lora.py"
# The example's default model: 2 decoder layers of 7 linear layers, hidden size 64, MLP 128, 2 KV heads of 16.
LAYERS = 2
FOUR_BIT_WEIGHTS = 7 * LAYERS
FOUR_BIT_VALUES = LAYERS * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)
VALUES_PER_BF16 = 4  # four 4-bit values packed in each bf16 element of the storage
NF4_BLOCK = 64  # one absmax per block of 64 values
# ZeRO-3 against no ZeRO: the forward reads the same dequantized weights (the gathered packed bytes are
# the bytes every rank loaded, the quantization state is each rank's own, identical), and the gradient
# reduction of 2 ranks is one fp32 addition either way. Measured: bit-identical losses on 0.18.5 and
# 0.19.8. The tolerance leaves room for a reduction or a clipping norm summed in another order over 4 AdamW
# steps (lr 1e-2), about 1e-7 relative, not for a wrong weight: the bf16 checkpoint and the 4-bit rounding
# alone move the first loss by 6e-4 relative (4.8366 for the same init unquantized, hf_trainer_lora.py; 4.8393).
NO_ZERO_RTOL = 1e-5
NO_ZERO_ATOL = 1e-6


@pytest.fixture(scope="module")
def fork_run(tmp_path_factory):
    """The example with the fork, launched once for the module's tests."""
    return launch("accelerate", EXAMPLE, tmp_path_factory.mktemp("qlora") / "fork")


def assert_four_bit_weights_partitioned(summaries):
    """Every Params4bit is a ZeRO-3 param, its packed storage split evenly, its quant_state whole on each rank."""
    for rank, summary in summaries.items():
        expected = {
            "count": FOUR_BIT_WEIGHTS,
            "zero_params": FOUR_BIT_WEIGHTS,
            "trainable": 0,
            "with_quant_state": FOUR_BIT_WEIGHTS,
            "storage_dtypes": ["torch.bfloat16"],
            "packed_elements": FOUR_BIT_VALUES // VALUES_PER_BF16,
            "partition_elements": FOUR_BIT_VALUES // VALUES_PER_BF16 // WORLD_SIZE,
            "partitioned_evenly": FOUR_BIT_WEIGHTS,
            "quant_state_absmax_elements": FOUR_BIT_VALUES // NF4_BLOCK,
        }
        assert summary["quantized_weights"] == expected, f"rank {rank}: {summary}"


def zero0_config(directory):
    """examples/ds_config_zero3_tiny_model.json with ZeRO disabled (stage 0), written to ``directory``."""
    with open(DS_CONFIG) as source:
        config = json.load(source)
    config["zero_optimization"] = {"stage": 0}
    path = directory / "ds_config_zero0.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.stock_fails
def test_qlora_trains_with_the_fork_and_partitions_the_4bit_weights(fork_run):
    result, summaries = fork_run
    assert_trained_with_the_fork(result, summaries)
    assert_four_bit_weights_partitioned(summaries)


@pytest.mark.stock_fails
def test_qlora_logs_what_stock_deepspeed_logs(fork_run, tmp_path):
    stock = stock_reference(EXAMPLE, tmp_path)
    assert_four_bit_weights_partitioned(stock)  # DeepSpeed's own conversion, not the fork's
    assert_trained_with_the_fork(*fork_run)
    assert_same_logs(fork_run[1], stock, ["loss", "grad_norm"])


@pytest.mark.stock_fails
def test_qlora_under_zero3_logs_the_losses_of_the_same_model_without_zero(fork_run, tmp_path):
    result, reference = launch("accelerate", EXAMPLE, tmp_path / "no_zero", ds_config=zero0_config(tmp_path),
                               ZERO3_AC_DISABLE="1")
    assert_exited_cleanly(result)
    assert sorted(reference) == list(range(WORLD_SIZE)), _output(result)
    for rank, summary in reference.items():
        context = f"no-ZeRO rank {rank}: {summary}"
        assert summary["error"] is None and summary["zero_stage"] == 0 and summary["use_reentrant"] is False, context
        assert summary["quantized_weights"]["zero_params"] == 0, context
        assert len(summary["losses"]) == STEPS, context
    assert_trained_with_the_fork(*fork_run)
    fork = fork_run[1]
    for rank in range(WORLD_SIZE):  # DeepSpeed logs no grad norm at stage 0 in fp32: the losses only
        for step, (ours, theirs) in enumerate(zip(fork[rank]["losses"], reference[rank]["losses"], strict=True), 1):
            assert math.isclose(ours, theirs, rel_tol=NO_ZERO_RTOL, abs_tol=NO_ZERO_ATOL), (
                f"rank {rank} step {step}: ZeRO-3 {ours!r}, no ZeRO {theirs!r}\n"
                f"ZeRO-3: {fork[rank]['losses']}\nno ZeRO: {reference[rank]['losses']}")
