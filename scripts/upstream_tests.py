"""Run upstream DeepSpeed's own ZeRO tests on stock DeepSpeed and on the fork, and compare.

    .venv/ds-0.19.8/bin/python scripts/upstream_tests.py --source SRC [--rev REV] [--venv VENV] [--out-dir DIR]
                                     [--modes stock fork] [--doc docs/stock-comparison.md]
                                     [TEST ...] [-- PYTEST_ARGS ...]

SRC is a DeepSpeed source tree with ``tests/unit`` (a checkout, or an extracted release) or a git
directory (a bare mirror; ``--rev`` picks the commit, default HEAD; ``git archive`` extracts
``tests/``). The PyPI sdist of DeepSpeed ships no ``tests/``, so a source tree is needed; without
``--source`` the script reads ``$DEEPSPEED_SRC``. Use the tests of the release under test.

The tests are copied into a temporary directory and edited there for the CPU (nothing of upstream's
is committed here):

- ``unit/common.py``: the boolean-flag all-gather of ``allclose_on_all_ranks`` runs on
  ``current_device_name()`` with one-element tensors (``current_device()`` is an index on CPU, and
  gloo's all-gather needs a 1-d tensor);
- ``unit/v1/zero/test_zero_user_backward.py``: the DDP references get no ``device_ids`` on CPU.

TEST are paths relative to ``tests/`` (or node ids); the default is every file of ``unit/v1/zero/`` and
``unit/runtime/activation_checkpointing/``, and the files of ``unit/runtime/zero/``, ``unit/checkpoint/`` and
``unit/runtime/half_precision/`` that configure ZeRO stage 3. Tests parametrized over the
ZeRO stage (``zero_stage`` or ``stage``) run their stage-3 cases only (the fork changes ZeRO-3
engines only); ``--all-stages`` runs every case. Each TEST runs in its own pytest process, on stock
(``ZERO3_AC_DISABLE=1``) and then on the fork, with the python of ``--venv`` (default: the one running
this script) and this checkout's ``zero3_ac`` first on ``PYTHONPATH``; environment
``DS_ACCELERATOR=cpu LOCAL_SIZE=2 OMP_NUM_THREADS=1``, ``-p no:cacheprovider``, worker timeout
``DS_UNITTEST_TIMEOUT`` (default 300 s) and ``--file-timeout`` per process. JUnit XML goes to
``DIR/<mode>/<test>.xml``; ``--resume`` keeps the files already there, so a long run can be done in
chunks, and ``--report`` only makes the table of what is there. ``TORCH_EXTENSIONS_DIR`` defaults to ``.cache/torch_extensions/upstream-<venv name>``: venvs
at different paths must not share built ops.

The script prints the per-file table (passed / failed / skipped, stock vs fork) and the tests that
pass on stock and fail on the fork; with ``--doc`` it replaces the table between the
``upstream-tests`` markers of that file. Exit status 1 if any test passes on stock and fails on the
fork, except the ones in ``DOCUMENTED`` (a changed expectation, written where it names).
"""

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zero3_ac.utils import spawn  # noqa: E402  (stdlib only)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_VENV = sys.prefix
MODES = {"stock": {"ZERO3_AC_DISABLE": "1"}, "fork": {}}
STAGE3 = re.compile(r"stage3|[\"']stage[\"']\s*:\s*3|zero_stage\s*=\s*3|stage=3|Init\(")
# A pytest plugin written next to the copied tests: keeps only the ZeRO-3 cases of tests parametrized
# over the ZeRO stage (the fork changes ZeRO-3 engines only).
STAGE3_PLUGIN = """
def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        stages = [params[name] for name in ("zero_stage", "stage") if name in params]
        (drop if any(stage != 3 for stage in stages) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
"""
# Tests that pass on stock and fail on the fork by design, with where the changed expectation is written.
DOCUMENTED = {
    "unit.runtime.zero.test_zero_hook_attribute_delegation.TestHookAttributeDelegation::test": "docs/porting.md",
}
BEGIN, END = "<!-- upstream-tests:begin -->", "<!-- upstream-tests:end -->"


def extract(source, rev, dest):
    """Copy ``tests/`` of a source tree or a git directory into ``dest``; return ``dest/tests``."""
    if os.path.isdir(os.path.join(source, "tests", "unit")):
        shutil.copytree(os.path.join(source, "tests"), os.path.join(dest, "tests"), symlinks=True)
    else:
        # stderr: a mirror may lack blobs outside tests/ that git archive reports; the check below counts.
        archive = subprocess.Popen(["git", "--git-dir", source, "archive", rev, "tests"], stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL)
        subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, check=True)
        archive.wait()
        listed = subprocess.run(["git", "--git-dir", source, "ls-tree", "-r", "--name-only", rev, "tests/unit"],
                                capture_output=True, text=True, check=True).stdout.split()
        missing = [path for path in listed if not os.path.lexists(os.path.join(dest, path))]
        if missing:
            sys.exit(f"{source}: git archive left out {len(missing)} files of tests/unit, e.g. {missing[0]}")
    tests = os.path.join(dest, "tests")
    for needed in ("conftest.py", "pytest.ini", "unit/common.py", "unit/simple_model.py", "unit/util.py"):
        if not os.path.isfile(os.path.join(tests, needed)):
            sys.exit(f"{source}: tests/{needed} is missing")
    return tests


