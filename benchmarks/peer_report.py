"""The peer benchmark's summary: medians over rounds, a markdown table with definitions, a PNG chart.

    python benchmarks/peer_report.py RESULTS_DIR      # rewrites README.md and peers.png from results.json
    python benchmarks/peer_report.py --png docs/img/peers-1xh200.png --title "1xH200" \
        DIR_A "DIR_B=walks tree" ...                  # one chart of several results, each optionally labelled

The second form draws the step time of every system in every configuration of the given results
(a results.json or runs.jsonl in each directory), the bar at the median of the run medians, the whisker
from the fastest to the slowest measured step of those runs, and prints the table; it writes nothing else.
"""

import argparse
import json
import os
import statistics

from dtypes import describe

SYSTEM_ORDER = ("plain", "fsdp2", "fsdp2_compile", "stock", "deepcompile", "fork")
MODE_ORDER = ("lora", "qlora", "full")

NOTES = """\
Definitions (rank 0 unless said otherwise):
- Step time: wall time of forward + backward + optimizer step of one micro-batch (on GPU between two
  `torch.cuda.synchronize()`). Each run (one fresh set of processes) reports the median of its measured
  steps after the warm-up steps; the table gives the median of those run medians over the rounds and
  their min-max.
- Tokens/s: world size x micro-batch x sequence length / median step time.
- Peak memory: on GPU `torch.cuda.max_memory_allocated()` over the measured steps; on CPU the process's
  peak resident set (VmHWM, reset after warm-up: the Python process, torch and all libraries included).
  The largest rank.
- All-gather calls and GiB per step: every `torch.distributed` all-gather call (`all_gather_into_tensor`,
  `all_gather_single`, `_all_gather_base`, `all_gather`; a call that delegates to another counts once) and
  the bytes of its output, mean over the measured steps. ZeRO-3 at world size 1 issues none (it copies its
  single partition); so does FSDP2 on torch 2.13 (`FSDPParamGroup` skips the collective at world size 1);
  the counter reports what the installed torch did.
  "ZeRO gathered" is what the ZeRO-3 param coordinator gathered (`zero3_ac.utils.gather_meter.GatherMeter`,
  the same instrument on stock and fork), which counts at world size 1 too.
- Host time per module call: one extra step after the measured ones runs under `torch.profiler` while a
  global forward pre-hook counts `nn.Module` calls (forward and recompute). Busy time of that step: on GPU
  the union of all CUDA kernel, copy and memset intervals; on CPU the union of outermost operator events
  (`aten::`, `c10d::`, `fsdp::`, `_c10d_functional::`). Host time per module call: on GPU (median
  unprofiled step time - busy time) / module calls, the time the GPU sits idle per module call (the host
  falling behind, plus communication waits that nothing overlaps); on CPU (profiled step time - busy
  time) / module calls, the step's time outside operators (Python, hooks, framework bookkeeping, waits)
  per module call, both from the profiled step since the profiler stretches the operators it records.

Where the peers' settings differ:
- plain: the same PEFT model and checkpointing on one device, no sharding, world size 1 only; torch AdamW
  on the trainable params in their own dtype; `clip_grad_norm_(1.0)`. The base in the run's dtype, PEFT's
  LoRA adapters fp32 (stored, updated and computed in fp32) as under ZeRO-3 with DeepSpeed 0.19.8
  (Note: [Adapter dtypes under ZeRO-3 bf16] in benchmarks/dtypes.py; runs before 2026-12-02 cast the
  adapters to bf16 for plain and FSDP2: their rows say "not recorded").
- fsdp2: as plain, then `fully_shard` on every `LlamaDecoderLayer` and on the root, after PEFT wrapping,
  `MixedPrecisionPolicy()` (no cast: every param computes in its own dtype, gradients reduced in it). The
  full fine-tune: params, gradients and AdamW state bf16 on GPU, no fp32 master weights.
- stock / fork: DeepSpeed ZeRO-3 with its defaults, `bf16.enabled` on GPU: fp32 master weights and fp32
  AdamW state for the trainable params (frozen params bf16 only; LoRA adapters fp32 on 0.19.8), torch
  AdamW as the client optimizer, `gradient_clipping 1.0`, params created partitioned (`zero.Init`) on GPU; on CPU
  `stage3_param_persistence_threshold 0`. Stock and fork differ only in `ZERO3_AC_DISABLE=1`.
  For the full fine-tune that is 16 bytes per param of optimizer-side state against 8 for plain and FSDP2.
- qlora (every system): the base is loaded by transformers in 4 bits (bitsandbytes NF4, bf16 quant storage,
  compute in the run's dtype) from a bf16 checkpoint of the same random init, then
  `prepare_model_for_kbit_training` (the unquantized params in fp32) and LoRA r16 on every linear layer.
  stock / fork: no `zero.Init` (transformers never quantizes under it): each rank loads the whole 4-bit model
  and `deepspeed.initialize` partitions the 4-bit weights like any frozen param, their `quant_state` whole on
  every rank (Note: [4-bit weights under ZeRO-3] in examples/qlora_lora.py). plain: every param but the 4-bit
  weights cast to the run's dtype. fsdp2: every param but the 4-bit weights cast to bf16, the storage dtype,
  and `param_dtype` bf16 (the policy casts the packed weights too, and any other dtype breaks their packing),
  so on CPU FSDP2's QLoRA runs its unquantized layers and adapters in bf16 where the others run fp32.
- On CPU everything is fp32 (no mixed precision), gloo; QLoRA's 4-bit layers compute in fp32.
- Param dtypes / computes in: the elements of trainable and frozen params by dtype, and the output dtype
  of the first LoRA `lora_A` linear and of the first base linear in the first step.
- All: AdamW lr 1e-4, random token ids (the same seed per rank for every system), labels = inputs.
"""


