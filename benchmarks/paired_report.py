"""The paired benchmark's summary: median paired ratios with bootstrap intervals, the A/A check, a table, a PNG.

    python benchmarks/paired_report.py RESULTS_DIR     # rewrites README.md and paired.png from runs.jsonl

Note: [Paired ratio]
A cycle runs one block of steps of every system of a round, one system after the other (paired.py). The
paired ratio of systems A and B in a cycle is A's block median over B's. Per pair, the report gives the
median of those ratios over every cycle of every round, and a 95% percentile bootstrap interval of that
median (10,000 resamples of the cycles, seed 0; ``scipy.stats.bootstrap`` where scipy is installed, else
numpy). The A/A pair (a system against a second copy of itself, in its own processes) passes when its
interval lies inside [0.97, 1.03]: then a difference of 3% or more between two systems is no accident of
process placement or drift. An A/A pair that fails also gets an estimate of the cycles after which its
interval would lie inside the band, were the spread of its paired ratios the same: the interval narrows as one
over the square root of the cycles, around the same median. There is no estimate where the median itself lies
outside the band.

Two more columns tell where the noise is. Per system: the spread of its steps (coefficient of variation, the
median over its rounds) and the correlation of each step's log with the next one's in its block, the part of the
noise that lasts longer than a step. Per pair: the correlation of the logs of the two systems' block medians in
the same cycle, the part of the noise the two share, which the pairing takes out.
"""

import argparse
import json
import math
import os
import statistics

import numpy

from dtypes import describe

AA_BAND = (0.97, 1.03)
CONFIDENCE = 0.95
RESAMPLES = 10_000
SYSTEM_ORDER = ("plain", "fsdp2", "fsdp2_compile", "stock", "deepcompile", "fork")


