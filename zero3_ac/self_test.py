"""A 2-rank CPU self-test of the case the fork fixes: frozen params under ZeRO-3 with non-reentrant checkpointing.

Each rank builds the same small model (blocks of a frozen norm and linear with a trainable low-rank
branch beside the frozen linear, each block checkpointed with ``use_reentrant=False``, a trainable
head), trains it for a few steps under ZeRO-3 on gloo, and reports what it saw. Stock DeepSpeed
0.19.2 raises ``CheckpointError`` there; 0.19.3+ gathers the frozen params again during the backward.
Only torch and DeepSpeed are needed.
"""

import contextlib
import glob
import math
import os
import sys
import socket
import time
import traceback

import torch
from torch.utils.checkpoint import checkpoint

WORLD_SIZE = 2
STEPS = 2
DIM = 32
TIMEOUT_S = 300
ZERO_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 10**9,
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0,
    },
}


class FrozenBlockWithAdapter(torch.nn.Module):

    def __init__(self, dim=DIM, rank=4):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.frozen = torch.nn.Linear(dim, dim)
        self.down = torch.nn.Linear(dim, rank, bias=False)
        self.up = torch.nn.Linear(rank, dim, bias=False)
        for param in [*self.norm.parameters(), *self.frozen.parameters()]:
            param.requires_grad_(False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.frozen(h) + self.up(self.down(h))


class CheckpointedModel(torch.nn.Module):

    def __init__(self, blocks=3, dim=DIM):
        super().__init__()
        self.blocks = torch.nn.ModuleList(FrozenBlockWithAdapter(dim) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x).pow(2).mean()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gathered_params(engine) -> int:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return sum(1 for p in engine.module.parameters() if p.ds_status != ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist)


def _train(rank, report):
    import deepspeed
    import zero3_ac
    from zero3_ac.utils.gather_meter import GatherMeter
    deepspeed.init_distributed(dist_backend="gloo")
    report.update(stage="train", fork_active=zero3_ac.is_active())
    torch.manual_seed(0)
    model = CheckpointedModel()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ZERO_CONFIG)
    report["engine_uses_fork"] = zero3_ac.lifecycle_stats(engine) is not None
    meter = GatherMeter(engine)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(2, DIM, generator=generator, requires_grad=True)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        report["losses"].append(loss.item())
        report["frozen_backward_regathers"] += sum(n - 1 for n in meter.frozen_regathers().values())
        meter.take()
        report["params_left_gathered"] = max(report["params_left_gathered"], _gathered_params(engine))
    stats = zero3_ac.lifecycle_stats(engine)
    if stats is not None:
        report["drained_params"] = stats["total_drained_params"] + stats["total_swept_params"]
    engine.destroy()


def _destroy_process_group():
    """Note: [Process groups at interpreter exit]

    Neither DeepSpeed, the HF Trainer nor TRL destroys the process groups it uses (accelerate does in
    ``Accelerator.end_training()``, which the Trainer does not call), so each rank of the examples
    and of this self-test reached interpreter shutdown with its gloo groups still registered and
    their C++ threads (``pt_gloo_runloop``, ``gloo_tcp_loop``) running. That is the state in which a
    rank that trained fine can abort at exit with ``terminate called without an active exception``
    (SIGABRT): pytorch/pytorch#190489 reports it for gloo without ``destroy_process_group``, and
    pytorch/pytorch#179291 (an atexit ``destroy_process_group``, abandoned) explains it by a gloo
    thread that frees a tensor of a collective, and so needs the GIL, while the interpreter
    finalizes. So every rank destroys its groups before it returns, and a rank's exit code counts,
    not only its report. The destroy is not enough: gloo's ``shutdown()`` is a no-op in torch 2.13,
    and its threads stop only when the last reference to the group goes, which DeepSpeed keeps
    after the destroy (``deepspeed.utils.groups._WORLD_GROUP`` among others); the abort was seen
    again in a fresh-clone CI run of ``python -m zero3_ac doctor`` on DeepSpeed 0.18.5. So a rank
    that has handed over its report leaves with ``os._exit`` (``exit_without_finalizing``): the
    interpreter's finalization, where the gloo thread aborts, never runs.
    """
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_rank(rank, port, queue):
    """One rank (a ``spawn``-ed process): configure the environment before DeepSpeed is imported, train, report."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_SIZE=str(WORLD_SIZE),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    report = {"rank": rank, "stage": "setup", "error": None, "fork_active": None, "engine_uses_fork": None,
              "losses": [], "params_left_gathered": 0, "frozen_backward_regathers": 0, "drained_params": 0}
    try:
        import warnings
        warnings.filterwarnings("ignore")
        from deepspeed.utils import logger
        logger.setLevel("ERROR")
        _train(rank, report)
    except Exception as error:
        report["error"] = traceback.format_exception_only(type(error), error)[-1].strip().splitlines()[0]
    finally:
        _destroy_process_group()
    queue.put(report)  # a SimpleQueue: written once put returns
    exit_without_finalizing(0)


def exit_without_finalizing(code):
    """Flush the standard streams and leave now (Note: [Process groups at interpreter exit])."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def failures(report) -> list:
    """Why one rank's report is a failure (empty when it passed)."""
    if report["error"]:
        stage = "could not start DeepSpeed on CPU" if report["stage"] == "setup" else "training failed"
        return [f"{stage}: {report['error']}"]
    problems = []
    if not report["fork_active"] or not report["engine_uses_fork"]:
        problems.append("the fork was not active in this rank")
    if not all(math.isfinite(loss) for loss in report["losses"]):
        problems.append(f"non-finite loss {report['losses']}")
    if report["params_left_gathered"]:
        problems.append(f"{report['params_left_gathered']} params left gathered after a step")
    if report["frozen_backward_regathers"]:
        problems.append(f"frozen params gathered again during backward {report['frozen_backward_regathers']} times")
    if report["drained_params"]:
        problems.append(f"{report['drained_params']} params released only by the end-of-backward safety net")
    if report.get("exit_code"):
        problems.append(f"the rank process exited with code {report['exit_code']} after its report")
    return problems


def run(timeout=TIMEOUT_S) -> list:
    """Run the self-test on ``WORLD_SIZE`` spawned CPU ranks; return their reports (rank order).

    A rank that died or did not report within ``timeout`` seconds gets a report with its error; a
    rank that reported and then did not exit 0 (an abort at interpreter exit) has it in ``exit_code``.
    """
    import torch.multiprocessing as mp
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = free_port()
    processes = [context.Process(target=run_rank, args=(rank, port, queue), daemon=True) for rank in range(WORLD_SIZE)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    reports = {}
    while not queue.empty():
        report = queue.get()
        reports[report["rank"]] = report
    for rank, process in enumerate(processes):
        timed_out = process.is_alive()
        if timed_out:
            process.kill()
            process.join()
        if rank not in reports:
            reason = f"timed out after {timeout}s" if timed_out else f"exited with code {process.exitcode}"
            reports[rank] = {"rank": rank, "stage": "train", "error": f"the rank process {reason} without a report"}
        else:
            reports[rank]["exit_code"] = process.exitcode
    remove_shm_buffers(port)
    return [reports[rank] for rank in range(WORLD_SIZE)]


def remove_shm_buffers(port):
    """Note: DeepSpeed's CPU all-reduce leaves one /dev/shm segment per rank (~66 MB), named after the port."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_*"):
        with contextlib.suppress(OSError):
            os.unlink(path)