def summarize(runs):
    """One row per (shape, world, system, mode, ac): medians over the rounds that ran without error."""
    groups = {}
    for run in runs:
        key = (run["shape"], run["world"], run["system"], run["mode"], run["ac"])
        groups.setdefault(key, []).append(run)
    rows = []
    for key in sorted(groups, key=lambda k: (k[0], k[1], MODE_ORDER.index(k[3]), k[4], SYSTEM_ORDER.index(k[2]))):
        shape, world, system, mode, ac = key
        ok = [run for run in groups[key] if not run["error"]]
        row = dict(shape=shape, world=world, system=system, mode=mode, ac=ac, runs=len(groups[key]),
                   errors=sorted({run["error"] for run in groups[key] if run["error"]}))
        if ok:
            medians = [run["step_s_median"] for run in ok]

            def median(name):
                values = [run[name] for run in ok if run.get(name) is not None]
                return statistics.median(values) if values else None

            row.update(step_s=statistics.median(medians), step_s_min=min(medians), step_s_max=max(medians),
                       step_s_rounds=[round(value, 4) for value in medians], tokens_per_s=median("tokens_per_s"),
                       peak_mem_gib=max(run["peak_mem_gib"] for run in ok), peak_mem_kind=ok[0]["peak_mem_kind"],
                       allgather_calls=median("allgather_calls_per_step"),
                       allgather_gib=median("allgather_gib_per_step"),
                       module_calls=median("module_calls_per_step"), busy_s=median("busy_s"),
                       host_us_per_module_call=median("host_us_per_module_call"),
                       step_s_fastest=min(min(run["step_s"]) for run in ok),
                       step_s_slowest=max(max(run["step_s"]) for run in ok),
                       param_dtypes=ok[0].get("param_dtypes"), compute_dtypes=ok[0].get("compute_dtypes"))
            phases = [run["zero_gathered_gib_by_phase"] for run in ok if "zero_gathered_gib_by_phase" in run]
            if phases:
                row["zero_gathered_gib_by_phase"] = {phase: statistics.median(p[phase] for p in phases)
                                                     for phase in phases[0]}
        rows.append(row)
    return rows


def _number(value, digits):
    return "" if value is None else f"{value:.{digits}f}"


