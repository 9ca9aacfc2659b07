"""The client examples, launched as users launch them (deepspeed / accelerate launch, 2 CPU ranks), for a few steps.

Each rank of an example writes a JSON summary (examples/lifecycle_probe.py); the tests read those.
With the fork: training completes, the loss is finite and decreasing, the fork ran in every rank, no
param was left gathered and no frozen param was gathered twice in a backward. Stock DeepSpeed on the
same script: releases before 0.19.3 crash with CheckpointError, later ones gather frozen params again.
"""

import glob
import json
import math
import os
import subprocess
import sys
import types

import pytest
from packaging.version import Version

from zero3_ac import version_guard
from zero3_ac.utils.spawn import free_port as _free_port
from zero3_ac.utils.spawn import remove_shm_buffers, shm_buffers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")
DS_CONFIG = os.path.join(EXAMPLES, "ds_config_zero3_tiny_model.json")
ACCELERATE_CONFIG = os.path.join(EXAMPLES, "accelerate_zero3.yaml")
WORLD_SIZE = 2
STEPS = 4
TIMEOUT_S = 600
STOCK_CRASHES = Version(version_guard.installed_deepspeed_version()) < Version("0.19.3")


def _tool(name):
    return os.path.join(os.path.dirname(sys.executable), name)


def _launch_command(launcher, script, port, ds_config):
    if launcher == "deepspeed":
        return [_tool("deepspeed"), "--num_gpus", str(WORLD_SIZE), "--master_port", str(port), script]
    return [_tool("accelerate"), "launch", "--config_file", ACCELERATE_CONFIG, "--deepspeed_config_file", ds_config,
            "--num_processes", str(WORLD_SIZE), "--main_process_port", str(port), script]


def launch(launcher, example, summary_dir, *args, ds_config=DS_CONFIG, **env):
    """Run ``examples/<example>`` under ``launcher`` on CPU with ``ds_config``; return (process, summaries by rank)."""
    port = _free_port()
    command = _launch_command(launcher, os.path.join(EXAMPLES, example), port, ds_config)
    command += ["--ddp-backend", "gloo", "--steps", str(STEPS), "--summary", str(summary_dir), *args]
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "LOCAL_SIZE": str(WORLD_SIZE),
                # nothing downloaded, nothing sent: TRL's trainers otherwise start a telemetry thread on rank 0
                "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    if launcher == "deepspeed":  # on CPU the Trainer takes the DeepSpeed config from accelerate's environment
        full_env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=ds_config)
    result = subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=TIMEOUT_S)
    result.shm_buffers_left = shm_buffers(port)
    remove_shm_buffers(port)  # a failing test leaves no 66 MB per rank either
    return result, read_summaries(summary_dir)


def read_summaries(summary_dir):
    """The ``rank<N>.json`` files an example's ranks wrote (examples/lifecycle_probe.py), by rank."""
    summaries = {}
    for path in glob.glob(os.path.join(summary_dir, "rank*.json")):
        with open(path) as summary:
            data = json.load(summary)
        summaries[data["rank"]] = data
    return summaries


def _output(result):
    return f"exit {result.returncode}\n--- stdout (tail)\n{result.stdout[-4000:]}\n--- stderr (tail)\n{result.stderr[-6000:]}"


def assert_exited_cleanly(result):
    """The launcher exits 0 only when every rank did; an abort at exit also leaves libstdc++'s line."""
    assert result.returncode == 0, _output(result)
    assert "terminate called" not in result.stderr, _output(result)
    assert_no_shm_buffers_left(result)


def assert_no_shm_buffers_left(result):
    """The ranks removed the DeepSpeed shm buffers they created (examples/clean_exit.py)."""
    assert result.shm_buffers_left == [], _output(result)


def assert_trained_with_the_fork(result, summaries, loss_decreases=True):
    assert_exited_cleanly(result)
    assert sorted(summaries) == list(range(WORLD_SIZE)), _output(result)
    for rank, summary in summaries.items():
        context = f"rank {rank}: {summary}"
        assert summary["error"] is None and summary["world_size"] == WORLD_SIZE, context
        assert summary["fork_active"] and summary["engine_uses_fork"], context
        assert summary["use_reentrant"] is False, context
        losses = summary["losses"]
        assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses), context
        assert losses[-1] < losses[0] or not loss_decreases, context
        assert [step["params_gathered_after_step"] for step in summary["steps"]] == [0] * STEPS, context
        assert [step["frozen_backward_regathers"] for step in summary["steps"]] == [0] * STEPS, context
        # Each decoder layer is a gather unit, and transformers checkpoints a layer's forward inside its hooks:
        # the unit's backward slot gathers before the recompute, which may then gather nothing itself.
        assert all(step["gathered_bytes"]["recompute"] + step["gathered_bytes"]["backward"] > 0
                   for step in summary["steps"]), context
        stats = summary["lifecycle_stats"]
        assert stats["total_drained_params"] == 0 and stats["total_swept_params"] == 0, context


@pytest.mark.stock_fails
def test_hf_trainer_lora_under_the_deepspeed_launcher(tmp_path):
    assert_trained_with_the_fork(*launch("deepspeed", "hf_trainer_lora.py", tmp_path))


@pytest.mark.slow
@pytest.mark.stock_fails
def test_hf_trainer_lora_under_accelerate_launch(tmp_path):
    assert_trained_with_the_fork(*launch("accelerate", "hf_trainer_lora.py", tmp_path))


@pytest.mark.stock_fails
def test_trl_sft_lora_keeps_non_reentrant_checkpointing_under_accelerate_launch(tmp_path):
    pytest.importorskip("trl")
    assert_trained_with_the_fork(*launch("accelerate", "trl_sft_lora.py", tmp_path))


def test_the_same_script_on_stock_deepspeed_crashes_or_gathers_frozen_params_again(tmp_path):
    result, summaries = launch("accelerate", "hf_trainer_lora.py", tmp_path, ZERO3_AC_DISABLE="1")
    assert sorted(summaries) == list(range(WORLD_SIZE)), _output(result)
    assert not any(summary["fork_active"] for summary in summaries.values())
    assert_no_shm_buffers_left(result)
    if STOCK_CRASHES:
        assert result.returncode != 0, _output(result)
        for summary in summaries.values():
            assert summary["error"].startswith("torch.utils.checkpoint.CheckpointError"), summary
    else:
        assert_exited_cleanly(result)
        assert not any(summary["engine_uses_fork"] for summary in summaries.values())


def test_an_example_refuses_a_trainer_that_sees_fewer_processes_than_were_launched(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    from hf_trainer_lora import check_world_size
    monkeypatch.setenv("WORLD_SIZE", str(WORLD_SIZE))
    with pytest.raises(SystemExit, match="--ddp-backend gloo.*ACCELERATE_USE_DEEPSPEED=true"):
        check_world_size(types.SimpleNamespace(world_size=1))
    check_world_size(types.SimpleNamespace(world_size=WORLD_SIZE))
