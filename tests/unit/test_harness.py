"""Tests of the CPU multi-rank harness itself (tests/unit/common.py)."""

import os

import pytest

from tests.unit.common import DistributedTestError, run_distributed


class CheckpointError(RuntimeError):
    """Stand-in for a project exception type."""


def _rank_and_env():
    import torch.distributed as dist
    return dist.get_rank(), dist.get_world_size(), int(os.environ["RANK"]), os.environ["DS_ACCELERATOR"]


def _rank():
    import deepspeed.comm as dist
    return dist.get_rank()


def _all_reduce(value):
    import torch
    import deepspeed.comm as dist
    t = torch.tensor([float(value * (dist.get_rank() + 1))])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank1(message):
    import torch
    import deepspeed.comm as dist
    if dist.get_rank() == 1:
        raise CheckpointError(message)
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 blocks here until the pool is killed
    return t.item()


def _pid():
    return os.getpid()


def _env(name):
    return os.environ.get(name)


def _sleep(seconds):
    import time
    time.sleep(seconds)


def _exit_on_rank0():
    import deepspeed.comm as dist
    if dist.get_rank() == 0:
        os._exit(3)
    return dist.get_rank()


def test_single_rank():
    assert run_distributed(1, _rank_and_env) == [(0, 1, 0, "cpu")]


def test_two_ranks():
    assert run_distributed(2, _rank_and_env) == [(0, 2, 0, "cpu"), (1, 2, 1, "cpu")]
    assert run_distributed(2, _rank) == [0, 1]


def test_all_reduce_two_ranks():
    # rank r contributes 5 * (r + 1): 5 + 10
    assert run_distributed(2, _all_reduce, 5) == [15.0, 15.0]
    assert run_distributed(2, _all_reduce, value=1) == [3.0, 3.0]


def test_pool_is_reused():
    first = run_distributed(2, _pid)
    assert run_distributed(2, _pid) == first


def test_exception_on_rank1_then_fresh_pool():
    before = run_distributed(2, _pid)
    with pytest.raises(DistributedTestError) as info:
        run_distributed(2, _fail_on_rank1, "bad shard 7")
    err = info.value
    msg = str(err)
    assert "CheckpointError" in msg
    assert "bad shard 7" in msg
    assert "Traceback (most recent call last)" in msg
    assert "_fail_on_rank1" in msg  # remote frame
    assert err.rank == 1 and err.exc_type == "CheckpointError"
    assert isinstance(err.remote_exception, CheckpointError)
    # the broken pool was discarded; the next call works on a fresh one
    assert run_distributed(2, _all_reduce, 1) == [3.0, 3.0]
    assert set(run_distributed(2, _pid)).isdisjoint(before)


def test_world_sizes_coexist():
    one = run_distributed(1, _pid)
    two = run_distributed(2, _pid)
    assert run_distributed(1, _pid) == one
    assert run_distributed(2, _pid) == two
    assert run_distributed(1, _rank) == [0]
    assert run_distributed(2, _all_reduce, 2) == [6.0, 6.0]


def test_env_reaches_workers():
    assert run_distributed(2, _env, "LOCAL_SIZE") == ["2", "2"]
    assert run_distributed(1, _env, "ZERO3_AC_DISABLE") == [os.environ.get("ZERO3_AC_DISABLE")]


def test_timeout_discards_pool():
    with pytest.raises(DistributedTestError, match="timed out"):
        run_distributed(2, _sleep, 60, timeout=2)
    assert run_distributed(2, _rank) == [0, 1]


def test_dead_worker():
    with pytest.raises(DistributedTestError, match="WorkerDied"):
        run_distributed(2, _exit_on_rank0)
    assert run_distributed(2, _rank) == [0, 1]


def test_unpicklable_argument_leaves_pool_intact():
    before = run_distributed(2, _pid)
    with pytest.raises(Exception):
        run_distributed(2, _env, lambda: None)
    assert run_distributed(2, _pid) == before


def test_a_pool_that_shuts_down_leaves_no_shm_buffers():
    from tests.unit import common
    from zero3_ac.utils import spawn
    assert run_distributed(2, _all_reduce, 1) == [3.0, 3.0]
    port = common._POOLS[2].port
    common.shutdown_pools()
    assert spawn.shm_buffers(port, common.MASTER_ADDR) == []