def load(directory):
    with open(os.path.join(directory, "runs.jsonl")) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def bootstrap_median(values):
    """(low, high): the 95% percentile bootstrap interval of the median of ``values``."""
    values = numpy.asarray(values, dtype=float)
    if len(values) < 2:
        return (float(values[0]), float(values[0])) if len(values) else (None, None)
    try:
        from scipy.stats import bootstrap
    except ImportError:
        generator = numpy.random.default_rng(0)
        medians = numpy.median(generator.choice(values, size=(RESAMPLES, len(values))), axis=1)
        low, high = numpy.quantile(medians, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
        return float(low), float(high)
    result = bootstrap((values,), numpy.median, confidence_level=CONFIDENCE, n_resamples=RESAMPLES,
                       method="percentile", random_state=numpy.random.default_rng(0))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def _block_medians(row):
    return [statistics.median(block) if block else None for block in row["block_s"]]


def configurations(rows):
    """(shape, world, mode, ac) in the order they first ran."""
    return list(dict.fromkeys((row["shape"], row["world"], row["mode"], row["ac"]) for row in rows))


def _key(row):
    return row["shape"], row["world"], row["mode"], row["ac"]


def label_order(labels):
    return sorted(labels, key=lambda label: (SYSTEM_ORDER.index(label.split("#")[0]), label))


def _correlation(pairs):
    """Pearson's r of the logs of ``(x, y)`` pairs; None under three pairs or without spread."""
    if len(pairs) < 3:
        return None
    x, y = numpy.log(numpy.asarray(pairs, dtype=float)).T
    if x.std() == 0 or y.std() == 0:
        return None
    return float(numpy.corrcoef(x, y)[0, 1])


def step_spread(rows):
    """(coefficient of variation of the steps, median over the rounds; correlation of each step with the next one
    of its block): how much a system's steps spread, and how much of that lasts longer than a step."""
    spreads = [statistics.pstdev(row["step_s"]) / statistics.mean(row["step_s"]) for row in rows if row["step_s"]]
    consecutive = [(block[i], block[i + 1]) for row in rows for block in row["block_s"] for i in range(len(block) - 1)]
    return (statistics.median(spreads) if spreads else None), _correlation(consecutive)


def systems_summary(rows):
    """Per configuration and label: median step time over its block medians with their bootstrap interval,
    the steps' spread (:func:`step_spread`), peak memory, dtypes."""
    summary = []
    for config in configurations(rows):
        ran = [row for row in rows if _key(row) == config]
        for label in label_order(dict.fromkeys(row["label"] for row in ran)):
            mine = [row for row in ran if row["label"] == label]
            ok = [row for row in mine if not row["error"]]
            entry = dict(zip(("shape", "world", "mode", "ac"), config), label=label, rounds=len(ok),
                         errors=sorted({row["error"] for row in mine if row["error"]}))
            medians = [value for row in ok for value in _block_medians(row) if value is not None]
            if medians:
                low, high = bootstrap_median(medians)
                step_cv, step_lag1 = step_spread(ok)
                entry.update(step_s=statistics.median(medians), step_s_low=low, step_s_high=high,
                             steps=sum(len(row["step_s"]) for row in ok), step_cv=step_cv, step_lag1=step_lag1,
                             peak_mem_gib=max(row["peak_mem_gib"] for row in ok if "peak_mem_gib" in row),
                             param_dtypes=ok[0].get("param_dtypes"), compute_dtypes=ok[0].get("compute_dtypes"))
            summary.append(entry)
    return summary


def paired_block_medians(rows, config, first, second):
    """Every cycle's (first's, second's) block medians over the rounds of ``config`` where both ran."""
    medians = []
    for round_index in sorted({row["round"] for row in rows}):
        found = {row["label"]: row for row in rows if _key(row) == config and row["round"] == round_index}
        if first not in found or second not in found or found[first]["error"] or found[second]["error"]:
            continue
        for a, b in zip(_block_medians(found[first]), _block_medians(found[second])):
            if a is not None and b is not None:
                medians.append((a, b))
    return medians


def pair_list(labels, reference):
    """(first, second): ``reference`` against every other label (its A/A copy included), then every two other
    systems, the later in SYSTEM_ORDER first (fsdp2 / plain)."""
    pairs = [(reference, other) for other in labels if other != reference] if reference in labels else []
    others = [label for label in labels if label != reference and "#" not in label]
    return pairs + [(later, earlier) for index, earlier in enumerate(others) for later in others[index + 1:]]


def pairs_summary(rows, reference, other_version=False):
    """Per configuration and pair of :func:`pair_list`: the median paired ratio, its interval, the A/A verdict
    (none where ``other_version``: the copy ran another version of the fork, ``peers.py --aa-path``, an A/B)."""
    summary = []
    for config in configurations(rows):
        labels = label_order(dict.fromkeys(row["label"] for row in rows if _key(row) == config))
        for first, second in pair_list(labels, reference):
            medians = paired_block_medians(rows, config, first, second)
            ratios = [a / b for a, b in medians]
            entry = dict(zip(("shape", "world", "mode", "ac"), config), first=first, second=second,
                         pairs=len(ratios), aa=second.split("#")[0] == first and not other_version, cycle_correlation=_correlation(medians))
            if ratios:
                low, high = bootstrap_median(ratios)
                entry.update(ratio=statistics.median(ratios), low=low, high=high)
                if entry["aa"]:
                    entry["aa_pass"] = AA_BAND[0] <= low and high <= AA_BAND[1]
                    entry["aa_cycles_for_band"] = cycles_for_band(entry)
            summary.append(entry)
    return summary


def cycles_for_band(entry):
    """The cycles after which an A/A interval would lie inside the band at this pair's spread (see [Paired
    ratio]); None where the median lies outside the band."""
    ratio, low, high = entry["ratio"], entry["low"], entry["high"]
    if not AA_BAND[0] < ratio < AA_BAND[1]:
        return None
    # The interval may shrink by at most this factor on each side.
    shrink = min((ratio - AA_BAND[0]) / (ratio - low) if ratio > low else math.inf,
                 (AA_BAND[1] - ratio) / (high - ratio) if high > ratio else math.inf)
    return entry["pairs"] if shrink >= 1 else math.ceil(entry["pairs"] / shrink ** 2)


def _number(value):
    return "-" if value is None else f"{value:.2f}"


def _config_text(entry):
    return f"{entry['shape']} w{entry['world']} {entry['mode']} {entry['ac']}"


def markdown(systems, pairs):
    lines = ["| configuration | system | step s, median of block medians [95% CI] | steps | step CV, r with the next "
             "| peak GiB | param dtypes | computes in |", "|---|---|---|---|---|---|---|---|"]
    for entry in systems:
        head = f"| {_config_text(entry)} | {entry['label']} |"
        if "step_s" not in entry:
            lines.append(f"{head} error: {'; '.join(entry['errors'])} | | | | | |")
            continue
        compute = ", ".join(f"{role} {dtype}" for role, dtype in (entry["compute_dtypes"] or {}).items())
        lines.append(f"{head} {entry['step_s']:.4f} [{entry['step_s_low']:.4f}, {entry['step_s_high']:.4f}] | "
                     f"{entry['steps']} | {_number(entry['step_cv'])}, {_number(entry['step_lag1'])} | "
                     f"{entry['peak_mem_gib']:.3f} | {describe(entry['param_dtypes'] or {})} | "
                     f"{compute} |")
    lines += ["", "| configuration | pair | median paired ratio [95% CI] | pairs | block medians' r | "
              "A/A inside [0.97, 1.03] |", "|---|---|---|---|---|---|"]
    for entry in pairs:
        head = f"| {_config_text(entry)} | {entry['first']} / {entry['second']} |"
        if "ratio" not in entry:
            lines.append(f"{head} no pair without error | 0 | | |")
            continue
        verdict = ("**yes**" if entry["aa_pass"] else "**no**") if entry["aa"] else ""
        lines.append(f"{head} {entry['ratio']:.3f} [{entry['low']:.3f}, {entry['high']:.3f}] | {entry['pairs']} | "
                     f"{_number(entry['cycle_correlation'])} | {verdict} |")
    return "\n".join(lines)


def aa_verdicts(pairs):
    """One line per A/A pair: whether its interval lies inside the band."""
    return [f"A/A {_config_text(entry)} {entry['first']} / {entry['second']}: "
            + (f"{entry['ratio']:.3f} [{entry['low']:.3f}, {entry['high']:.3f}] "
               f"{'inside' if entry['aa_pass'] else 'NOT inside'} [{AA_BAND[0]}, {AA_BAND[1]}]"
               + _cycles_text(entry) if "ratio" in entry else "no pair without error")
            for entry in pairs if entry["aa"]]


def _cycles_text(entry):
    if entry["aa_pass"]:
        return ""
    cycles = entry["aa_cycles_for_band"]
    if cycles is None:
        return "; the median itself lies outside the band"
    return f"; it would take about {cycles} cycles at this spread ({entry['pairs']} ran)"


def readme(document, systems, pairs):
    env = document["environment"]
    settings = document["settings"]
    status = "" if document["complete"] else "\n**Incomplete**: the run stopped early (budget, or still running).\n"
    if document.get("note"):
        status += f"\n{document['note']}\n"
    versions = ", ".join(f"{name} {value}" for name, value in env.items())
    verdicts = "\n".join(f"- {line}" for line in aa_verdicts(pairs)) or "- no A/A pair ran (`--aa`)"
    if settings.get("aa_path"):
        verdicts = (f"- no A/A pair ran: {settings['aa']}#2 is {settings['aa']} with the zero3_ac package of "
                    f"`{settings['aa_path']}` (`--aa-path`), a paired A/B of two versions")
    return (f"# Paired benchmark: {settings['shape']} shape on {settings['device']}\n{status}\n"
            f"Command (from the repository root):\n\n    {document['command']}\n\n"
            f"Environment: {versions}.\n\nModel `{settings['model']}`, sequence {settings['seq']}, micro-batch "
            f"{settings['mbs']} per rank, {settings['warmup']} warm-up steps, {settings['steps']} measured steps "
            f"per system per round in blocks of {settings['block']}, {settings['rounds']} round(s) asked. Raw rows: "
            f"runs.jsonl; chart: paired.png.\n\n{verdicts}\n\n{markdown(systems, pairs)}\n\n"
            f"{__doc__.split('Note: ', 1)[1]}")


def chart(systems, pairs, path):
    """Left: step time per system per configuration with its interval; right: the paired ratios."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    measured = [entry for entry in systems if "step_s" in entry]
    configs = list(dict.fromkeys(_config_text(entry) for entry in measured))
    labels = label_order(dict.fromkeys(entry["label"] for entry in measured))
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(labels), 1)
    for index, label in enumerate(labels):
        found = [next((e for e in measured if e["label"] == label and _config_text(e) == c), None) for c in configs]
        values = [entry["step_s"] if entry else 0 for entry in found]
        errors = [[entry["step_s"] - entry["step_s_low"] if entry else 0 for entry in found],
                  [entry["step_s_high"] - entry["step_s"] if entry else 0 for entry in found]]
        positions = [i + (index - (len(labels) - 1) / 2) * width for i in range(len(configs))]
        system = label.split("#")[0]
        left.bar(positions, values, width=width, yerr=errors, capsize=3, label=label,
                 color=f"C{SYSTEM_ORDER.index(system)}", hatch="//" if system != label else None,
                 edgecolor="white" if system != label else None)
    left.set_xticks(range(len(configs)))
    left.set_xticklabels(configs, fontsize=8)
    left.set_ylabel("step time s (median, 95% CI)")
    left.legend(fontsize=8)
    ratios = [entry for entry in pairs if "ratio" in entry]
    names = [f"{_config_text(e)}\n{e['first']} / {e['second']}" for e in ratios]
    right.errorbar([e["ratio"] for e in ratios], range(len(ratios)), fmt="o", capsize=4,
                   xerr=[[e["ratio"] - e["low"] for e in ratios], [e["high"] - e["ratio"] for e in ratios]])
    right.axvspan(*AA_BAND, color="0.85", label="A/A band [0.97, 1.03]")
    right.axvline(1.0, color="0.5", linewidth=0.8)
    right.set_yticks(range(len(ratios)))
    right.set_yticklabels(names, fontsize=8)
    right.invert_yaxis()
    right.set_xlabel("median paired ratio (95% bootstrap CI)")
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write(directory, document, rows):
    """README.md and paired.png in ``directory`` from ``rows``; returns the README text."""
    systems = systems_summary(rows)
    pairs = pairs_summary(rows, document["settings"]["reference"], bool(document["settings"].get("aa_path")))
    text = readme(document, systems, pairs)
    with open(os.path.join(directory, "README.md"), "w") as out:
        out.write(text)
    if any("step_s" in entry for entry in systems):
        chart(systems, pairs, os.path.join(directory, "paired.png"))
    return systems, pairs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results_dir")
    args = parser.parse_args()
    with open(os.path.join(args.results_dir, "settings.json")) as source:
        document = json.load(source)
    systems, pairs = write(args.results_dir, document, load(args.results_dir))
    print(markdown(systems, pairs))
    print("\n".join(aa_verdicts(pairs)))


if __name__ == "__main__":
    main()
