"""Runs one ``Example`` under plain PyTorch, stock DeepSpeed and the fork, and judges the results.

``run_example`` runs on every rank (``run_distributed``). Each run is caught on its own and
returned as data (``RunResult``): an error's type and message, the losses, the trainable params'
updates, what was left gathered or held after each backward and step, and what the fork's drain
found. ``verdict`` compares them in the parent:

* the fork runs without an error, its losses and trainable-param updates match plain PyTorch's
  (fp32, ``RTOL``/``ATOL``), and nothing is left gathered or held after any backward or step;
* the drain at the end of the fork's backward finds nothing, unless a forward whose backward
  never runs came before it in the same micro-batch (``LEFTOVER_EXTRAS``: that forward's params
  are released by the next backward event, which may be that drain); params the drain's sweep
  finds gathered but held by nothing count only in a regular schedule (``regular_schedule``);
* stock's outcome is recorded beside it, so that a report tells "both fail" from "only the fork".
  ``Verdict.failed``: the fork is not clean where stock is, or it ran to the end and was wrong.

Note: [Stock and fork in one process]
``zero3_ac.remove()`` restores DeepSpeed's methods; engines created afterwards are stock, and
the fork's class-level patches (the linear, the gradient partitions) are out of their way. The
stock engine is built, trained and destroyed entirely between ``remove()`` and ``apply()``, the
fork's after ``apply()``, so neither engine ever runs with the other's class methods.
"""

import contextlib
import dataclasses
import gc
import traceback
from typing import Dict, List, Optional, Tuple

import torch

from tests.unit.runtime.zero.fuzz import model as fuzz_model
from tests.unit.runtime.zero.fuzz.spec import Example, blocks_of
from tests.unit.runtime.zero.zero_case import torch_linear

RTOL, ATOL = 1e-4, 1e-6
LR = 0.1
MICRO_BATCH = 2
STRICT = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
# Extras whose params the next backward's drain may release (Note: [Gathered after a forward under no_grad]).
LEFTOVER_EXTRAS = ("no_backward", "eval", "no_grad", "no_grad_between")


@dataclasses.dataclass
class RunResult:
    error: Optional[Tuple[str, str]] = None  # (type name, message)
    where: str = ""  # the micro-batch and phase the error happened in
    trace: str = ""
    losses: List[float] = dataclasses.field(default_factory=list)
    deltas: Optional[Dict[str, torch.Tensor]] = None
    held: List[str] = dataclasses.field(default_factory=list)
    drained: List[Tuple[int, int]] = dataclasses.field(default_factory=list)  # (backward index, params)
    swept: List[Tuple[int, int]] = dataclasses.field(default_factory=list)  # (backward index, params)


# ---------------------------------------------------------------------------- in the ranks
def micro_batches(example: Example):
    """``batches[i][r]``: micro-batch i of rank r, and ``seconds[i][r]`` for two-forward micro-batches."""
    shape = fuzz_model.input_shape(example.model, MICRO_BATCH)
    generator = torch.Generator().manual_seed(example.seed)
    count = len(example.schedule.extras)
    draw = lambda: [[torch.randn(shape, generator=generator) for _ in range(example.world_size)] for _ in range(count)]
    return draw(), draw()


def _input(x, example):
    return x.detach().clone().requires_grad_(example.schedule.input_grad)


def _forward_context(example):
    from torch.utils.checkpoint import set_checkpoint_early_stop
    return set_checkpoint_early_stop(example.schedule.early_stop)


def _trainable(module):
    return {name: param for name, param in module.named_parameters() if param.requires_grad}


def run_reference(example: Example, batches, seconds, rank) -> RunResult:
    """Plain PyTorch on every rank's data (the data-parallel mean), reporting rank ``rank``'s losses."""
    result = RunResult()
    schedule = example.schedule
    try:
        with torch_linear():
            model = fuzz_model.build(example.model, example.seed)
            initial = {name: p.detach().clone() for name, p in _trainable(model).items()}
            optimizer = torch.optim.SGD(list(_trainable(model).values()), lr=LR)
            for index, extra in enumerate(schedule.extras):
                total = 0
                for r in range(example.world_size):
                    with _forward_context(example):
                        loss = model(_input(batches[index][r], example))
                        if extra == "two_forwards":
                            loss = loss + model(_input(seconds[index][r], example))
                    if r == rank:
                        result.losses.append(loss.item())
                    total = total + loss
                (total / example.world_size / schedule.gas).backward()
                if (index + 1) % schedule.gas == 0:
                    optimizer.step()
                    optimizer.zero_grad()
            result.deltas = {name: p.detach() - initial[name] for name, p in _trainable(model).items()}
    except Exception as error:  # noqa: BLE001 - returned as data
        result.error = (type(error).__name__, str(error)[:2000])
        result.trace = traceback.format_exc()[-4000:]
    return result


