"""Start one fresh interpreter per rank on a free local port, each with its environment from its start.

    with start_ranks(train_rank, 2, args=(steps,), env={"DS_ACCELERATOR": "cpu", "ZERO3_AC_DISABLE": "1"}) as ranks:
        ranks.join(timeout=300)
        reports = ranks.drain()

``train_rank(rank, queue, *args)`` runs in a ``spawn``-ed process whose environment, from interpreter
start-up on, holds ``env`` and what torch.distributed and DeepSpeed read (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): a ``.pth`` line, or any code that
runs before the target, sees the rank's settings (``ZERO3_AC_DISABLE`` decides stock or fork before
DeepSpeed is imported). Leaving the ``with`` block kills ranks still alive and removes the DeepSpeed
shared-memory buffers of the run's port (Note: [DeepSpeed's shm all-reduce buffers]).

Stdlib only: importing this module imports neither torch nor DeepSpeed.
"""

import contextlib
import glob
import multiprocessing
import os
import socket
import time

MASTER_ADDR = "127.0.0.1"
SHM_BUFFER_PREFIX = "/dev/shm/deepspeed_allreduce_buffer"
_ports_handed_out = []


def free_port(addr=MASTER_ADDR) -> int:
    """A TCP port that nothing listens on now (the OS's pick); remembered in :func:`ports_handed_out`."""
    with socket.socket() as sock:
        sock.bind((addr, 0))
        port = sock.getsockname()[1]
    _ports_handed_out.append(port)
    return port


def ports_handed_out() -> list:
    """Every port :func:`free_port` gave this process: the runs whose shm buffers are this process's to
    remove (a test session checks that none is left)."""
    return list(_ports_handed_out)


def rank_environment(rank, world_size, port, addr=MASTER_ADDR) -> dict:
    """The variables torch.distributed and DeepSpeed read in a rank of a single-host run."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                CROSS_RANK="0", CROSS_SIZE="1", MASTER_ADDR=addr, MASTER_PORT=str(port))


@contextlib.contextmanager
def environment(env):
    """``os.environ`` updated with ``env`` inside the block, restored after it."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def shm_buffers(port, addr=MASTER_ADDR, rank="*") -> list:
    """Note: [DeepSpeed's shm all-reduce buffers]

    DeepSpeed's CPU comm op (``ShareMemCommBuilder``, ``csrc/cpu/comm/shm.cpp``: ``shm_initialize``)
    creates one shared-memory segment per rank, about 66 MB, when every rank runs on one host
    (``LOCAL_SIZE`` equals the world size): ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``.
    Nothing unlinks it (``shared_close`` is never called), so every rank of every run leaves 66 MB
    in memory until the host reboots. The peers map each other's segments while the comm op starts,
    so a segment can be unlinked once every rank has started: by the rank itself at its exit
    (:func:`remove_own_shm_buffer`) or by whoever launched the ranks after they exited
    (:func:`remove_shm_buffers`). The name holds the uid, the address and the port, so removing by
    port removes only the run's own segments, not those of other runs on the host.
    """
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return glob.glob(f"{SHM_BUFFER_PREFIX}_{uid}_{addr}_{port}_{rank}")


def remove_shm_buffers(port, addr=MASTER_ADDR, rank="*") -> int:
    """Unlink the shm all-reduce buffers of the run on ``addr:port`` (Note: [DeepSpeed's shm all-reduce
    buffers]); returns how many there were."""
    removed = 0
    for path in shm_buffers(port, addr, rank):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
    return removed


def remove_own_shm_buffer() -> int:
    """In a rank at its exit: unlink the shm all-reduce buffer this rank created, named from its environment
    (Note: [DeepSpeed's shm all-reduce buffers]). A no-op outside a launched rank."""
    port, rank = os.environ.get("MASTER_PORT"), os.environ.get("RANK")
    if port is None or rank is None:
        return 0
    return remove_shm_buffers(port, os.environ.get("MASTER_ADDR", ""), rank)


