"""Paired rounds (``peers.py --paired``): the systems of one configuration alive side by side, measured in
alternating blocks, so that a ratio of two systems compares steps taken seconds apart.

A round starts one fresh set of rank processes per system (one more of the ``--aa`` system, labelled
``SYSTEM#2``, for the A/A check), builds and warms every one up, then runs ``ceil(steps / block)`` cycles:
in each cycle every system in turn runs ``--block`` steps while the others wait (the order rotates by one
every cycle, so no system always follows the same one). A cycle pairs each two systems: the ratio of
their block medians. The host's speed drifts between and within calls; inside one cycle it barely
moves. Rounds repeat with fresh processes until ``--rounds`` or ``--budget-s``. Rows go to runs.jsonl
(one per system per round); paired_report.py writes README.md and paired.png from them.

The systems' processes start in an order that rotates by one every round, so that no system is always the
last to start. With ``--pin-cores`` each rank process of a round runs on cores of its own (the host's cores
split evenly between them, ``os.sched_setaffinity``, and as many torch threads), so that no system's host
thread shares a core with another process's threads; the cores each process got are in its row.
"""

import argparse
import glob
import json
import math
import os
import socket
import statistics
import sys
import time
import warnings

import torch

from dtypes import ComputeDtypes, param_dtypes
from peer_worker import FORK_INSTALLED, PeakMemory, init_process_group, setup
from spawn import use_rank_device
from workload import MODELS
from zero3_ac.utils import spawn as rank_spawn

AA_SUFFIX = "#2"


def system_of(label):
    """The system a label runs: ``fork#2`` (the A/A copy) runs ``fork``."""
    return label.split("#", 1)[0]


def _error_text(exc):
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def serve(rank, world_size, port, args, connection, cores=None):
    """One rank of one system: set up, warm up, say ready, then run the blocks of steps it is sent."""
    if cores:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    os.environ.update(rank_spawn.rank_environment(rank, world_size, port))
    if args.device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    use_rank_device(rank, args.device)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    try:
        init_process_group(args, rank, world_size)
        device_name = f"cuda:{rank}" if args.device == "cuda" else "cpu"
        step, engine, trainable, model = setup(args, args.system, world_size, device_name)
        compute = ComputeDtypes(model)
        generator = torch.Generator().manual_seed(1234 + rank)
        vocab = MODELS[args.model]["vocab_size"]

        def timed_step():
            ids = torch.randint(0, vocab, (args.mbs, args.seq), generator=generator).to(device_name)
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = step(ids)
            if args.device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start, loss

        for _ in range(max(args.warmup, 1)):
            _, loss = timed_step()
        info = dict(param_dtypes=param_dtypes(model), compute_dtypes=compute.take(), trainable_params=trainable,
                    cores=sorted(os.sched_getaffinity(0)) if cores else None)
        if engine is not None:
            import zero3_ac
            info.update(fork_active=zero3_ac.is_active(), fork_path=os.path.dirname(os.path.abspath(zero3_ac.__file__)))
        peak = PeakMemory(args.device)
        peak.reset()
        connection.send(("ready", info))
        while True:
            command, count = connection.recv()
            if command == "stop":
                break
            times = []
            for _ in range(count):
                elapsed, loss = timed_step()
                times.append(elapsed)
            connection.send(("times", times))
        connection.send(("done", dict(peak_mem_gib=peak.peak_gib(), peak_mem_kind=peak.kind,
                                      last_loss=float(loss.item()))))
    except Exception as exc:
        connection.send(("error", _error_text(exc)))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        rank_spawn.remove_own_shm_buffer()


class System:
    """The rank processes of one system in one round, and the pipe to each."""

    def __init__(self, label, args, world, cores=None):
        """``cores``: one list of cores per rank, or None (the processes may run anywhere)."""
        self.label = label
        self.error = None
        self.info = {}
        self.done = {}
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        child = _with(args, system=system_of(label))
        context = torch.multiprocessing.get_context("spawn")
        saved = os.environ.get("ZERO3_AC_DISABLE")
        os.environ["ZERO3_AC_DISABLE"] = "0" if child.system in FORK_INSTALLED else "1"
        # --aa-path: a spawned child starts with this process's sys.path as it is at start(), and imports zero3_ac
        # only after that (unpickling its target, or at `import deepspeed`): the first zero3_ac on that path.
        other_version = getattr(args, "aa_path", None) if label.endswith(AA_SUFFIX) else None
        if other_version:
            sys.path.insert(0, other_version)
        try:
            self.connections, self.processes = [], []
            for rank in range(world):
                ours, theirs = context.Pipe()
                process = context.Process(target=serve,
                                          args=(rank, world, self.port, child, theirs, cores[rank] if cores else None))
                process.start()
                self.connections.append(ours)
                self.processes.append(process)
        finally:
            if other_version:
                sys.path.remove(other_version)
            if saved is None:
                os.environ.pop("ZERO3_AC_DISABLE")
            else:
                os.environ["ZERO3_AC_DISABLE"] = saved

    def receive(self, expected, timeout_s):
        """Every rank's answer of kind ``expected`` (rank order), or None after recording the error."""
        deadline = time.monotonic() + timeout_s
        answers = []
        for rank, connection in enumerate(self.connections):
            try:
                if not connection.poll(max(0.0, deadline - time.monotonic())):
                    self.error = self.error or f"rank {rank} timed out after {timeout_s:.0f} s waiting for {expected}"
                    return None
                kind, value = connection.recv()
            except (EOFError, OSError):
                self.error = self.error or f"rank {rank} died"
                return None
            if kind == "error":
                self.error = self.error or value
                return None
            answers.append(value)
        return answers

    def send(self, command, count=0):
        for connection in self.connections:
            try:
                connection.send((command, count))
            except (BrokenPipeError, OSError):
                self.error = self.error or "a rank died"

    def finish(self, timeout_s):
        if not self.error:
            self.send("stop")
            answers = self.receive("done", timeout_s)
            if answers:
                self.done = dict(answers[0], peak_mem_gib=max(answer["peak_mem_gib"] for answer in answers))
        for process in self.processes:
            process.join(timeout_s if not self.error else 5)
            if process.is_alive():
                process.kill()
                process.join()
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{self.port}_*"):
            os.remove(path)


