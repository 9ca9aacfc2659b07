"""Session-wide pytest configuration.

--stock    run against stock DeepSpeed: sets ZERO3_AC_DISABLE=1 for every worker
--runslow  also run tests marked @pytest.mark.slow

Worker pools (tests/unit/common.py) inherit the environment at pool creation,
so ZERO3_AC_DISABLE is set here, in pytest_configure, before any pool exists.
"""

import contextlib
import os
import sys

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("zero3_ac")
    group.addoption("--stock",
                    action="store_true",
                    default=False,
                    help="run against stock DeepSpeed: sets ZERO3_AC_DISABLE=1 for every worker")
    group.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: slow test, skipped unless --runslow is given")
    config.addinivalue_line(
        "markers", "stock_fails: documents that the test fails against stock DeepSpeed (--stock); no effect")
    if config.getoption("--stock"):
        os.environ["ZERO3_AC_DISABLE"] = "1"
    # Nothing is downloaded, nothing sent (TRL's trainers start a telemetry thread otherwise); set
    # before any worker pool exists, so that the workers inherit it.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip_slow = pytest.mark.skip(reason="slow: needs --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


def pytest_report_header(config):
    stock = os.environ.get("ZERO3_AC_DISABLE", "") not in ("", "0")
    return f"zero3_ac: {'STOCK DeepSpeed (ZERO3_AC_DISABLE=1)' if stock else 'patched'}"


def pytest_sessionfinish(session, exitstatus):
    common = sys.modules.get("tests.unit.common")
    if common is not None:
        common.shutdown_pools()
    check_no_shm_buffers_left(session)


def check_no_shm_buffers_left(session):
    """Fail the session if a run of it left DeepSpeed shm all-reduce buffers behind (Note: [DeepSpeed's shm
    all-reduce buffers] in zero3_ac/utils/spawn.py), and remove them.

    Only this session's runs are looked at: the ports that zero3_ac.utils.spawn.free_port handed out in
    this process (the harness's pools, the self-test, the demo, the launched examples). Other runs on
    the host (other sessions, other users) have other ports.
    """
    from zero3_ac.utils import spawn
    left = [path for port in sorted(set(spawn.ports_handed_out())) for path in spawn.shm_buffers(port)]
    if not left:
        return
    for path in left:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"zero3_ac: this session left {len(left)} DeepSpeed shm buffers behind (removed now): {left}"
    if reporter is not None:
        reporter.write_line(message, red=True)
    else:
        print(message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
