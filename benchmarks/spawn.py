"""Start the benchmarks' ranks with zero3_ac.utils.spawn: fresh processes, each rank's environment set from its start."""

import os

from zero3_ac.utils import spawn


def _run_worker(rank, queue, worker, world_size, args):
    worker(rank, world_size, int(os.environ["MASTER_PORT"]), args, queue)


def start_ranks(worker, nproc, args, env=None):
    """Run ``worker(rank, nproc, port, args, queue)`` in ``nproc`` processes; returns their
    :class:`zero3_ac.utils.spawn.Ranks` (close it to remove the run's shm buffers)."""
    device_env = {"DS_ACCELERATOR": "cpu"} if getattr(args, "device", "cpu") == "cpu" else {}
    return spawn.start_ranks(_run_worker, nproc, args=(worker, nproc, args), env={**device_env, **(env or {})})


def use_rank_device(rank, device):
    """In a rank process: its GPU (one per rank), on CUDA."""
    if device != "cpu":
        import torch
        torch.cuda.set_device(rank)
