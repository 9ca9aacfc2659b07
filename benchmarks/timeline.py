"""Gathered param bytes over one training step, stock DeepSpeed and the fork side by side, as a PNG.

Each rank builds bench.py's CPU model (a tiny Llama with PEFT LoRA, HF gradient checkpointing)
under ZeRO-3, once with stock DeepSpeed and once with the fork (``zero3_ac.remove()`` /
``zero3_ac.apply()`` in the same process), runs one warm step, then records one step (forward,
backward, optimizer step) with :class:`zero3_ac.utils.timeline.TimelineRecorder`. Rank 0's two
timelines are drawn side by side: gathered bytes after every gather and release, phases shaded.

    python benchmarks/timeline.py --out docs/img/timeline-cpu.png [--json timeline.json] [--strict]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import MODELS, STRICT, build_model  # noqa: E402
from spawn import start_ranks  # noqa: E402

IMPLS = ("stock", "fork")
PHASE_COLORS = {"forward": "#cfe2f3", "recompute": "#fce5cd", "backward": "#d9ead3"}


def record(impl, args, rank):
    import deepspeed
    import zero3_ac
    from deepspeed.runtime.zero import parameter_offload
    from zero3_ac.utils.timeline import TimelineRecorder
    zero3_ac.apply() if impl == "fork" else zero3_ac.remove()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **(STRICT if args.strict else {})}
    config = {"train_micro_batch_size_per_gpu": args.mbs, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "steps_per_print": 10**9, "zero_allow_untested_optimizer": True, "zero_optimization": zero}
    model = build_model("tiny", args.ac, False, torch.float32)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    recorder = TimelineRecorder(engine)
    generator = torch.Generator().manual_seed(1234 + rank)
    error = None
    try:
        for step in range(2):
            ids = torch.randint(0, MODELS["tiny"]["vocab_size"], (args.mbs, args.seq), generator=generator)
            if step == 1:
                recorder.start()
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    except Exception as exc:  # stock DeepSpeed 0.19.2 under non-reentrant checkpointing: the bug
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    recorder.stop()
    engine.destroy()
    parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if m is not engine.module]
    return dict(impl=impl, error=error, deepspeed=deepspeed.__version__, events=recorder.as_dict()["events"])


def worker(rank, world_size, port, args, queue):
    import warnings
    warnings.filterwarnings("ignore")
    import deepspeed
    from deepspeed.utils import logger
    from transformers.utils import logging as hf_logging
    logger.setLevel("ERROR")
    hf_logging.set_verbosity_error()
    deepspeed.init_distributed(dist_backend="gloo")
    for impl in IMPLS:
        result = record(impl, args, rank)
        if rank == 0:
            queue.put(result)


def totals(events):
    """Gathered bytes by phase and re-gathered bytes, counted as the fork's accounting counts them."""
    from zero3_ac.runtime.zero.accounting import StepAccounting
    step = StepAccounting()
    for event in events:
        if event["kind"] == "gather":
            step.record_gather(event["phase"], event["frozen"], event["ds_id"], 0, event["nbytes"])
        else:
            step.record_release(event["phase"], event["ds_id"], event["nbytes"])
    return step.phase_bytes(), sum(step.regathered_bytes.values())


def phase_spans(events):
    """(first seq, last seq, phase) of each run of events in one phase."""
    spans = []
    for event in events:
        if spans and spans[-1][2] == event["phase"]:
            spans[-1][1] = event["seq"]
        else:
            spans.append([event["seq"], event["seq"], event["phase"]])
    return spans


def render(results, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    kib = 1024
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
    for axis, result in zip(axes, results):
        events = result["events"]
        for first, last, phase in phase_spans(events):
            axis.axvspan(first - 0.5, last + 0.5, color=PHASE_COLORS[phase], linewidth=0)
        axis.step([e["seq"] for e in events], [e["live_bytes"] / kib for e in events], where="post", color="#1f4e79",
                  linewidth=1.2)
        phases, regathered = totals(events)
        name = f"stock DeepSpeed {result['deepspeed']}" if result["impl"] == "stock" else "deepspeed-zero3-ac"
        axis.set_title(f"{name}\nall-gathered KiB fwd/rec/bwd {phases['forward'] / kib:.0f}/{phases['recompute'] / kib:.0f}/"
                       f"{phases['backward'] / kib:.0f}, re-gathered {regathered / kib:.0f}", fontsize=10)
        if result["error"]:
            axis.text(0.5, 0.5, result["error"], transform=axis.transAxes, ha="center", wrap=True, color="#990000")
        axis.set_xlabel("gather and release events of one step, in order")
        axis.set_xlim(-1, max(len(events), 1))
    axes[0].set_ylabel("gathered param KiB (rank 0)")
    handles = [Patch(color=color, label=phase) for phase, color in PHASE_COLORS.items()]
    fig.legend(handles=handles, loc="upper center", ncol=3, frameon=False, bbox_to_anchor=(0.5, 1.0))
    fig.suptitle(f"one ZeRO-3 step, tiny Llama + LoRA, {args.ac} checkpointing{', strict live budget' if args.strict else ''}, "
                 f"{args.nproc} CPU ranks", y=0.93, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="timeline.png", help="PNG output")
    parser.add_argument("--json", default=None, help="also write rank 0's events here")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--ac", choices=["nonreentrant", "reentrant"], default="nonreentrant")
    parser.add_argument("--strict", action="store_true", help="no live-parameter budget, no reuse, no prefetch")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--mbs", type=int, default=2)
    args = parser.parse_args()
    ranks = start_ranks(worker, args.nproc, args)
    processes, queue = ranks.processes, ranks.queue
    results = [queue.get() for _ in IMPLS]
    ranks.join()
    ranks.close()
    for result in results:
        phases, regathered = totals(result["events"])
        print(f"{result['impl']:<5} {len(result['events'])} events, gathered bytes by phase {phases}, "
              f"re-gathered {regathered} bytes{', ' + result['error'] if result['error'] else ''}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out)
    render(results, args)
    print(f"wrote {args.out}")
    return 0 if all(process.exitcode == 0 for process in processes) else 1


if __name__ == "__main__":
    sys.exit(main())