def edit(path, old, new, count=1):
    with open(path) as handle:
        text = handle.read()
    found = text.count(old)
    if found < count:
        sys.exit(f"{path}: expected {count} occurrences of {old!r} for the CPU edit, found {found}")
    with open(path, "w") as handle:
        handle.write(text.replace(old, new))


def patch_for_cpu(tests):
    common = os.path.join(tests, "unit", "common.py")
    edit(common, "device = get_accelerator().current_device()\n    tensor_flag = torch.tensor(1 if flag else 0,",
         "device = get_accelerator().current_device_name()\n    tensor_flag = torch.tensor([1 if flag else 0],")
    backward = os.path.join(tests, "unit", "v1", "zero", "test_zero_user_backward.py")
    if os.path.isfile(backward):
        cpu = "get_accelerator().device_name() == 'cpu'"
        edit(backward, "device_ids=[rank], output_device=rank",
             f"device_ids=None if {cpu} else [rank], output_device=None if {cpu} else rank", count=2)


# Folders of ``tests/`` whose every test file runs, and folders whose files run when they configure ZeRO stage 3.
WHOLE_FOLDERS = ("unit/v1/zero", "unit/runtime/activation_checkpointing")
STAGE3_FOLDERS = ("unit/runtime/zero", "unit/checkpoint", "unit/runtime/half_precision")


def default_selection(tests):
    selection = []
    for folder in WHOLE_FOLDERS + STAGE3_FOLDERS:
        path = os.path.join(tests, *folder.split("/"))
        for name in sorted(os.listdir(path)) if os.path.isdir(path) else ():
            if not (name.startswith("test_") and name.endswith(".py")):
                continue
            if folder in STAGE3_FOLDERS:
                with open(os.path.join(path, name)) as handle:
                    if not STAGE3.search(handle.read()):
                        continue
            selection.append(f"{folder}/{name}")
    return selection


def run(tests, venv, mode, test, junit, pytest_args, timeout, stage3_only):
    env = {
        **os.environ,
        **MODES[mode],
        "DS_ACCELERATOR": "cpu",
        "LOCAL_SIZE": "2",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "DS_UNITTEST_TIMEOUT": os.environ.get("DS_UNITTEST_TIMEOUT", "300"),
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions", "upstream-" + os.path.basename(venv))),
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
    }
    if mode != "stock":
        env.pop("ZERO3_AC_DISABLE", None)
    command = [os.path.join(venv, "bin", "python"), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE",
               f"--junitxml={junit}", *(["-p", "zero3_ac_stage3_only"] if stage3_only else []), test, *pytest_args]
    before = upstream_shm_buffers()
    try:
        return subprocess.run(command, cwd=tests, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"{mode} {test}: timed out after {timeout} s", flush=True)
        return None
    finally:
        remove_new_shm_buffers(before)


# Upstream's ``get_master_port`` (tests/unit/common.py) takes the first free port from 29500 on.
UPSTREAM_PORTS = range(29500, 30500)


def upstream_shm_buffers() -> dict:
    """DeepSpeed's shm all-reduce buffers named with upstream's test ports, and their modification times
    (Note: [DeepSpeed's shm all-reduce buffers] in zero3_ac/utils/spawn.py)."""
    buffers = {}
    for path in spawn.shm_buffers("*", addr="*"):
        port = path.rsplit("_", 2)[-2]
        if port.isdigit() and int(port) in UPSTREAM_PORTS:
            try:
                buffers[path] = os.stat(path).st_mtime_ns
            except FileNotFoundError:
                pass
    return buffers


def remove_new_shm_buffers(before: dict) -> int:
    """After one pytest process of upstream's tests: unlink the buffers its ranks created or re-created (upstream's
    harness leaves them, 66 MB per rank); returns how many."""
    removed = 0
    for path, mtime in upstream_shm_buffers().items():
        if before.get(path) != mtime:
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def outcomes(junit):
    """node id -> passed / failed / skipped."""
    results = {}
    if not os.path.isfile(junit):
        return results
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        node = f"{case.get('classname')}::{case.get('name')}"
        if case.find("skipped") is not None:
            results[node] = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            results[node] = "failed"
        else:
            results[node] = "passed"
    return results


def junit_path(out_dir, mode, test):
    return os.path.join(out_dir, mode, re.sub(r"[^\w.-]+", "_", test) + ".xml")


