"""Summarize ``run_hf_trainer_gpu.sh``: one markdown row per implementation, from rank 0's probe JSON.

    python benchmarks/hf_trainer_report.py OUTDIR [--warmup 5]
"""

import argparse
import json
import os
import statistics

GIB = 2**30


def row(impl, summary, warmup):
    steps = summary["steps"][warmup:]
    if not steps:
        return f"| {impl} | no measured step ({summary.get('error') or 'see the log'}) |" + " |" * 7
    phase = {name: statistics.median(step["gathered_bytes"].get(name, 0) for step in steps) / GIB
             for name in ("forward", "recompute", "backward")}
    peak = max(step["peak_memory_bytes"] or 0 for step in summary["steps"]) / GIB
    losses = summary["losses"]
    return (f"| {impl} | {summary['fork_active']} | {len(summary['steps'])} | "
            f"{statistics.median(step['seconds'] for step in steps):.3f} | "
            f"{phase['forward']:.3f} / {phase['recompute']:.3f} / {phase['backward']:.3f} | "
            f"{statistics.median(step['frozen_backward_regathers'] for step in steps):.0f} | {peak:.2f} | "
            f"{losses[0]:.3f} → {losses[-1]:.3f} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    print("| impl | fork active | steps | step s (median) | gathered GiB/step forward / recompute / backward "
          "| frozen re-gathers in backward / step | peak GiB | loss first → last |")
    print("|---|---|---|---|---|---|---|---|")
    for impl in ("stock", "fork"):
        path = os.path.join(args.outdir, impl, "rank0.json")
        if not os.path.exists(path):
            print(f"| {impl} | no summary |" + " |" * 6)
            continue
        with open(path) as summary:
            print(row(impl, json.load(summary), args.warmup))


if __name__ == "__main__":
    main()
