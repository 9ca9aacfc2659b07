"""Start one spawned worker process per rank on a free local port; results come back through a queue."""

import os
import socket

import torch


def start_ranks(worker, nproc, args):
    """Run ``worker(rank, nproc, port, args, queue)`` in ``nproc`` processes; returns (processes, queue)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = torch.multiprocessing.get_context("spawn")
    queue = context.SimpleQueue()
    processes = [context.Process(target=worker, args=(rank, nproc, port, args, queue)) for rank in range(nproc)]
    for process in processes:
        process.start()
    return processes, queue


def rank_environment(rank, world_size, port, device):
    """In a rank process: the variables torch.distributed and DeepSpeed read, and the rank's device."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    else:
        torch.cuda.set_device(rank)
