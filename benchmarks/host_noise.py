"""Where the step-to-step noise of a host-bound GPU step comes from: the host's CPU, Python's collector or the GPU.

    python benchmarks/host_noise.py --system plain --model tinyllama --rounds 80 --out benchmarks/results/<dir>

One process, world size 1, the peer benchmark's LoRA step (``profile_step.one_gpu_step``). After 3 warm-up steps,
each of ``--rounds`` rounds times, back to back:

- ``step``: a training step with the garbage collector on, as every benchmark runs it;
- ``step_gc_off``: a training step with the collector off (``gc.collect()`` before it, outside the timing);
- ``python``: a fixed pure-Python workload (dict updates, no torch), about 50 ms: the host's own speed;
- ``gpu``: a fixed chain of bf16 matmuls, synchronized, about 40 ms: the GPU's own speed.

If the steps' spread is the host's, ``python`` spreads as much and its time follows the step's in the same round;
if it is the collector's, ``step_gc_off`` spreads less than ``step``. Writes ``noise-TAG.json`` (every time) and
prints, per series, the median, the coefficient of variation (standard deviation over mean) and the p10-p90 range,
and the correlation of each round's step time with its ``python`` time.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_worker import SYSTEMS  # noqa: E402
from profile_step import one_gpu_step  # noqa: E402
from workload import MODELS  # noqa: E402

PYTHON_WORK_ITEMS = 600_000
GPU_WORK_MATMULS = 200


def python_work():
    table = {}
    for item in range(PYTHON_WORK_ITEMS):
        key = item & 1023
        table[key] = table.get(key, 0) + item
    return table


def gpu_work(matrix):
    product = matrix
    for _ in range(GPU_WORK_MATMULS):
        product = torch.mm(matrix, product)
    torch.cuda.synchronize()


def timed(function, *arguments):
    start = time.perf_counter()
    function(*arguments)
    return time.perf_counter() - start


def collected_then_timed(step):
    gc.collect()
    gc.disable()
    try:
        return timed(step)
    finally:
        gc.enable()


def summary(values):
    array = numpy.asarray(values)
    low, high = numpy.percentile(array, [10, 90])
    return dict(median=statistics.median(values), cv=float(array.std() / array.mean()), p10=float(low),
                p90=float(high))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=SYSTEMS, default="plain")
    parser.add_argument("--model", choices=sorted(MODELS), default="tinyllama")
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--tag", default=None, help="default: SYSTEM-MODEL")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tag = args.tag or f"{args.system}-{args.model}"
    step = one_gpu_step(args.system, args.model)
    matrix = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    for _ in range(3):
        step()
    gpu_work(matrix)
    series = {"step": [], "step_gc_off": [], "python": [], "gpu": []}
    for _ in range(args.rounds):
        series["step"].append(timed(step))
        series["step_gc_off"].append(collected_then_timed(step))
        series["python"].append(timed(python_work))
        series["gpu"].append(timed(gpu_work, matrix))
    result = dict(system=args.system, model=args.model, rounds=args.rounds, times_s=series,
                  summary={name: summary(values) for name, values in series.items()},
                  step_python_correlation=float(numpy.corrcoef(series["step"], series["python"])[0, 1]),
                  step_gc_off_python_correlation=float(numpy.corrcoef(series["step_gc_off"], series["python"])[0, 1]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"noise-{tag}.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    for name, entry in result["summary"].items():
        print(f"{tag} {name}: median {entry['median']:.4f} s, cv {entry['cv']:.3f}, "
              f"p10-p90 {entry['p10']:.4f}-{entry['p90']:.4f}")
    print(f"{tag} correlation of step and python per round: {result['step_python_correlation']:.2f} (gc on), "
          f"{result['step_gc_off_python_correlation']:.2f} (gc off)")


if __name__ == "__main__":
    main()
