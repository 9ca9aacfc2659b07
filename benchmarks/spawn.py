"""Start one spawned worker process per rank on a free local port; results come back through a queue."""

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
