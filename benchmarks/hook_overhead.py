"""Python hook overhead of the fork against stock DeepSpeed, on a CPU model of many small modules.

ZeRO-3 (no param persistence, so every module gathers and releases) on gloo CPU ranks; the model is
``--blocks`` blocks of two tiny Linear layers (a frozen one and a trainable, LoRA-like one beside
it: 200 Linear layers by default) and a trainable head, with non-reentrant checkpointing of every
block and without checkpointing. Compute is negligible, so the step time is mostly hook time. By
default, ZeRO-3's reuse distance keeps params gathered from the forward through the backward once
the trace is recorded; ``--lean`` releases every param after each use instead.

Each round creates a stock and a fork engine in one process per rank (switched with
``zero3_ac.remove()`` / ``zero3_ac.apply()``), warms both up, then alternates their measured steps
(A/B/A/B), so that load from other processes hits both sides alike. The fork's accounting is on,
as it always is. It prints the median step time of
each side, over all measured steps of all rounds, and their ratio, and writes them as JSON with
the param bytes each side gathered in one step, by phase (the same meter on both sides).

    python benchmarks/hook_overhead.py --out benchmarks/results/<date>-cpu-hook-overhead/hook_overhead.json
    python benchmarks/hook_overhead.py --profile fork-profile.txt   # plus cProfile of one fork engine
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spawn import start_ranks  # noqa: E402

IMPLS = ("stock", "fork")
# Release every param after each use: gathers and releases in every phase, the fork's busiest path.
LEAN = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}


class Block(torch.nn.Module):

    def __init__(self, dim):
        super().__init__()
        self.frozen = torch.nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.lora = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return torch.tanh(self.frozen(x) + self.lora(x))


class ManySmallModules(torch.nn.Module):

    def __init__(self, blocks, dim, checkpointed):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, 1, bias=False)
        self.checkpointed = checkpointed

    def forward(self, x):
        for block in self.blocks:
            if self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x).pow(2).mean()


def make_engine(args, impl, ac):
    import deepspeed
    import zero3_ac
    zero3_ac.apply() if impl == "fork" else zero3_ac.remove()
    torch.manual_seed(0)
    model = ManySmallModules(args.blocks, args.dim, checkpointed=ac == "nonreentrant")
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **(LEAN if args.lean else {})}}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def timed_step(engine, x, profiler=None):
    if profiler is not None:
        profiler.enable()
    start = time.perf_counter()
    engine.backward(engine(x))
    engine.step()
    elapsed = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
    return elapsed


def free(engine):
    from deepspeed.runtime.zero import parameter_offload
    engine.destroy()
    # Stock DeepSpeed never takes the root module off its module stack; done for both sides alike.
    parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if m is not engine.module]


def run_round(args, ac):
    """One stock and one fork engine; after warm-up, their measured steps alternate (A/B/A/B)."""
    from zero3_ac.utils.gather_meter import GatherMeter
    engines = {impl: make_engine(args, impl, ac) for impl in IMPLS}
    meters = {impl: GatherMeter(engine) for impl, engine in engines.items()}
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    times = {impl: [] for impl in IMPLS}
    gathered = {impl: [] for impl in IMPLS}
    errors = {impl: None for impl in IMPLS}
    for step in range(args.warmup + args.steps):
        for impl, engine in engines.items():
            if errors[impl]:
                continue
            meters[impl].reset()
            try:
                elapsed = timed_step(engine, x)
            except Exception as exc:  # stock 0.19.2 under non-reentrant checkpointing: the bug
                errors[impl] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                continue
            if step >= args.warmup:
                times[impl].append(elapsed)
                gathered[impl].append(meters[impl].phase_bytes)
    for engine in engines.values():
        free(engine)
    gc.collect()
    return [dict(impl=impl, times=times[impl], gathered_bytes=gathered[impl], error=errors[impl]) for impl in IMPLS]


def profile_fork(args, path):
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    engine = make_engine(args, "fork", args.ac[0])
    x = torch.randn(args.batch, args.dim, requires_grad=True)
    for step in range(args.warmup + args.steps):
        timed_step(engine, x, profiler if step >= args.warmup else None)
    free(engine)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    with open(path, "w") as out:
        out.write(text.getvalue())


def worker(rank, world_size, port, args, queue):
    torch.set_num_threads(1)
    import warnings
    warnings.filterwarnings("ignore")
    import deepspeed
    from deepspeed.utils import logger
    logger.setLevel("ERROR")
    deepspeed.init_distributed(dist_backend="gloo")
    for round_index in range(args.rounds):
        for ac in args.ac:
            for row in run_round(args, ac):
                if rank == 0:
                    queue.put(dict(round=round_index, ac=ac, **row))
    if args.profile:
        profile_fork(args, args.profile if rank == 0 else os.devnull)
    if rank == 0:
        queue.put(None)


def summarize(rows, args):
    import deepspeed
    result = dict(lean=args.lean, blocks=args.blocks, linear_layers=2 * args.blocks + 1, dim=args.dim, batch=args.batch,
                  nproc=args.nproc, rounds=args.rounds, warmup=args.warmup, steps=args.steps,
                  deepspeed=deepspeed.__version__, torch=torch.__version__, configurations={})
    for ac in args.ac:
        runs = {impl: [row for row in rows if row["ac"] == ac and row["impl"] == impl] for impl in IMPLS}
        errors = sorted({row["error"] for impl in IMPLS for row in runs[impl] if row["error"]})
        if errors:
            result["configurations"][ac] = dict(errors=errors)
            continue
        medians = {impl: statistics.median(t for row in runs[impl] for t in row["times"]) for impl in IMPLS}
        gathered = {impl: runs[impl][0]["gathered_bytes"][-1] for impl in IMPLS}
        result["configurations"][ac] = dict(
            stock_step_s=medians["stock"], fork_step_s=medians["fork"], fork_over_stock=medians["fork"] / medians["stock"],
            round_medians_s={impl: [statistics.median(row["times"]) for row in runs[impl]] for impl in IMPLS},
            gathered_bytes_per_step_by_phase=gathered)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=100, help="blocks of two Linear layers")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4, help="A/B rounds")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ac", nargs="+", choices=["nonreentrant", "none"], default=["nonreentrant", "none"])
    parser.add_argument("--lean", action="store_true", help="no reuse distance, no prefetch (see LEAN)")
    parser.add_argument("--profile", default=None, help="write a cProfile of one fork engine here")
    parser.add_argument("--out", default=None, help="JSON output")
    args = parser.parse_args()
    ranks = start_ranks(worker, args.nproc, args)
    processes, queue = ranks.processes, ranks.queue
    rows = []
    while True:
        row = queue.get()
        if row is None:
            break
        rows.append(row)
        measured = row["error"] or f"median {statistics.median(row['times']) * 1e3:8.2f} ms"
        print(f"round {row['round']} {row['ac']:<12} {row['impl']:<5} {measured}", flush=True)
    ranks.join()
    ranks.close()
    if any(process.exitcode for process in processes):
        return 1
    result = summarize(rows, args)
    for ac, numbers in result["configurations"].items():
        if "errors" in numbers:
            print(f"{ac:<12} not compared: {numbers['errors']}")
            continue
        print(f"{ac:<12} stock {numbers['stock_step_s'] * 1e3:8.2f} ms  fork {numbers['fork_step_s'] * 1e3:8.2f} ms  "
              f"fork/stock {numbers['fork_over_stock']:.3f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
