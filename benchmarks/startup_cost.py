"""What the installed package costs every Python process at start-up.

Runs ``python -c pass`` with the environment's normal start-up (site-packages, so ``zero3_ac.pth``)
and with ``-I -S`` (no site at all), interleaved, and reports the medians of wall time and peak
RSS and their ratio. The target (issue 21): at most 1.3x + 50 ms of the ``-I -S`` run. The normal
start-up also runs every other ``.pth`` file in site-packages (setuptools' ``distutils-precedence.pth``).

    python benchmarks/startup_cost.py [--runs 30] [--python .venv/ds-0.19.8/bin/python]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {"site (zero3_ac.pth)": [], "-I -S": ["-I", "-S"]}


def run_once(python, flags, cwd):
    """Wall seconds and peak RSS (MiB, from the child's own rusage) of one ``python <flags> -c pass``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "ZERO3_AC_"))}
    start = time.perf_counter()
    process = subprocess.Popen([python, *flags, "-c", "pass"], cwd=cwd, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{python} {' '.join(flags)} -c pass exited with {process.returncode}")
    return wall, usage.ru_maxrss / 1024


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    samples = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as outside_the_checkout:
        for name, flags in VARIANTS.items():
            run_once(args.python, flags, outside_the_checkout)  # warm the page cache
        for _ in range(args.runs):
            for name, flags in VARIANTS.items():
                samples[name].append(run_once(args.python, flags, outside_the_checkout))
    medians = {name: (statistics.median(wall for wall, _ in runs), statistics.median(rss for _, rss in runs))
               for name, runs in samples.items()}
    print(f"{args.python}, {args.runs} runs of each, interleaved; medians")
    print("| start-up | wall (ms) | peak RSS (MiB) |")
    print("|---|---|---|")
    for name, (wall, rss) in medians.items():
        print(f"| {name} | {wall * 1000:.1f} | {rss:.1f} |")
    (site_wall, site_rss), (bare_wall, bare_rss) = medians.values()
    budget = 1.3 * bare_wall + 0.050
    print(f"\nratio site / -I -S: wall {site_wall / bare_wall:.2f}x, RSS {site_rss / bare_rss:.2f}x; "
          f"target wall <= 1.3 x {bare_wall * 1000:.1f} + 50 = {budget * 1000:.1f} ms: "
          f"{'met' if site_wall <= budget else 'NOT met'}")
    return 0 if site_wall <= budget else 1


if __name__ == "__main__":
    sys.exit(main())
