"""What the installed package costs every Python process at start-up.

Runs ``python -c pass`` with the environment's normal start-up (site-packages, so ``zero3_ac.pth``)
and with ``-I -S`` (no site at all), interleaved, and reports the medians of wall time and peak
RSS and their ratio. The target (issue 21): at most 1.3x + 50 ms of the ``-I -S`` run. The normal
start-up also runs the ``site`` module and every other ``.pth`` file in site-packages (setuptools'
``distutils-precedence.pth``); the third row isolates the package: ``-I -S`` plus the import that
``zero3_ac.pth`` makes.

    python benchmarks/startup_cost.py [--runs 30] [--python .venv/ds-0.19.8/bin/python]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time



def variants(python):
    """The command lines compared, by name (the .pth is the one the interpreter's own site-packages holds)."""
    site_packages = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                            text=True).strip()
    pth_import = f"import sys; sys.path.append({site_packages!r}); exec(open(sys.path[-1] + '/zero3_ac.pth').read())"
    return {"site (zero3_ac.pth)": ["-c", "pass"], "-I -S": ["-I", "-S", "-c", "pass"],
            "-I -S + the .pth's import": ["-I", "-S", "-c", pth_import]}


def run_once(python, args, cwd):
    """Wall seconds and peak RSS (MiB) of one ``python <args>``.

    The RSS comes from GNU time (``/usr/bin/time -f %M``), a small C parent: a child forked from this
    Python process would report this process's RSS as its own peak when that is larger (Linux keeps
    the pre-exec high-water mark). Without GNU time the RSS column is empty.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "ZERO3_AC_"))}
    timer = ["/usr/bin/time", "-f", "%M"] if os.path.exists("/usr/bin/time") else []
    start = time.perf_counter()
    result = subprocess.run([*timer, python, *args], cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{python} {' '.join(args)} exited with {result.returncode}: {result.stderr}")
    return wall, int(result.stderr.split()[-1]) / 1024 if timer else float("nan")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    commands = variants(args.python)
    samples = {name: [] for name in commands}
    with tempfile.TemporaryDirectory() as outside_the_checkout:
        for name, command in commands.items():
            run_once(args.python, command, outside_the_checkout)  # warm the page cache
        for _ in range(args.runs):
            for name, command in commands.items():
                samples[name].append(run_once(args.python, command, outside_the_checkout))
    medians = {name: (statistics.median(wall for wall, _ in runs), statistics.median(rss for _, rss in runs))
               for name, runs in samples.items()}
    print(f"{args.python}, {args.runs} runs of each, interleaved; medians")
    print("| start-up | wall (ms) | peak RSS (MiB) |")
    print("|---|---|---|")
    for name, (wall, rss) in medians.items():
        print(f"| {name} | {wall * 1000:.1f} | {rss:.1f} |")
    (site_wall, site_rss), (bare_wall, bare_rss), _ = medians.values()
    budget = 1.3 * bare_wall + 0.050
    print(f"\nratio site / -I -S: wall {site_wall / bare_wall:.2f}x, RSS {site_rss / bare_rss:.2f}x; "
          f"target wall <= 1.3 x {bare_wall * 1000:.1f} + 50 = {budget * 1000:.1f} ms: "
          f"{'met' if site_wall <= budget else 'NOT met'}")
    return 0 if site_wall <= budget else 1


if __name__ == "__main__":
    sys.exit(main())
