"""Stock DeepSpeed vs deepspeed-zero3-ac, side by side in one run: step time, memory, all-gathers.

One process per rank runs every configuration in A/B order (stock, fork, stock, fork, ...), each
with warm-up steps and then measured steps, so that drift hits both sides alike. The fork is
switched with ``zero3_ac.apply()`` / ``zero3_ac.remove()`` between engines (an engine keeps the
hooks it was created with).

    python benchmarks/bench.py --device cpu                    # tiny model, proxy metrics
    python benchmarks/bench.py --device cuda --nproc 2 --model tinyllama --out benchmarks/results/x.jsonl

Metrics per configuration (medians over measured steps):
- step_s, tokens_per_s;
- peak_mem_gib: ``torch.cuda.max_memory_allocated`` on GPU; on CPU the peak of gathered param bytes;
- allgather_gib_per_step: bytes of every ``torch.distributed.all_gather_into_tensor`` output;
- gathered_gib_by_phase: bytes of params the ZeRO-3 coordinator gathered, by forward /
  recompute / backward (the same meter for stock and fork).
"""

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spawn import start_ranks, use_rank_device  # noqa: E402
from workload import MODELS, AllGatherCounter, build_model, zero3_config  # noqa: E402

STRICT = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}


CHECKPOINTING = ("nonreentrant", "reentrant", "none")


def configurations(include_full=True, checkpointing=CHECKPOINTING, default_only=False):
    """(ac, strict, full) in the order they run; each runs for stock and fork back to back."""
    budgets = (False,) if default_only else (False, True)
    runs = [(ac, strict, False) for strict in budgets for ac in checkpointing]
    if include_full:
        runs += [(ac, False, True) for ac in ("nonreentrant", "reentrant") if ac in checkpointing]
    return runs


class Meter:
    """All-gather bytes (torch.distributed) and, through GatherMeter, coordinator gathers by phase."""

    def __init__(self):
        self.allgathers = AllGatherCounter()
        self.gathers = None

    def attach(self, engine):
        from zero3_ac.utils.gather_meter import GatherMeter
        self.gathers = GatherMeter(engine)

    def take(self):
        gathered = self.gathers.take()
        calls, nbytes = self.allgathers.take()
        return dict(allgather_bytes=nbytes, allgather_calls=calls, phase_bytes=gathered["phase_bytes"],
                    peak_live=gathered["peak_bytes"])


def run_one(args, meter, impl, ac, strict, full, rank, world_size):
    import deepspeed
    import zero3_ac
    if impl == "fork":
        zero3_ac.apply()
    else:
        zero3_ac.remove()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    config = zero3_config(args.device, args.mbs, dtype, {**(STRICT if strict else {}), **dict(args.zero_option)})
    baseline = torch.cuda.memory_allocated() if args.device == "cuda" else 0
    model = build_model(args.model, ac, full, dtype, ds_config=config if args.device == "cuda" else None)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    meter.attach(engine)
    generator = torch.Generator().manual_seed(1234 + rank)
    vocab = MODELS[args.model]["vocab_size"]
    times, samples, error, loss = [], [], None, float("nan")
    device = engine.device
    try:
        for step in range(args.warmup + args.steps):
            ids = torch.randint(0, vocab, (args.mbs, args.seq), generator=generator).to(device)
            if step == args.warmup:
                meter.take()
                if args.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            if args.device == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                times.append(elapsed)
                samples.append(meter.take())
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    result = dict(impl=impl, ac=ac, strict=strict, full=full, error=error)
    if not error:
        steps = len(times)
        step_s = statistics.median(times)
        gib = 1024**3
        result.update(
            step_s_median=step_s, step_s_min=min(times),
            tokens_per_s=world_size * args.mbs * args.seq / step_s,
            allgather_gib_per_step=sum(s["allgather_bytes"] for s in samples) / steps / gib,
            allgather_calls_per_step=sum(s["allgather_calls"] for s in samples) / steps,
            gathered_gib_by_phase={phase: sum(s["phase_bytes"][phase] for s in samples) / steps / gib
                                   for phase in samples[0]["phase_bytes"]},
            peak_gathered_gib=max(s["peak_live"] for s in samples) / gib,
            last_loss=float(loss.item()))
        if args.device == "cuda":
            # Less what earlier engines left allocated: the peak this engine alone needs.
            result["peak_mem_gib"] = (torch.cuda.max_memory_allocated() - baseline) / gib
            result["leftover_before_gib"] = baseline / gib
        stats = zero3_ac.lifecycle_stats(engine)
        if stats is not None:
            result["fork_drained_params"] = stats["total_drained_params"]
            result["fork_swept_params"] = stats["total_swept_params"]
    engine.destroy()
    # Stock DeepSpeed never takes the root module off its global module stack, which would keep
    # every engine's model alive across configurations; the benchmark does it for both sides.
    from deepspeed.runtime.zero import parameter_offload
    parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if m is not engine.module]
    del engine, model, optimizer
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def worker(rank, world_size, port, args, queue):
    use_rank_device(rank, args.device)
    import warnings
    warnings.filterwarnings("ignore")
    meter = Meter()
    import deepspeed
    from deepspeed.utils import logger
    from transformers.utils import logging as hf_logging
    logger.setLevel("ERROR")
    hf_logging.set_verbosity_error()
    deepspeed.init_distributed(dist_backend="gloo" if args.device == "cpu" else "nccl")
    runs = configurations(include_full=not args.no_full, checkpointing=args.ac, default_only=args.default_only)
    for round_index in range(args.rounds):
        for ac, strict, full in runs:
            for impl in ("stock", "fork"):
                result = run_one(args, meter, impl, ac, strict, full, rank, world_size)
                if rank == 0:
                    result.update(round=round_index, model=args.model, seq=args.seq, mbs=args.mbs,
                                  world_size=world_size, ds=deepspeed.__version__, torch=torch.__version__)
                    queue.put(result)
    if rank == 0:
        queue.put(None)


