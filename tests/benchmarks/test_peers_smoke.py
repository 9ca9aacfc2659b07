"""The peer benchmark's CPU mode runs end to end and writes its table, JSON and chart (a smoke test: no timings);
its paired rounds with an A/A copy too; its QLoRA workload too (slow)."""

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
    # Every system records its params' dtypes and what it computes in (fp32 everywhere on CPU).
    for run in runs.values():
        assert run["param_dtypes"] == {"trainable": {"float32": run["trainable_params"]},
                                       "frozen": {"float32": run["param_dtypes"]["frozen"]["float32"]}}, run
        assert run["compute_dtypes"] == {"adapter": "float32", "base": "float32"}, run
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 2
    readme = (tmp_path / "README.md").read_text()
    assert "benchmarks/peers.py --device cpu --systems plain,fork" in readme
    assert readme.count("| small | 1 | lora | nonreentrant |") == 2
    assert (tmp_path / "peers.png").stat().st_size > 0


def test_cpu_paired_rounds_alternate_blocks_and_check_an_aa_copy(tmp_path):
    command = [sys.executable, os.path.join(REPO, "benchmarks", "peers.py"), "--paired", "--device", "cpu",
               "--systems", "plain,fork", "--aa", "fork", "--modes", "lora", "--ac", "nonreentrant", "--rounds", "1",
               "--warmup", "1", "--steps", "4", "--block", "2", "--out", str(tmp_path)]
    subprocess.run(command, check=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"},
                   stdout=subprocess.DEVNULL)
    rows = {row["label"]: row for row in map(json.loads, (tmp_path / "runs.jsonl").read_text().splitlines())}
    assert sorted(rows) == ["fork", "fork#2", "plain"]
    for row in rows.values():
        assert not row["error"], row
        assert [len(block) for block in row["block_s"]] == [2, 2] and len(row["step_s"]) == 4
        assert row["cycle_orders"] == [["plain", "fork", "fork#2"], ["fork", "fork#2", "plain"]]
        assert row["compute_dtypes"] == {"adapter": "float32", "base": "float32"}
    assert rows["fork"]["fork_active"] is True and rows["fork#2"]["fork_active"] is True
    assert rows["fork#2"]["system"] == "fork" and "fork_active" not in rows["plain"]
    readme = (tmp_path / "README.md").read_text()
    assert "benchmarks/peers.py --paired --device cpu" in readme
    assert "| small w1 lora nonreentrant | fork / plain |" in readme
    assert "- A/A small w1 lora nonreentrant fork / fork#2: " in readme
    assert (tmp_path / "paired.png").stat().st_size > 0


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


def test_paired_rounds_alternate_every_step_on_a_gpu_and_every_five_on_a_cpu():
    """A GPU host's slow spells last a few steps: only steps taken one after the other share them
    (benchmarks/results/2026-12-05-1xh200-aa-block1: blocks of 1 pass the A/A check, blocks of 5 do not)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import peers
    finally:
        sys.path.remove(os.path.join(REPO, "benchmarks"))
    common = ["--paired", "--systems", "fork", "--out", "unused"]
    assert peers.parse(["--device", "cuda", *common]).block == 1
    assert peers.parse(["--device", "cpu", *common]).block == 5
    assert peers.parse(["--device", "cuda", "--block", "3", *common]).block == 3