def zero_config(example: Example):
    zero = {"stage": 3, "stage3_param_persistence_threshold": example.engine.persistence}
    if example.engine.strict:
        zero.update(STRICT)
    if example.engine.one_param_buckets:
        zero["reduce_bucket_size"] = 1
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": example.schedule.gas,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
    }


def held_params(engine, gathered=True) -> List[str]:
    """Non-persistent params held by a module or invocation, or (``gathered``) still gathered."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    found = []
    for name, param in engine.module.named_parameters():
        if getattr(param, "ds_persist", False):
            continue
        if (gathered and param.ds_status != ZeroParamStatus.NOT_AVAILABLE) or param.ds_active_sub_modules:
            found.append(f"{name} ({param.ds_status.name}, held by {sorted(param.ds_active_sub_modules)})")
    return found


def _drained(engine):
    """(params the drains released from live invocations, params their sweeps found unheld)."""
    import zero3_ac
    stats = zero3_ac.lifecycle_stats(engine)
    if stats is None:
        return 0, 0
    return stats["total_drained_params"], stats["total_swept_params"]


def regular_schedule(extras) -> bool:
    """Every micro-batch runs the same forwards.

    Note: [Sweeps after a schedule change]
    ZeRO-3 records the order of module calls in the first step and, while later steps follow it,
    keeps params gathered that the trace says come back within the reuse distance. A step that
    runs more or fewer forwards (two per backward, an extra one without backward) leaves params
    kept for a reuse that never comes, stock and fork alike; the fork's end-of-backward sweep
    releases them (stock leaves them to its next release-all). They are ZeRO's reuse policy, not
    holds the lifecycle forgot, so the sweep is judged only where the schedule never changes.
    """
    return len(set(extras)) <= 1


def _values(engine):
    import deepspeed
    values = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            with deepspeed.zero.GatheredParameters([param]):
                values[name] = param.detach().float().clone()
    return values


def _micro_step(engine, example, index, x, second, held):
    """Micro-batch ``index`` on ``engine``, with its extra forwards; returns the loss tensor (not yet
    backpropagated). Appends to ``held`` what a forward under no_grad left gathered or held."""
    extra = example.schedule.extras[index]
    if extra == "no_grad":
        with torch.no_grad(), _forward_context(example):
            engine(_input(x, example))
        # Note: [Gathered after a forward under no_grad]
        # With a reuse distance (the default), ZeRO-3 keeps params that its trace says come back
        # soon gathered after a forward, stock and fork alike; with no backward to come they stay
        # gathered until the next backward's end. Only holds count here.
        held += [f"after the no_grad forward before micro-batch {index}: {p}" for p in held_params(engine, False)]
    elif extra == "eval":
        engine.eval()
        with _forward_context(example):
            engine(_input(x, example))
        engine.train()
    elif extra == "no_backward":
        with _forward_context(example):
            engine(_input(x, example))
    with _forward_context(example):
        loss = engine(_input(x, example))
        if extra == "two_forwards":
            loss = loss + engine(_input(second, example))
    if extra == "no_grad_between":
        with torch.no_grad(), _forward_context(example):
            engine(_input(second, example))
    return loss


def run_engine(example: Example, batches, seconds, rank) -> RunResult:
    """Train a ZeRO-3 engine (stock or fork, whichever ``zero3_ac`` is set to) on rank ``rank``'s data."""
    import deepspeed
    from deepspeed.runtime.zero import parameter_offload
    result = RunResult()
    stack_depth = len(parameter_offload.FWD_MODULE_STACK)
    engine = None
    where = "deepspeed.initialize"
    try:
        model = fuzz_model.build(example.model, example.seed)
        if example.engine.units:
            import zero3_ac
            zero3_ac.set_gather_units(model, ["Block"])
        optimizer = torch.optim.SGD(list(_trainable(model).values()), lr=LR)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero_config(example))
        initial = _values(engine)
        drained = (0, 0)
        for index, extra in enumerate(example.schedule.extras):
            where = f"micro-batch {index} ({extra}): forward"
            loss = _micro_step(engine, example, index, batches[index][rank], seconds[index][rank], result.held)
            result.losses.append(loss.item())
            where = f"micro-batch {index} ({extra}): backward"
            if example.schedule.backward == "engine":
                engine.backward(loss)
            else:
                loss.backward()
            result.held += [f"after backward {index}: {p}" for p in held_params(engine)]
            now = _drained(engine)
            if now[0] != drained[0]:
                result.drained.append((index, now[0] - drained[0]))
            if now[1] != drained[1]:
                result.swept.append((index, now[1] - drained[1]))
            drained = now
            where = f"micro-batch {index} ({extra}): step"
            engine.step()
            result.held += [f"after step {index}: {p}" for p in held_params(engine)]
        where = "gathering the final params"
        final = _values(engine)
        result.deltas = {name: final[name] - initial[name] for name in initial}
    except Exception as error:  # noqa: BLE001 - returned as data
        result.error = (type(error).__name__, str(error)[:2000])
        result.where = where
        result.trace = traceback.format_exc()[-4000:]
    finally:
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.destroy()
        del parameter_offload.FWD_MODULE_STACK[stack_depth:]
    return result


