"""``python -m zero3_ac doctor``: the report, the self-test's verdicts, and the exit code."""

import os
import subprocess
import sys

import pytest
from packaging.version import Version

from zero3_ac import doctor, self_test, version_guard
from zero3_ac.utils import spawn

STOCK_CRASHES = Version(version_guard.installed_deepspeed_version()) < Version("0.19.3")


def _doctor(**env):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-m", "zero3_ac", "doctor"], env=full_env, capture_output=True, text=True,
                          timeout=600)


def _passing_report(**changes):
    report = {"rank": 0, "stage": "train", "error": None, "fork_active": True, "engine_uses_fork": True,
              "losses": [0.5, 0.4], "params_left_gathered": 0, "frozen_backward_regathers": 0, "drained_params": 0,
              "exit_code": 0}
    return {**report, **changes}


def test_doctor_passes_with_the_fork():
    result = _doctor()
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("torch", "deepspeed", "transformers", "peft"):
        assert f"\n{name}: " in "\n" + result.stdout
    assert version_guard.SUPPORTED_RANGE in result.stdout
    assert "zero3_ac 0.1.0: active on deepspeed" in result.stdout
    assert "rank 0: ok" in result.stdout and "rank 1: ok" in result.stdout
    assert result.stdout.rstrip().endswith("self-test: PASS")


def test_doctor_fails_on_stock_deepspeed_and_says_the_fork_is_disabled():
    result = _doctor(ZERO3_AC_DISABLE="1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "disabled by ZERO3_AC_DISABLE=1" in result.stdout
    assert "self-test: FAIL" in result.stdout
    if STOCK_CRASHES:
        assert "training failed: torch.utils.checkpoint.CheckpointError" in result.stdout
    else:
        assert "the fork was not active" in result.stdout


def test_doctor_skips_the_self_test_and_fails_on_an_unsupported_deepspeed(monkeypatch, capsys):
    monkeypatch.delenv("ZERO3_AC_DISABLE", raising=False)
    monkeypatch.setattr(version_guard, "installed_deepspeed_version", lambda: "0.20.1")
    monkeypatch.setattr(self_test, "run", lambda: pytest.fail("the self-test must not run"))
    assert doctor.doctor() == 1
    out = capsys.readouterr().out
    assert "deepspeed: 0.20.1" in out and "0.20.1 is installed" in out and "self-test: skipped" in out


def test_a_passing_report_has_no_failures():
    assert self_test.failures(_passing_report()) == []


@pytest.mark.parametrize("changes, expected", [
    ({"stage": "setup", "error": "ImportError: no CPU op"}, "could not start DeepSpeed on CPU: ImportError"),
    ({"error": "CheckpointError: shape [N] vs [0]"}, "training failed: CheckpointError"),
    ({"fork_active": False}, "the fork was not active"),
    ({"engine_uses_fork": False}, "the fork was not active"),
    ({"losses": [0.5, float("nan")]}, "non-finite loss"),
    ({"params_left_gathered": 3}, "3 params left gathered"),
    ({"frozen_backward_regathers": 4}, "gathered again during backward 4 times"),
    ({"drained_params": 2}, "safety net"),
    ({"exit_code": -6}, "exited with code -6 after its report"),
])
def test_each_problem_fails_the_report_and_is_named(changes, expected):
    problems = self_test.failures(_passing_report(**changes))
    assert len(problems) == 1 and expected in problems[0], problems


def test_the_self_test_s_ranks_exit_normally_and_leave_no_shm_buffers():
    reports = self_test.run()
    assert [report["exit_code"] for report in reports] == [0, 0], reports
    assert spawn.shm_buffers(spawn.ports_handed_out()[-1]) == []