def markdown(rows):
    lines = ["| shape | world | mode | checkpointing | system | step s median (min-max; rounds) | tokens/s | peak GiB "
             "| all-gather calls / GiB per step | ZeRO gathered GiB fwd/rec/bwd | module calls/step "
             "| host us/module call | param dtypes | computes in |", "|---" * 14 + "|"]
    for row in rows:
        head = f"| {row['shape']} | {row['world']} | {row['mode']} | {row['ac']} | {row['system']} |"
        if "step_s" not in row:
            lines.append(f"{head} error: {'; '.join(row['errors'])} | | | | | | | | |")
            continue
        phases = row.get("zero_gathered_gib_by_phase")
        gathered = ("/".join(f"{phases.get(p, 0.0):.4g}" for p in ("forward", "recompute", "backward"))
                    if phases else "")
        note = f" ({len(row['errors'])} error)" if row["errors"] else ""
        lines.append(f"{head} {row['step_s']:.4f} ({row['step_s_min']:.4f}-{row['step_s_max']:.4f}; "
                     f"{len(row['step_s_rounds'])}){note} | {row['tokens_per_s']:.0f} | {row['peak_mem_gib']:.3f} | "
                     f"{row['allgather_calls']:.0f} / {row['allgather_gib']:.4g} | {gathered} | "
                     f"{_number(row['module_calls'], 0)} | {_number(row['host_us_per_module_call'], 1)} | "
                     f"{_dtypes(row)} |")
    return "\n".join(lines)


def _dtypes(row):
    """"param dtypes | computes in" cells; "not recorded" for runs from before they were."""
    if not row.get("param_dtypes"):
        return "not recorded | not recorded"
    compute = ", ".join(f"{role} {dtype}" for role, dtype in (row.get("compute_dtypes") or {}).items())
    return f"{describe(row['param_dtypes'])} | {compute}"


def line(run):
    label = f"{run['shape']} world {run['world']} {run['system']:<5} {run['mode']:<4} {run['ac']:<12} round {run['round']}"
    if run["error"]:
        return f"{label}  ERROR {run['error']}"
    return (f"{label}  {run['step_s_median']:.4f} s  {run['tokens_per_s']:.0f} tok/s  peak {run['peak_mem_gib']:.3f} GiB  "
            f"all-gather {run['allgather_calls_per_step']:.0f} calls {run['allgather_gib_per_step']:.3f} GiB  "
            f"host {_number(run['host_us_per_module_call'], 1)} us/call")


def readme(document):
    settings, env = document["settings"], document["environment"]
    status = "" if document["complete"] else "\n**Incomplete**: the run stopped early (budget, or still running).\n"
    if document.get("note"):
        status += f"\n{document['note']}\n"
    versions = ", ".join(f"{name} {value}" for name, value in env.items())
    return (f"# Peer benchmark: {settings['shape']} shape on {settings['device']}\n{status}\n"
            f"Command (from the repository root):\n\n    {document['command']}\n\n"
            f"Environment: {versions}.\n\nModel `{settings['model']}`, sequence {settings['seq']}, micro-batch "
            f"{settings['mbs']} per rank, {settings['warmup']} warm-up + {settings['steps']} measured steps per run, "
            f"{settings['rounds']} round(s) asked, world sizes {settings['world']}. Raw runs: results.json; "
            f"chart: peers.png.\n\n{markdown(document['summary'])}\n\n{document.get('notes', NOTES)}")


def chart(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [row for row in rows if "step_s" in row]
    groups = list(dict.fromkeys((row["shape"], row["world"], row["mode"], row["ac"]) for row in rows))
    systems = [system for system in SYSTEM_ORDER if any(row["system"] == system for row in rows)]
    width = 0.8 / max(len(systems), 1)
    panels = (("step_s", "step time s (median, min-max over rounds)"), ("peak_mem_gib", "peak memory GiB"),
              ("host_us_per_module_call", "host us per module call"))
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5))
    for axis, (metric, title) in zip(axes, panels):
        for index, system in enumerate(systems):
            found = [next((row for row in rows if row["system"] == system and
                           (row["shape"], row["world"], row["mode"], row["ac"]) == group), None) for group in groups]
            values = [(row or {}).get(metric) or 0 for row in found]
            positions = [i + (index - (len(systems) - 1) / 2) * width for i in range(len(groups))]
            errors = None
            if metric == "step_s":
                errors = [[(row["step_s"] - row["step_s_min"]) if row else 0 for row in found],
                          [(row["step_s_max"] - row["step_s"]) if row else 0 for row in found]]
            axis.bar(positions, values, width=width, label=system, yerr=errors, capsize=2)
        axis.set_xticks(range(len(groups)))
        axis.set_xticklabels([f"{shape} w{world}\n{mode}\n{ac}" for shape, world, mode, ac in groups], fontsize=7)
        axis.set_title(title)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


