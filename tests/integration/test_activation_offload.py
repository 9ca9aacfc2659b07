"""TRL SFT with PEFT LoRA, ZeRO-3 and non-reentrant checkpointing under the real activation offloaders, on a GPU.

``examples/trl_sft_lora.py --offload-activations trl|deepspeed|transformers``
(examples/activation_offload.py) launched by ``accelerate launch`` on one GPU, with the fork and
``KeepNonReentrantCheckpointing``. Each must log what the same script logs without offloading, run
non-reentrant, leave nothing gathered, gather no frozen param twice in a backward and leave nothing
to the safety net; TRL's, run on stock DeepSpeed as TRL runs it (reentrant), must log the same too.

None of the three offloads on CPU: TRL's ``OffloadActivations`` reads
``torch.accelerator.current_accelerator().type`` and fails in ``SFTTrainer.__init__`` without an
accelerator; transformers' ``offload`` allocates pinned memory, which a CPU-only torch cannot;
DeepSpeed's skips every tensor of a synchronized device. The CPU tests of the fork under offloading
are tests/unit/integrations/test_trl_activation_offload.py.
"""

import importlib.util
import math
import os
import subprocess

import pytest
from packaging.version import Version

from tests.integration.test_examples import (ACCELERATE_CONFIG, EXAMPLES, REPO, TIMEOUT_S, _free_port, _output, _tool,
                                             assert_exited_cleanly, read_summaries)
from zero3_ac import version_guard

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None or not torch.cuda.is_available(),
    reason="needs trl and a GPU: on CPU TRL's activation offloading cannot be built (no accelerator), "
           "transformers' needs pinned memory and DeepSpeed's moves nothing (see the module docstring)")

STEPS = 4
# Offloading copies saved tensors to the host and back bit for bit, and reentrant and non-reentrant
# checkpointing compute the same ops in the same order: the runs agree to the last bit in practice.
RTOL = 1e-5
ATOL = 1e-6
DEEPSPEED_HAS_OFFLOAD = Version(version_guard.installed_deepspeed_version()) >= Version("0.19.8")


def launch_on_one_gpu(summary_dir, *args, **env):
    command = [_tool("accelerate"), "launch", "--config_file", ACCELERATE_CONFIG, "--num_processes", "1",
               "--main_process_port", str(_free_port()), os.path.join(EXAMPLES, "trl_sft_lora.py"),
               "--steps", str(STEPS), "--summary", str(summary_dir), *args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    result = subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert_exited_cleanly(result)
    summaries = read_summaries(summary_dir)
    assert list(summaries) == [0], _output(result)
    summary = summaries[0]
    assert summary["error"] is None and len(summary["logs"]) == STEPS, summary
    return summary


def assert_trained_with_the_fork(summary):
    assert summary["fork_active"] and summary["engine_uses_fork"] and summary["use_reentrant"] is False, summary
    assert [step["params_gathered_after_step"] for step in summary["steps"]] == [0] * STEPS, summary["steps"]
    assert [step["frozen_backward_regathers"] for step in summary["steps"]] == [0] * STEPS, summary["steps"]
    stats = summary["lifecycle_stats"]
    assert stats["total_drained_params"] == 0 and stats["total_swept_params"] == 0, stats


def assert_same_logs(ours, theirs):
    for step, (mine, other) in enumerate(zip(ours["logs"], theirs["logs"], strict=True), start=1):
        for key in ("loss", "grad_norm"):
            assert math.isclose(mine[key], other[key], rel_tol=RTOL, abs_tol=ATOL), (step, key, ours["logs"],
                                                                                    theirs["logs"])


@pytest.fixture(scope="module")
def without_offloading(tmp_path_factory):
    summary = launch_on_one_gpu(tmp_path_factory.mktemp("no-offload"))
    assert_trained_with_the_fork(summary)
    return summary


@pytest.mark.stock_fails
def test_trls_activation_offloading(tmp_path, without_offloading):
    summary = launch_on_one_gpu(tmp_path / "fork", "--offload-activations", "trl")
    assert_trained_with_the_fork(summary)
    assert all(log["offload/tensors"] > 0 for log in summary["logs"]), summary["logs"]
    assert_same_logs(summary, without_offloading)
    stock = launch_on_one_gpu(tmp_path / "stock", "--offload-activations", "trl", "--trl-default",
                              ZERO3_AC_DISABLE="1")
    assert not stock["engine_uses_fork"] and stock["use_reentrant"] is True, stock
    assert_same_logs(summary, stock)


@pytest.mark.stock_fails
@pytest.mark.skipif(not DEEPSPEED_HAS_OFFLOAD, reason="DeepSpeed's CheckpointHiddenStatesOffload is new in 0.19.8")
def test_deepspeeds_checkpoint_hidden_states_offload(tmp_path, without_offloading):
    summary = launch_on_one_gpu(tmp_path / "fork", "--offload-activations", "deepspeed")
    assert_trained_with_the_fork(summary)
    assert_same_logs(summary, without_offloading)


@pytest.mark.stock_fails
def test_transformers_checkpoint_offload(tmp_path, without_offloading):
    summary = launch_on_one_gpu(tmp_path / "fork", "--offload-activations", "transformers")
    assert_trained_with_the_fork(summary)
    assert_same_logs(summary, without_offloading)
