"""Installing and removing the fork: auto-activation, apply/remove, the version guard."""

import os
import re
import subprocess
import sys

import deepspeed  # noqa: F401  (importing it auto-activates the fork; do it before any remove())
import pytest

import zero3_ac
from tests.unit.common import run_distributed
from zero3_ac import activation, version_guard
from zero3_ac.runtime.zero.partition_parameters import coalesced_gather_waits_for_last_only

# (module, class or None for a module-level name, name): what apply() patches
PATCHED = [("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "_register_deepspeed_module"),
           ("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "partition_all_parameters"),
           ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "initialize_ds_offload"),
           ("deepspeed.runtime.zero.parameter_offload", None, "register_external_parameter"),
           ("deepspeed.runtime.zero.partitioned_param_coordinator", None, "iter_params"),
           ("deepspeed.runtime.zero.parameter_offload", None, "iter_params"),
           ("deepspeed.runtime.zero.partition_parameters", None, "print_rank_0"),
           ("deepspeed.runtime.zero.stage3", None, "print_rank_0"),
           ("deepspeed.runtime.zero.stage3", None, "reduce_scatter_coalesced"),
           ("deepspeed.runtime.zero.partition_parameters", "AllGatherCoalescedHandle", "wait"),
           *([("deepspeed.runtime.zero.partition_parameters", "Init", "_allgather_params_coalesced")]
             if coalesced_gather_waits_for_last_only() else [])]
# what the first ZeRO-3 engine under the fork changes for the whole process (docs/side-effects.md)
PROCESS_WIDE = [("deepspeed.accelerator.cuda_accelerator", "CUDA_Accelerator", "current_stream"),
                ("deepspeed.utils.nvtx", None, "enable_nvtx")]


def _class_attrs(names=PATCHED):
    import importlib
    attrs = {}
    for module_name, class_name, name in names:
        module = importlib.import_module(module_name)
        owner = getattr(module, class_name) if class_name else module
        attrs[(module_name, class_name, name)] = owner.__dict__[name]
    return attrs


@pytest.fixture
def restore_activation():
    was_active = zero3_ac.is_active()
    yield
    zero3_ac.remove()
    if was_active:
        zero3_ac.apply()


def _run_python(cwd, code, **env):
    """``code`` in a fresh interpreter outside the checkout (the installed package), none of its settings inherited."""
    settings = ("PYTHONPATH", activation.DISABLE_ENV, version_guard.ALLOW_UNTESTED_ENV, "ZERO3_AC_NVTX")
    full_env = {key: value for key, value in os.environ.items() if key not in settings}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env={**full_env, "DS_ACCELERATOR": "cpu", **env},
                          capture_output=True, text=True, timeout=300)


def _last_line(result):
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("disable, expected", [("", "True"), ("1", "False")])
def test_importing_deepspeed_activates_the_fork_unless_disabled(tmp_path, disable, expected):
    result = _run_python(tmp_path, "import deepspeed, zero3_ac; print(zero3_ac.is_active())", ZERO3_AC_DISABLE=disable)
    assert _last_line(result) == expected


@pytest.mark.parametrize("disable, expected", [("0", "True"), ("1", "False")])
def test_disabling_in_the_script_before_importing_deepspeed_takes_effect(tmp_path, disable, expected):
    code = (f"import os; os.environ['ZERO3_AC_DISABLE'] = {disable!r}; "
            "import deepspeed, zero3_ac; print(zero3_ac.is_active())")
    assert _last_line(_run_python(tmp_path, code)) == expected


def test_a_find_spec_before_the_import_does_not_disarm_auto_activation(tmp_path):
    # transformers and accelerate look DeepSpeed up with importlib.util.find_spec before importing it.
    code = ("import importlib.util; importlib.util.find_spec('deepspeed'); importlib.util.find_spec('deepspeed'); "
            "import deepspeed, zero3_ac; print(zero3_ac.is_active())")
    assert _last_line(_run_python(tmp_path, code)) == "True"


def test_apply_is_idempotent_and_remove_restores_stock_exactly(restore_activation):
    zero3_ac.remove()
    stock = _class_attrs()
    process_wide = _class_attrs(PROCESS_WIDE)
    zero3_ac.apply()
    assert _class_attrs(PROCESS_WIDE) == process_wide  # until a ZeRO-3 engine exists
    patched = _class_attrs()
    zero3_ac.apply()
    assert zero3_ac.is_active()
    assert _class_attrs() == patched
    assert all(patched[key] is not stock[key] for key in stock)
    zero3_ac.remove()
    assert not zero3_ac.is_active()
    assert all(_class_attrs()[key] is stock[key] for key in stock)


def test_apply_names_installed_and_supported_versions_when_unsupported(restore_activation, monkeypatch):
    zero3_ac.remove()
    monkeypatch.setattr(version_guard, "installed_deepspeed_version", lambda: "0.18.0")
    with pytest.raises(version_guard.UnsupportedDeepSpeedVersion,
                       match=r"0\.18\.0 .*" + re.escape(version_guard.SUPPORTED_RANGE)):
        zero3_ac.apply()
    assert not zero3_ac.is_active()