def label(result):
    kind = "full FT" if result["full"] else "LoRA"
    return f"{result['impl']:<5} {kind:<7} {result['ac']:<12} {'strict' if result['strict'] else 'default':<7}"


def print_row(result):
    if result["error"]:
        print(f"{label(result)}  ERROR {result['error']}", flush=True)
        return
    phases = result["gathered_gib_by_phase"]
    mem = result.get("peak_mem_gib", result["peak_gathered_gib"])
    print(f"{label(result)}  {result['step_s_median']:7.3f}s {result['tokens_per_s']:9.0f} tok/s  "
          f"mem {mem:7.3f} GiB  all-gather {result['allgather_gib_per_step']:7.3f} GiB  "
          f"fwd/rec/bwd {phases['forward']:.3f}/{phases['recompute']:.3f}/{phases['backward']:.3f} GiB", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=1, help="A/B rounds over all configurations")
    parser.add_argument("--no-full", action="store_true", help="skip the full fine-tune pair")
    parser.add_argument("--ac", nargs="+", choices=CHECKPOINTING, default=list(CHECKPOINTING),
                        help="checkpointing modes to run (default: all)")
    parser.add_argument("--default-only", action="store_true", help="skip the strict live-budget settings")
    parser.add_argument("--zero-option", nargs=2, action="append", default=[], metavar=("KEY", "JSON"),
                        type=str, help="extra zero_optimization entry, e.g. zero_quantized_weights true")
    parser.add_argument("--out", default=None, help="JSON lines output")
    args = parser.parse_args()
    args.zero_option = [(key, json.loads(value)) for key, value in args.zero_option]
    gpu = args.device == "cuda"
    args.model = args.model or ("tinyllama" if gpu else "tiny")
    args.seq = args.seq or (2048 if gpu else 64)
    args.warmup = args.warmup if args.warmup is not None else (3 if gpu else 1)
    args.steps = args.steps if args.steps is not None else (6 if gpu else 2)
    ranks = start_ranks(worker, args.nproc, args)
    processes, queue = ranks.processes, ranks.queue
    results = []
    total = args.rounds * len(configurations(not args.no_full, args.ac, args.default_only)) * 2
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    # Written as results arrive, so that a run cut short keeps what it measured.
    with open(args.out, "w") if args.out else contextlib.nullcontext() as out:
        while True:
            result = queue.get()
            if result is None:
                break
            results.append(result)
            print(f"[{len(results)}/{total}] ", end="")
            print_row(result)
            if out is not None:
                out.write(json.dumps(result) + "\n")
                out.flush()
    ranks.join()
    ranks.close()
    return 0 if len(results) == total else 1


if __name__ == "__main__":
    sys.exit(main())
