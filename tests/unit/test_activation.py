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

# (module, class or None for a module-level name, name)
PATCHED = [("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "_register_deepspeed_module"),
           ("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "partition_all_parameters"),
           ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "initialize_ds_offload"),
           ("deepspeed.runtime.zero.parameter_offload", None, "register_external_parameter"),
           ("deepspeed.runtime.zero.partitioned_param_coordinator", None, "iter_params"),
           ("deepspeed.runtime.zero.parameter_offload", None, "iter_params"),
           ("deepspeed.accelerator.cuda_accelerator", "CUDA_Accelerator", "current_stream"),
           ("deepspeed.runtime.zero.partition_parameters", None, "print_rank_0"),
           ("deepspeed.runtime.zero.stage3", None, "print_rank_0"),
           ("deepspeed.utils.nvtx", None, "enable_nvtx")]


def _class_attrs():
    import importlib
    attrs = {}
    for module_name, class_name, name in PATCHED:
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


def _run_python(code, **env):
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", **env}
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("disable, expected", [("", "True"), ("1", "False")])
def test_importing_deepspeed_activates_the_fork_unless_disabled(disable, expected):
    result = _run_python("import deepspeed, zero3_ac; print(zero3_ac.is_active())", ZERO3_AC_DISABLE=disable)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == expected


@pytest.mark.parametrize("requested, expected", [("", "False"), ("1", "True")])
def test_deepspeeds_nvtx_ranges_are_off_under_the_fork_unless_requested(requested, expected):
    result = _run_python("import deepspeed, deepspeed.utils.nvtx as nvtx; print(nvtx.enable_nvtx)",
                         ZERO3_AC_DISABLE="", ZERO3_AC_NVTX=requested)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == expected


def test_a_find_spec_before_the_import_does_not_disarm_auto_activation():
    # transformers and accelerate look DeepSpeed up with importlib.util.find_spec before importing it.
    code = ("import importlib.util; importlib.util.find_spec('deepspeed'); importlib.util.find_spec('deepspeed'); "
            "import deepspeed, zero3_ac; print(zero3_ac.is_active())")
    result = _run_python(code, ZERO3_AC_DISABLE="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True"


def test_apply_is_idempotent_and_remove_restores_stock_exactly(restore_activation):
    zero3_ac.remove()
    stock = _class_attrs()
    zero3_ac.apply()
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