def _with(args, **changes):
    return argparse.Namespace(**{**vars(args), **changes})


def run_round(args, round_index, world, mode, ac, labels):
    """One round of one configuration: every label's processes at once, blocks in rotating order.
    Returns one row per label."""
    configured = _with(args, mode=mode, ac=ac)
    cores = core_sets(len(labels) * world) if getattr(args, "pin_cores", False) else None
    started_order = start_order(labels, round_index)
    by_label = {label: System(label, configured, world, cores and cores[index * world:(index + 1) * world])
                for index, label in enumerate(started_order)}
    systems = [by_label[label] for label in labels]
    started = time.monotonic()
    for system in systems:
        answers = system.receive("ready", args.timeout_s - (time.monotonic() - started))
        if answers:
            system.info = answers[0]
    blocks = {system.label: [] for system in systems}
    orders = []
    cycles = math.ceil(args.steps / args.block)
    for cycle in range(cycles):
        live = [system for system in systems if not system.error]
        if len(live) < 2:
            break
        shift = cycle % len(live)
        order = live[shift:] + live[:shift]
        orders.append([system.label for system in order])
        for system in order:
            count = min(args.block, args.steps - cycle * args.block)
            system.send("steps", count)
            answers = system.receive("times", args.timeout_s)
            blocks[system.label].append(answers[0] if answers else None)
    for system in systems:
        system.finish(args.timeout_s)
    rows = []
    for system in systems:
        steps = [t for block in blocks[system.label] if block for t in block]
        row = dict(round=round_index, label=system.label, system=system_of(system.label), world=world, mode=mode,
                   ac=ac, shape=args.shape, model=args.model, seq=args.seq, mbs=args.mbs, device=args.device,
                   warmup=args.warmup, block=args.block, error=system.error, block_s=blocks[system.label],
                   cycle_orders=orders, started_order=started_order, step_s=steps, **system.info, **system.done)
        if steps and not system.error:
            median = statistics.median(steps)
            row.update(step_s_median=median, tokens_per_s=world * args.mbs * args.seq / median)
        rows.append(row)
    return rows


def start_order(labels, round_index):
    """The order in which round ``round_index`` starts the systems' processes: ``labels`` rotated by one a round."""
    start = round_index % len(labels)
    return labels[start:] + labels[:start]


def core_sets(processes):
    """The cores this process may use, split into ``processes`` equal runs of consecutive cores."""
    available = sorted(os.sched_getaffinity(0))
    each = len(available) // processes
    if each < 1:
        raise SystemExit(f"--pin-cores: {processes} rank processes but {len(available)} cores")
    return [available[index * each:(index + 1) * each] for index in range(processes)]


def labels_for(args, world):
    """The systems of a round at ``world``, the A/A copy after its original; plain at world size 1 only."""
    labels = [system for system in args.systems if not (system == "plain" and world > 1)]
    if args.aa:
        labels.insert(labels.index(args.aa) + 1, args.aa + AA_SUFFIX)
    return labels


def run_paired(args, configs, started, write_rows):
    """Every configuration once per round until ``--rounds`` or ``--budget-s``; ``write_rows(rows, complete)``
    after each configuration. Returns (rows, complete)."""
    rows, complete = [], True
    for round_index in range(args.rounds):
        for world, mode, ac in configs:
            if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                complete = False
                break
            new = run_round(args, round_index, world, mode, ac, labels_for(args, world))
            rows.extend(new)
            for row in new:
                print(json.dumps({key: row.get(key) for key in ("round", "label", "world", "mode", "ac",
                                                                 "step_s_median", "error")}), flush=True)
            write_rows(rows, complete=False)
        if not complete:
            print(f"budget of {args.budget_s} s spent: stopped in round {round_index}", flush=True)
            break
    return rows, complete