def destroy_process_groups():
    """Note: [Process groups at interpreter exit]

    Neither DeepSpeed, the HF Trainer nor TRL destroys the process groups it uses (accelerate does in
    ``Accelerator.end_training()``, which the Trainer does not call), so a rank reached interpreter
    shutdown with its gloo groups alive and their C++ threads (``pt_gloo_runloop``,
    ``gloo_tcp_loop``) running. That is the state in which a rank that trained fine can abort at exit
    with ``terminate called without an active exception`` (SIGABRT): pytorch/pytorch#190489 reports
    it for gloo without ``destroy_process_group``, and pytorch/pytorch#179291 explains it by a gloo
    thread that frees a tensor of a collective, and so needs the GIL, while the interpreter
    finalizes. ``torch.distributed.destroy_process_group()`` alone is not enough: gloo's
    ``shutdown()`` is a no-op in torch 2.13 and a group's threads stop only when its last reference
    goes, and DeepSpeed keeps its own (``deepspeed.utils.groups._WORLD_GROUP``, a clone of the world
    group, among others). ``deepspeed.comm.destroy_process_group()`` releases them from DeepSpeed
    0.19.3 on (``groups._release_process_group_references``); before, this drops every group that
    ``deepspeed.utils.groups`` still holds. With the last references gone the groups' threads are
    joined before the interpreter finalizes, and the rank exits normally (atexit handlers run).
    Engines and trainers hold groups too: destroy after they are gone (their function returned).
    """
    import gc
    import sys
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None and getattr(comm, "cdb", None) is not None:
        comm.destroy_process_group()
    else:
        dist.destroy_process_group()
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and not hasattr(groups, "_release_process_group_references"):
        for name, value in list(vars(groups).items()):
            if isinstance(value, dist.ProcessGroup):
                setattr(groups, name, None)
            elif isinstance(value, dict):
                for key in [key for key, group in value.items() if isinstance(group, dist.ProcessGroup)]:
                    del value[key]
    gc.collect()  # engines' and optimizers' reference cycles that hold groups


def finish_rank():
    """At a rank's exit, training or failing: destroy the process groups (Note: [Process groups at
    interpreter exit]) and remove this rank's shm buffer (Note: [DeepSpeed's shm all-reduce buffers])."""
    try:
        destroy_process_groups()
    finally:
        remove_own_shm_buffer()


class Ranks:
    """The rank processes of one run, their result queue and their port."""

    def __init__(self, processes, queue, port):
        self.processes = processes
        self.queue = queue
        self.port = port

    def join(self, timeout=None) -> bool:
        """Wait up to ``timeout`` seconds in all (None: forever) for every rank to exit; True if all did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for process in self.processes:
            process.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(process.is_alive() for process in self.processes)

    @property
    def exit_codes(self) -> list:
        """Each rank's exit code (None while it runs; negative: killed by that signal)."""
        return [process.exitcode for process in self.processes]

    def drain(self) -> list:
        """Everything the ranks put in the queue so far."""
        items = []
        while not self.queue.empty():
            items.append(self.queue.get())
        return items

    def reports(self, timeout=None, poll_s=0.05):
        """Yield what the ranks put in the queue, as it comes, until every rank has exited; ranks still
        running after ``timeout`` seconds (None: no limit) are killed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(process.is_alive() for process in self.processes):
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                break
            if self.queue.empty():
                time.sleep(poll_s)
            else:
                yield self.queue.get()
        yield from self.drain()

    def close(self):
        """Kill the ranks still running and remove the run's shm all-reduce buffers."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join()
        remove_shm_buffers(self.port)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def start_ranks(target, world_size, args=(), env=None, port=None) -> Ranks:
    """Start ``target(rank, queue, *args)`` in ``world_size`` fresh (``spawn``-ed) processes whose environment
    holds ``env`` and the rank's variables (:func:`rank_environment`) from interpreter start-up on.

    ``target`` must be importable by the children (a module-level function; the main module is
    imported again in each of them, so keep its start-up under ``if __name__ == "__main__"``).
    """
    port = free_port() if port is None else port
    context = multiprocessing.get_context("spawn")
    queue = context.SimpleQueue()
    processes = []
    try:
        for rank in range(world_size):
            process = context.Process(target=target, args=(rank, queue, *args), daemon=True)
            # A spawned child starts a new interpreter with the parent's os.environ of this moment.
            with environment({**(env or {}), **rank_environment(rank, world_size, port)}):
                process.start()
            processes.append(process)
    except BaseException:
        Ranks(processes, queue, port).close()
        raise
    return Ranks(processes, queue, port)
