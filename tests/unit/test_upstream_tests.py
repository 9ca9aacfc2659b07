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
