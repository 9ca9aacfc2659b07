"""The peer benchmark's CPU mode runs end to end and writes its table, JSON and chart (a smoke test: no timings);
its QLoRA workload too (slow)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cpu_peer_benchmark_runs_plain_and_the_fork_and_writes_its_report(tmp_path):
    command = [sys.executable, os.path.join(REPO, "benchmarks", "peers.py"), "--device", "cpu", "--systems",
               "plain,fork", "--modes", "lora", "--ac", "nonreentrant", "--rounds", "1", "--warmup", "1", "--steps",
               "2", "--out", str(tmp_path)]
    subprocess.run(command, check=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"},
                   stdout=subprocess.DEVNULL)
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["complete"]
    runs = {run["system"]: run for run in document["runs"]}
    assert sorted(runs) == ["fork", "plain"]
    for run in runs.values():
        assert not run["error"], run
        assert len(run["step_s"]) == 2 and run["tokens_per_s"] > 0 and run["peak_mem_gib"] > 0
        assert run["module_calls_per_step"] > 0 and run["host_us_per_module_call"] is not None
    # The child ran the fork because ZERO3_AC_DISABLE was unset for it, and ZeRO-3 gathered the params.
    assert runs["fork"]["fork_active"] is True
    assert runs["fork"]["zero_gathered_gib_by_phase"]["forward"] > 0
    assert "fork_active" not in runs["plain"]
    readme = (tmp_path / "README.md").read_text()
    assert "benchmarks/peers.py --device cpu --systems plain,fork" in readme
    assert readme.count("| small | 1 | lora | nonreentrant |") == 2
    assert (tmp_path / "peers.png").stat().st_size > 0


@pytest.mark.slow
def test_cpu_peer_benchmark_runs_qlora_with_the_fork(tmp_path):
    pytest.importorskip("bitsandbytes", reason="--modes qlora needs bitsandbytes (requirements/requirements-dev.txt)")
    command = [sys.executable, os.path.join(REPO, "benchmarks", "peers.py"), "--device", "cpu", "--systems", "fork",
               "--modes", "qlora", "--ac", "nonreentrant", "--rounds", "1", "--warmup", "1", "--steps", "2", "--out",
               str(tmp_path)]
    subprocess.run(command, check=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"},
                   stdout=subprocess.DEVNULL)
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["complete"] and document["environment"]["bitsandbytes"]
    [run] = document["runs"]
    assert not run["error"] and run["mode"] == "qlora" and run["fork_active"] is True, run
    assert run["trainable_params"] > 0 and run["zero_gathered_gib_by_phase"]["forward"] > 0, run
