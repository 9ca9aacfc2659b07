"""``scripts/upstream_tests.py`` end to end on one small upstream file (config parsing, no ranks).

Needs a DeepSpeed source tree (``DEEPSPEED_SRC``: a checkout or a git directory); skipped without
one, since the PyPI sdist has no tests. The whole selection is run by hand (docs/stock-comparison.md).
"""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.environ.get("DEEPSPEED_SRC", "")


@pytest.mark.skipif(not os.path.exists(SOURCE), reason="no DeepSpeed source tree (set DEEPSPEED_SRC)")
def test_upstream_config_tests_pass_on_stock_and_on_the_fork(tmp_path):
    test = "unit/runtime/zero/test_zero_config.py"
    result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "upstream_tests.py"), "--source", SOURCE,
                             "--out-dir", str(tmp_path), test],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    row = next(line for line in result.stdout.splitlines() if line.startswith(f"| `{test}`"))
    cells = [cell.strip() for cell in row.strip("|").split("|")[1:]]
    assert len(cells) == 2 and cells[0] == cells[1] and cells[0].split(" / ")[1] == "0", row
    assert int(cells[0].split(" / ")[0]) > 0, row


def _load_script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("upstream_tests", os.path.join(REPO, "scripts", "upstream_tests.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_shm_buffers_of_upstreams_ranks_are_removed_after_each_file():
    """Upstream's harness leaves each rank's 66 MB all-reduce buffer behind; the script removes the ones its
    pytest process created or re-created, on upstream's ports only."""
    script = _load_script()
    uid = os.getuid()
    name = f"/dev/shm/deepspeed_allreduce_buffer_{uid}_127.0.0.1_{{port}}_0"
    kept_before, rewritten, created, other_port = (name.format(port=port) for port in (30498, 30499, 30497, 40999))
    for path in (kept_before, rewritten, other_port):
        with open(path, "wb") as handle:
            handle.write(b"x")
    try:
        before = script.upstream_shm_buffers()
        assert kept_before in before and other_port not in before
        for path in (rewritten, created, other_port):
            with open(path, "wb") as handle:
                handle.write(b"yy")
            os.utime(path, ns=(before.get(path, 0) + 10**9, before.get(path, 0) + 10**9))
        assert script.remove_new_shm_buffers(before) == 2
        assert [os.path.exists(path) for path in (kept_before, rewritten, created, other_port)] == [True, False, False, True]
    finally:
        for path in (kept_before, rewritten, created, other_port):
            if os.path.exists(path):
                os.unlink(path)