SHAPE_NAMES = {"1.1b": "1.1B", "8b": "8B", "small": "small"}
MODE_NAMES = {"lora": "LoRA", "full": "full FT", "qlora": "QLoRA"}


def load_runs(directory):
    """The runs of a results directory: results.json's, else runs.jsonl's lines."""
    path = os.path.join(directory, "results.json")
    if os.path.exists(path):
        with open(path) as source:
            return json.load(source)["runs"]
    with open(os.path.join(directory, "runs.jsonl")) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def configuration_name(row, label=None):
    world = f" w{row['world']}" if row["world"] > 1 else ""
    name = (f"{SHAPE_NAMES.get(row['shape'], row['shape'])}{world} {MODE_NAMES.get(row['mode'], row['mode'])}\n"
            f"{row['ac'].replace('nonreentrant', 'non-reentrant')}")
    return f"{name}\n({label})" if label else name


def figure(sources, path, title):
    """One chart of the step times in several results: ``sources`` is [(directory, label or None)]."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [(configuration_name(row, label), row) for directory, label in sources
            for row in summarize(load_runs(directory)) if "step_s" in row]
    groups = list(dict.fromkeys(name for name, _ in rows))
    systems = [system for system in SYSTEM_ORDER if any(row["system"] == system for _, row in rows)]
    width = 0.8 / max(len(systems), 1)
    plot, axis = plt.subplots(figsize=(max(7.0, 1.9 * len(groups)), 4.8))
    for index, system in enumerate(systems):
        for position, group in enumerate(groups):
            row = next((row for name, row in rows if name == group and row["system"] == system), None)
            if row is None:
                continue
            x = position + (index - (len(systems) - 1) / 2) * width
            errors = [[row["step_s"] - row["step_s_fastest"]], [row["step_s_slowest"] - row["step_s"]]]
            axis.bar(x, row["step_s"], width=width, color=f"C{SYSTEM_ORDER.index(system)}", yerr=errors, capsize=2,
                     error_kw=dict(linewidth=0.8), label=system if position == next(
                         i for i, g in enumerate(groups) if any(n == g and r["system"] == system for n, r in rows))
                     else None)
            axis.annotate(f"{row['step_s']:.3f}", (x, row["step_s_slowest"]), textcoords="offset points",
                          xytext=(0, 2), ha="center", fontsize=6.5)
    axis.set_xticks(range(len(groups)))
    axis.set_xticklabels(groups, fontsize=8)
    axis.set_ylabel("step time s")
    axis.set_title(f"{title}\nbar: median of the runs' median step; whisker: fastest to slowest measured step",
                   fontsize=9)
    axis.legend(fontsize=8)
    plot.tight_layout()
    plot.savefig(path, dpi=120)
    plt.close(plot)
    return [row for _, row in rows]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="results directories; with --png, each may end in =LABEL")
    parser.add_argument("--png", help="draw one chart of all the results here, and write nothing else")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    if args.png:
        sources = [(text.split("=", 1)[0], text.split("=", 1)[1] if "=" in text else None) for text in args.results]
        print(markdown(figure(sources, args.png, args.title)))
        return
    [results_dir] = args.results
    with open(os.path.join(results_dir, "results.json")) as source:
        document = json.load(source)
    document["summary"] = summarize(document["runs"])
    with open(os.path.join(results_dir, "README.md"), "w") as out:
        out.write(readme(document))
    chart(document["summary"], os.path.join(results_dir, "peers.png"))
    print(markdown(document["summary"]))


if __name__ == "__main__":
    main()
