"""The benchmark's CPU mode runs end to end (a smoke test: no timing assertions)."""

import json
import os
import subprocess
import sys

from packaging.version import Version

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cpu_benchmark_runs_every_configuration_and_the_fork_gathers_less(tmp_path):
    out = tmp_path / "bench.jsonl"
    command = [sys.executable, os.path.join(REPO, "benchmarks", "bench.py"), "--device", "cpu", "--no-full",
               "--warmup", "1", "--steps", "1", "--out", str(out)]
    subprocess.run(command, check=True, timeout=900, env={**os.environ, "DS_ACCELERATOR": "cpu"},
                   stdout=subprocess.DEVNULL)
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == 12
    by_key = {(r["impl"], r["ac"], r["strict"]): r for r in results}
    for (impl, ac, strict), result in by_key.items():
        if impl == "stock" and ac == "nonreentrant" and result["error"]:
            # Stock DeepSpeed before 0.19.3 crashes there: the bug this project fixes.
            assert result["error"].startswith("CheckpointError"), result
            assert Version(result["ds"]) < Version("0.19.3"), result
            continue
        assert not result["error"], result
    for strict in (False, True):
        stock, fork = by_key[("stock", "nonreentrant", strict)], by_key[("fork", "nonreentrant", strict)]
        if not stock["error"]:
            assert fork["allgather_gib_per_step"] <= stock["allgather_gib_per_step"]
        assert fork["fork_drained_params"] == 0 and fork["fork_swept_params"] == 0
