"""Summarize benchmark JSON lines: a markdown table (medians over rounds) and a PNG chart.

    python benchmarks/report.py benchmarks/results/RUN/bench.jsonl [--png chart.png] [--md table.md]
"""

import argparse
import collections
import json
import statistics


def load(path):
    with open(path) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def summarize(results):
    groups = collections.OrderedDict()
    for result in results:
        key = ("full FT" if result["full"] else "LoRA", result["ac"], "strict" if result["strict"] else "default",
               result["impl"])
        groups.setdefault(key, []).append(result)
    rows = []
    for (kind, ac, settings, impl), runs in groups.items():
        ok = [run for run in runs if not run["error"]]
        row = dict(kind=kind, ac=ac, settings=settings, impl=impl, runs=len(runs), errors=len(runs) - len(ok))
        if ok:
            row.update(step_s=statistics.median(run["step_s_median"] for run in ok),
                       step_s_all=[round(run["step_s_median"], 3) for run in ok],
                       tokens_per_s=statistics.median(run["tokens_per_s"] for run in ok),
                       allgather_gib=statistics.median(run["allgather_gib_per_step"] for run in ok),
                       peak_mem_gib=statistics.median(run.get("peak_mem_gib", run["peak_gathered_gib"]) for run in ok),
                       backward_gib=statistics.median(run["gathered_gib_by_phase"]["backward"] for run in ok),
                       recompute_gib=statistics.median(run["gathered_gib_by_phase"]["recompute"] for run in ok))
        rows.append(row)
    return rows


def markdown(rows):
    lines = ["| model | checkpointing | settings | impl | step s (median; each round) | tokens/s | all-gather GiB/step "
             "| gathered in recompute / backward GiB | peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "step_s" not in row:
            lines.append(f"| {row['kind']} | {row['ac']} | {row['settings']} | {row['impl']} | error | | | | |")
            continue
        lines.append(f"| {row['kind']} | {row['ac']} | {row['settings']} | {row['impl']} | {row['step_s']:.3f} "
                     f"({', '.join(map(str, row['step_s_all']))}) | {row['tokens_per_s']:.0f} | "
                     f"{row['allgather_gib']:.3f} | {row['recompute_gib']:.3f} / {row['backward_gib']:.3f} | "
                     f"{row['peak_mem_gib']:.2f} |")
    return "\n".join(lines)


def chart(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [row for row in rows if "step_s" in row]
    labels = list(dict.fromkeys((r["kind"], r["ac"], r["settings"]) for r in rows))
    figure, axes = plt.subplots(1, 3, figsize=(16, 5))
    for axis, metric, title in zip(axes, ("allgather_gib", "step_s", "peak_mem_gib"),
                                   ("all-gather GiB / step", "step time s (median)", "peak memory GiB")):
        for offset, impl in ((-0.2, "stock"), (0.2, "fork")):
            values = [next((r[metric] for r in rows if (r["kind"], r["ac"], r["settings"]) == label and r["impl"] == impl),
                           0) for label in labels]
            axis.bar([i + offset for i in range(len(labels))], values, width=0.4, label=impl)
        axis.set_xticks(range(len(labels)))
        axis.set_xticklabels([f"{k}\n{a}\n{s}" for k, a, s in labels], fontsize=7)
        axis.set_title(title)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("jsonl")
    parser.add_argument("--png")
    parser.add_argument("--md")
    args = parser.parse_args()
    rows = summarize(load(args.jsonl))
    table = markdown(rows)
    print(table)
    if args.md:
        with open(args.md, "w") as out:
            out.write(table + "\n")
    if args.png:
        chart(rows, args.png)


if __name__ == "__main__":
    main()