def run_example(example: Example, systems=("reference", "fork", "stock")):
    """On each rank: plain PyTorch, the fork, stock DeepSpeed, those of them in ``systems``.
    Returns {"reference"|"fork"|"stock": RunResult}."""
    import deepspeed.comm as dist
    import zero3_ac
    # ZeRO-3's init runs gc.collect() once per engine; what earlier calls imported and cached is
    # still alive, so moving it out of the collector's reach halves an example's time.
    gc.freeze()
    rank = dist.get_rank()
    assert dist.get_world_size() == example.world_size
    if any(block.checkpoint.startswith("ds_") for block in blocks_of(example.model)):
        import deepspeed
        deepspeed.checkpointing.configure(None)
    batches, seconds = micro_batches(example)
    results = {}
    if "reference" in systems:
        results["reference"] = run_reference(example, batches, seconds, rank)
    # Note: [The fork runs before stock]
    # An engine that raises in a backward can leave an asynchronous collective of its own in
    # flight, and the next engine in the process then reads what it writes (seen on DeepSpeed
    # 0.18.5: a stock engine failing in a selective checkpoint, then an update of 1e27 in the
    # fork's run, clean when replayed). Stock fails far more often than the fork, so the fork runs
    # first, on a clean process.
    if "fork" in systems:
        results["fork"] = run_engine(example, batches, seconds, rank)
    if "stock" in systems:
        zero3_ac.remove()
        try:
            results["stock"] = run_engine(example, batches, seconds, rank)
        finally:
            zero3_ac.apply()
    return results


# ---------------------------------------------------------------------------- in the parent
def _close(a, b):
    return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=RTOL, atol=ATOL)


def _first_line(message):
    lines = message.strip().splitlines()
    return lines[0][:300] if lines else "(no message)"


def problems(run: RunResult, reference: RunResult, rank: int, extras) -> List[str]:
    """What is wrong with ``run`` on ``rank``, compared with plain PyTorch; empty when it ran clean."""
    if run.error is not None:
        return [f"rank {rank}: {run.error[0]} at {run.where}: {_first_line(run.error[1])}"]
    found = []
    if not _close(run.losses, reference.losses):
        found.append(f"rank {rank}: losses {run.losses} differ from plain PyTorch's {reference.losses}")
    for name, want in reference.deltas.items():
        got = run.deltas.get(name)
        if got is None:
            found.append(f"rank {rank}: {name} missing")
        elif not _close(got, want):
            found.append(f"rank {rank}: {name} update differs from plain PyTorch by up to "
                         f"{(got - want).abs().max().item():.3g} (|update| max {want.abs().max().item():.3g})")
    found += [f"rank {rank}: left gathered or held {held}" for held in run.held[:5]]
    found += [f"rank {rank}: the drain at the end of backward {index} released {count} params"
              for index, count in run.drained if extras is not None and extras[index] not in LEFTOVER_EXTRAS][:5]
    found += [f"rank {rank}: the sweep at the end of backward {index} released {count} unheld params"
              for index, count in run.swept
              if extras is not None and regular_schedule(extras) and extras[index] not in LEFTOVER_EXTRAS][:5]
    return found


@dataclasses.dataclass
class Verdict:
    reference_error: Optional[str]
    stock: List[str]
    fork: List[str]

    fork_raised: bool = False

    @property
    def failed(self) -> bool:
        """The fork failed where stock ran clean, or it ran to the end and was wrong."""
        if self.reference_error is not None or not self.fork:
            return False
        return not self.stock or not self.fork_raised

    @property
    def outcome(self) -> str:
        """One of "reference raised", "both clean", "only stock failed", "only the fork failed", "both failed"."""
        if self.reference_error is not None:
            return "reference raised"
        return {(False, False): "both clean", (True, False): "only stock failed",
                (False, True): "only the fork failed", (True, True): "both failed"}[bool(self.stock), bool(self.fork)]

    def describe(self) -> str:
        stock = "clean" if not self.stock else "FAILED too:\n    " + "\n    ".join(self.stock[:6])
        return ("the fork FAILED:\n    " + "\n    ".join(self.fork[:8]) + f"\n  stock DeepSpeed: {stock}")


def verdict(example: Example, per_rank) -> Verdict:
    reference_errors = [r["reference"].error for r in per_rank if r["reference"].error is not None]
    if reference_errors:
        return Verdict(f"{reference_errors[0][0]}: {reference_errors[0][1]}", [], [])
    stock, fork = [], []
    for rank, results in enumerate(per_rank):
        stock += problems(results["stock"], results["reference"], rank, extras=None)
        fork += problems(results["fork"], results["reference"], rank, example.schedule.extras)
    fork_raised = any(results["fork"].error is not None for results in per_rank)
    return Verdict(None, stock, fork, fork_raised)