def test_auto_activation_warns_once_and_changes_nothing_when_unsupported(restore_activation, monkeypatch):
    from deepspeed.utils import logger
    zero3_ac.remove()
    stock = _class_attrs()
    warnings = []
    monkeypatch.delenv(activation.DISABLE_ENV, raising=False)
    monkeypatch.setattr(version_guard, "installed_deepspeed_version", lambda: "0.20.1")
    monkeypatch.setattr(logger, "warning", lambda message, *args, **kwargs: warnings.append(message))
    activation.auto_apply()
    assert len(warnings) == 1 and "0.20.1" in warnings[0] and version_guard.SUPPORTED_RANGE in warnings[0]
    assert not zero3_ac.is_active()
    assert _class_attrs() == stock


def test_an_untested_release_is_applied_with_a_loud_warning_when_allowed(restore_activation, monkeypatch):
    from deepspeed.utils import logger
    zero3_ac.remove()
    warnings = []
    monkeypatch.delenv(activation.DISABLE_ENV, raising=False)
    monkeypatch.setenv(version_guard.ALLOW_UNTESTED_ENV, "1")
    monkeypatch.setattr(version_guard, "installed_deepspeed_version", lambda: "0.20.1")
    monkeypatch.setattr(logger, "warning", lambda message, *args, **kwargs: warnings.append(message))
    activation.auto_apply()
    assert zero3_ac.is_active()
    assert len(warnings) == 1 and "0.20.1" in warnings[0] and "NOT tested" in warnings[0], warnings


def test_allowing_untested_releases_still_refuses_older_ones(restore_activation, monkeypatch):
    zero3_ac.remove()
    monkeypatch.setenv(version_guard.ALLOW_UNTESTED_ENV, "1")
    monkeypatch.setattr(version_guard, "installed_deepspeed_version", lambda: "0.18.3")
    with pytest.raises(version_guard.UnsupportedDeepSpeedVersion, match="fixed in 0.18.5") as refused:
        zero3_ac.apply()
    assert version_guard.ALLOW_UNTESTED_ENV not in str(refused.value)
    assert not zero3_ac.is_active()


def process_wide_changes_case(nvtx_requested):
    from deepspeed.utils import nvtx as stock_nvtx
    from tests.unit.runtime.zero.zero_case import CheckpointedStack, make_engine, zero_config
    from zero3_ac.utils import module_tree
    if activation.disabled_by_env():
        return "skipped"
    zero3_ac.remove()
    stock = _class_attrs(PROCESS_WIDE)
    requested = os.environ.get("ZERO3_AC_NVTX")
    os.environ["ZERO3_AC_NVTX"] = "1" if nvtx_requested else "0"
    seen = {}
    try:
        zero3_ac.apply()
        for stage in (0, 1, 2, 3):
            engine = make_engine(CheckpointedStack(use_reentrant=False), zero_config(stage))
            current_stream_is_stock = _class_attrs(PROCESS_WIDE[:1]) == {PROCESS_WIDE[0]: stock[PROCESS_WIDE[0]]}
            seen[stage] = [stock_nvtx.enable_nvtx, current_stream_is_stock, module_tree.generation() is not None]
            engine.destroy()
        zero3_ac.remove()
        seen["removed"] = _class_attrs(PROCESS_WIDE) == stock and module_tree.generation() is None
    finally:
        os.environ.pop("ZERO3_AC_NVTX")
        if requested is not None:
            os.environ["ZERO3_AC_NVTX"] = requested
        zero3_ac.remove()
        zero3_ac.apply()
    return seen


@pytest.mark.parametrize("nvtx_requested", [False, True])
def test_process_wide_changes_wait_for_a_zero3_engine(nvtx_requested):
    # [nvtx ranges on, stock current_stream, torch's module registration uncounted] per engine created in turn
    [seen] = run_distributed(1, process_wide_changes_case, nvtx_requested)
    if seen == "skipped":
        pytest.skip("the fork is disabled (--stock)")
    untouched = [True, True, False]
    assert seen == {0: untouched, 1: untouched, 2: untouched, 3: [nvtx_requested, False, True], "removed": True}


def apply_after_engine_case():
    import torch
    from tests.unit.runtime.zero.zero_case import CheckpointedStack, make_engine, micro_batches, zero_config
    from deepspeed.utils import logger
    if activation.disabled_by_env():
        return "skipped"
    zero3_ac.remove()
    stock_engine = make_engine(CheckpointedStack(use_reentrant=True), zero_config(3))
    warnings = []
    original_warning = logger.warning
    logger.warning = lambda message, *args, **kwargs: warnings.append(message)
    try:
        zero3_ac.apply()
    finally:
        logger.warning = original_warning
    assert any("engines created from now on" in message for message in warnings), warnings
    fork_engine = make_engine(CheckpointedStack(use_reentrant=True), zero_config(3))
    assert zero3_ac.lifecycle_stats(stock_engine) is None
    assert zero3_ac.lifecycle_stats(fork_engine) is not None
    x = micro_batches(1, 1, requires_grad=True)[0][0]
    for engine in (stock_engine, fork_engine):
        engine(x).backward()
        engine.step()
        engine.destroy()
    return "ok"


def test_apply_after_an_engine_exists_covers_later_engines_and_says_so():
    assert run_distributed(1, apply_after_engine_case) in (["ok"], ["skipped"])