def table(selection, out_dir, modes):
    """Rows per file (node ids of one file are summed), and the node ids that pass on stock and fail on the fork."""
    files = list(dict.fromkeys(test.split("::")[0] for test in selection))
    counts = {mode: {name: None for name in files} for mode in modes}
    ran = {mode: collections.Counter() for mode in modes}
    per_test = {mode: {} for mode in modes}
    for mode in modes:
        for test in selection:
            results = outcomes(junit_path(out_dir, mode, test))
            if not results:
                continue
            per_test[mode].update(results)
            name = test.split("::")[0]
            ran[mode][name] += 1
            counts[mode][name] = (counts[mode][name] or collections.Counter()) + collections.Counter(results.values())
    asked = collections.Counter(test.split("::")[0] for test in selection)
    header = "| file | " + " | ".join(f"{mode} pass / fail / skip" for mode in modes) + " |"
    lines = [header, "|---|" + "---|" * len(modes)]
    totals = {mode: collections.Counter() for mode in modes}
    for name in files:
        cells = []
        for mode in modes:
            counter = counts[mode][name]
            if counter is None:
                cells.append("not run")
                continue
            totals[mode].update(counter)
            partial = f" ({ran[mode][name]} of {asked[name]} node ids)" if ran[mode][name] < asked[name] else ""
            cells.append(f"{counter['passed']} / {counter['failed']} / {counter['skipped']}{partial}")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines.append("| **total** | " + " | ".join(
        f"**{totals[m]['passed']} / {totals[m]['failed']} / {totals[m]['skipped']}**" for m in modes) + " |")
    regressions = []
    if {"stock", "fork"} <= set(modes):
        regressions = sorted(node for node, outcome in per_test["fork"].items()
                             if outcome == "failed" and per_test["stock"].get(node) == "passed")
    return "\n".join(lines), regressions


def write_doc(doc, body):
    with open(doc) as handle:
        text = handle.read()
    if BEGIN not in text or END not in text:
        sys.exit(f"{doc}: no {BEGIN} ... {END} markers to put the table between")
    head, rest = text.split(BEGIN, 1)
    with open(doc, "w") as handle:
        handle.write(head + BEGIN + "\n" + body + "\n" + END + rest.split(END, 1)[1])


def main():
    argv = sys.argv[1:]
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", nargs="*")
    parser.add_argument("--source", default=os.environ.get("DEEPSPEED_SRC"))
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--venv", default=DEFAULT_VENV)
    parser.add_argument("--out-dir", default=os.path.join(REPO, ".cache", "upstream-tests"))
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["stock", "fork"])
    parser.add_argument("--resume", action="store_true", help="keep JUnit files already in --out-dir")
    parser.add_argument("--file-timeout", type=int, default=3600, help="seconds per file and mode")
    parser.add_argument("--doc", help="markdown file whose upstream-tests table to replace")
    parser.add_argument("--list", action="store_true", help="print the selection and exit")
    parser.add_argument("--report", action="store_true", help="run nothing: the table of the JUnit files in --out-dir")
    parser.add_argument("--all-stages", action="store_true",
                        help="also run the ZeRO 0-2 cases of tests parametrized over the stage")
    args = parser.parse_args(argv)
    # Killed, still stop the running pytest and remove the temporary copy.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.source:
        parser.error("no DeepSpeed source: pass --source or set DEEPSPEED_SRC (the PyPI sdist has no tests/)")
    args.out_dir = os.path.abspath(args.out_dir)  # pytest runs in the temporary copy
    with tempfile.TemporaryDirectory(prefix="upstream-tests-") as tmp:
        tests = extract(os.path.abspath(args.source), args.rev, tmp)
        patch_for_cpu(tests)
        with open(os.path.join(tests, "zero3_ac_stage3_only.py"), "w") as handle:
            handle.write(STAGE3_PLUGIN)
        selection = args.tests or default_selection(tests)
        if args.list:
            print("\n".join(selection))
            return 0
        for mode in args.modes:
            os.makedirs(os.path.join(args.out_dir, mode), exist_ok=True)
        for test in [] if args.report else selection:
            for mode in args.modes:
                junit = junit_path(args.out_dir, mode, test)
                if args.resume and os.path.isfile(junit):
                    continue
                print(f"=== {mode} {test}", flush=True)
                run(tests, args.venv, mode, test, junit, pytest_args, args.file_timeout, not args.all_stages)
    body, regressions = table(selection, args.out_dir, args.modes)
    print(body)
    unexpected = [node for node in regressions if node not in DOCUMENTED]
    print("\npass on stock, fail on the fork:" + ("".join(f"\n  {node}" for node in unexpected) or " none"))
    for node in regressions:
        if node in DOCUMENTED:
            print(f"  (by design, see {DOCUMENTED[node]}: {node})")
    if args.doc:
        write_doc(args.doc, body)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
