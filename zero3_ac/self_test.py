"""A 2-rank CPU self-test of the case the fork fixes: frozen params under ZeRO-3 with non-reentrant checkpointing.

Each rank builds the same small model (blocks of a frozen norm and linear with a trainable low-rank
branch beside the frozen linear, each block checkpointed with ``use_reentrant=False``, a trainable
head), trains it for a few steps under ZeRO-3 on gloo, and reports what it saw. Stock DeepSpeed
0.19.2 raises ``CheckpointError`` there; 0.19.3+ gathers the frozen params again during the backward.
Only torch and DeepSpeed are needed.
"""

import math
import traceback

import torch
from torch.utils.checkpoint import checkpoint

from zero3_ac.utils.spawn import finish_rank, start_ranks

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


def run_rank(rank, queue):
    """One rank (a fresh process, its environment set by zero3_ac.utils.spawn): train, report, clean up."""
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
        finish_rank()
    queue.put(report)  # a SimpleQueue: written once put returns


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
    """Run the self-test on ``WORLD_SIZE`` fresh CPU ranks; return their reports (rank order).

    A rank that died or did not report within ``timeout`` seconds gets a report with its error; a
    rank that reported and then did not exit 0 (an abort at interpreter exit) has it in ``exit_code``.
    """
    with start_ranks(run_rank, WORLD_SIZE, env={"DS_ACCELERATOR": "cpu"}) as ranks:
        finished = ranks.join(timeout)
        reports = {report["rank"]: report for report in ranks.drain()}
        ranks.close()
        for rank, code in enumerate(ranks.exit_codes):
            if rank not in reports:
                reason = f"timed out after {timeout}s" if not finished else f"exited with code {code}"
                reports[rank] = {"rank": rank, "stage": "train", "error": f"the rank process {reason} without a report"}
            else:
                reports[rank]["exit_code"] = code
    return [reports[rank] for rank in range(WORLD_SIZE)]
