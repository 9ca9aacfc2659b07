"""Interpreter start-up with the package installed: ``zero3_ac.pth`` imports nothing but the standard
library, and what a script sets before ``import deepspeed`` takes effect.

Every test runs the INSTALLED wheel (scripts/setup_env.sh reinstalls it) in a fresh interpreter
whose working directory is outside the checkout, with none of the package's settings inherited.
The start-up time itself is measured by ``benchmarks/startup_cost.py``, not here.
"""

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

HEAVY = ("torch", "deepspeed", "transformers", "zero3_ac")
SETTINGS = ("PYTHONPATH", "DS_ACCELERATOR", "ZERO3_AC_DISABLE", "ZERO3_AC_ALLOW_UNTESTED", "ZERO3_AC_NVTX")


def _python(cwd, *args, **env):
    full_env = {key: value for key, value in os.environ.items() if key not in SETTINGS}
    return subprocess.run([sys.executable, *args], cwd=cwd, env={**full_env, **env}, capture_output=True, text=True,
                          timeout=300)


def _last_line(result):
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def installed_pth(tmp_path_factory):
    """The installed ``zero3_ac.pth``, as a fresh interpreter outside the checkout finds it."""
    code = ("from importlib import metadata; import sys\n"
            "try: print(metadata.distribution('deepspeed-zero3-ac').locate_file('zero3_ac.pth'))\n"
            "except metadata.PackageNotFoundError: sys.exit('deepspeed-zero3-ac is not installed')")
    pth = Path(_last_line(_python(tmp_path_factory.mktemp("outside"), "-c", code)))
    assert pth.is_absolute() and pth.is_file(), (f"{pth} is missing: run scripts/setup_env.sh (an editable install "
                                                 "has no .pth)")
    return pth


def test_start_up_imports_neither_torch_nor_deepspeed_nor_the_package(tmp_path, installed_pth):
    code = f"import sys; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    result = _python(tmp_path, "-c", code)
    assert result.returncode == 0, result.stderr
    assert (result.stdout, result.stderr) == ("[]\n", "")


def test_the_pth_line_imports_only_the_standard_library_and_arms_the_hook(tmp_path, installed_pth):
    # The .pth line alone, in an interpreter without site (-I -S): which modules it adds.
    code = (f"import sys; sys.path.append({str(installed_pth.parent)!r}); before = set(sys.modules); "
            f"exec(open({str(installed_pth)!r}).read()); added = sorted(set(sys.modules) - before); "
            "finders = [type(finder).__name__ for finder in sys.meta_path]; "
            "import json; print(json.dumps([added, finders]))")
    added, finders = json.loads(_last_line(_python(tmp_path, "-I", "-S", "-c", code)))
    assert "_zero3_ac_autoload" in added
    outside_stdlib = [name for name in added if name.split(".")[0] not in sys.stdlib_module_names]
    assert outside_stdlib == ["_zero3_ac_autoload"], added
    assert "ApplyWhenDeepSpeedLoads" in finders


def test_find_spec_finds_deepspeed_without_importing_it(tmp_path, installed_pth):
    code = ("import importlib.util, sys; spec = importlib.util.find_spec('deepspeed'); "
            "print(spec.name, spec.submodule_search_locations is not None, "
            "sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    assert _last_line(_python(tmp_path, "-c", code)) == "deepspeed True []"


def test_ds_accelerator_set_by_the_script_before_importing_deepspeed_takes_effect(tmp_path, installed_pth):
    import torch
    wanted = "cpu" if torch.cuda.is_available() else "cuda"  # not what DeepSpeed would detect here
    code = (f"import os; os.environ['DS_ACCELERATOR'] = {wanted!r}; import deepspeed, zero3_ac; "
            "from deepspeed.accelerator import get_accelerator; print(get_accelerator().device_name())")
    assert _last_line(_python(tmp_path, "-c", code)) == wanted


def test_a_spawned_worker_gets_the_fork_from_the_pth(tmp_path, installed_pth):
    code = ("import multiprocessing as mp\n"
            "def child(queue):\n"
            "    import deepspeed, zero3_ac\n"
            "    queue.put(zero3_ac.is_active())\n"
            "if __name__ == '__main__':\n"
            "    context = mp.get_context('spawn'); queue = context.Queue()\n"
            "    process = context.Process(target=child, args=(queue,)); process.start()\n"
            "    print(queue.get(timeout=240)); process.join()\n")
    script = tmp_path / "spawn_worker.py"
    script.write_text(code)
    assert _last_line(_python(tmp_path, str(script), DS_ACCELERATOR="cpu")) == "True"


# Note [DeepSpeed imported by one of the package's modules] in _zero3_ac_autoload.py: the public name first,
# then a module of the package that imports DeepSpeed itself, each before ``import deepspeed``.
@pytest.mark.parametrize("first", ["import zero3_ac; zero3_ac.set_gather_units", "import zero3_ac.utils.timeline"])
def test_the_fork_applies_when_a_module_of_the_package_imports_deepspeed(tmp_path, installed_pth, first):
    code = f"{first}\nimport deepspeed, zero3_ac\nprint(zero3_ac.is_active())"
    result = _python(tmp_path, "-c", code, DS_ACCELERATOR="cpu")
    assert _last_line(result) == "True", result.stderr
    assert "could not apply" not in result.stderr


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_the_cli_answers_help_and_version_without_importing_torch_or_deepspeed(tmp_path, installed_pth, flag):
    result = _python(tmp_path, "-X", "importtime", "-m", "zero3_ac", flag)
    assert result.returncode == 0, result.stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line}
    assert not imported & {"torch", "deepspeed"}, sorted(imported & {"torch", "deepspeed"})
    if flag == "--version":
        assert result.stdout.strip() == (f"zero3-ac {metadata.version('deepspeed-zero3-ac')} "
                                         f"(deepspeed {metadata.version('deepspeed')})")
    else:
        assert "status" in result.stdout and "doctor" in result.stdout


def test_the_package_runs_from_site_packages_not_the_checkout(tmp_path, installed_pth):
    code = "import zero3_ac, _zero3_ac_autoload; print(zero3_ac.__file__, _zero3_ac_autoload.__file__)"
    for path in _last_line(_python(tmp_path, "-c", code)).split():
        assert Path(path).resolve().is_relative_to(installed_pth.parent.resolve()), path
