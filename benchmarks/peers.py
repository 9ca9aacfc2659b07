"""Plain PyTorch, FSDP2, stock DeepSpeed ZeRO-3 and the fork on one workload, interleaved in rounds.

    python benchmarks/peers.py --device cpu --shape small --world 1,2 --rounds 2 --out benchmarks/results/x
    python benchmarks/peers.py --device cuda --shape 1.1b --systems plain,fsdp2,stock,fork --modes lora,full
    python benchmarks/peers.py --device cuda --shape 8b --systems stock,fork --modes qlora --out benchmarks/results/y

Every (world size, system, mode, checkpointing) configuration runs in a fresh set of rank processes;
a round runs every configuration once (each round starts one configuration later, so that no
configuration always runs first), and rounds repeat until ``--rounds`` or ``--budget-s``. Stock and
fork differ only in ``ZERO3_AC_DISABLE=1`` in the child environment. Writes results.json (every run
and the summary), README.md (the table, the command line, definitions) and peers.png to ``--out``.
Definitions and where the peers' settings differ: ``peer_report.NOTES``. ``--modes qlora`` (bitsandbytes)
first saves the random-init base as a bf16 checkpoint in a temporary directory, from a child process;
every QLoRA run loads it in 4 bits, as a user's script loads a downloaded one. Every run is also a line of
runs.jsonl, with the params' dtypes (trainable and frozen) and the dtypes the adapters and base layers
compute in (Note: [Adapter dtypes under ZeRO-3 bf16] in dtypes.py).

Paired rounds (``--paired``, paired.py), to compare systems within a few percent:

    python benchmarks/peers.py --paired --device cuda --shape 1.1b --systems plain,fsdp2,fork --aa fork \\
        --modes lora --ac nonreentrant --steps 150 --rounds 1 --out $OUT/1.1b

every system of a configuration runs at once in its own fresh processes (a round), and they take turns
running ``--block`` steps; ``--steps`` measured steps each per round (default 40). Options of this mode:
``--aa SYSTEM`` adds a second copy of SYSTEM (label ``SYSTEM#2``, its own processes) for an A/A check;
``--reference SYSTEM`` (default fork, else the first of ``--systems``) is the numerator of its ratio to every
other system (the others are paired too, the later in plain, fsdp2, stock, fork over the earlier);
``--block N`` (default 1 on cuda, where the host's slow spells last a few steps and only steps
taken one after the other share them; 5 on cpu). Writes runs.jsonl (one row per system per round, every step
time), settings.json, README.md (median paired ratio per pair with a bootstrap interval, whether the A/A
interval lies inside [0.97, 1.03]) and paired.png; ``paired_report.py`` rewrites the last two. ``--budget-s``
and ``--rounds`` work as in the default mode; the profiled step, all-gather counts and module calls are not taken.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import paired  # noqa: E402
import paired_report  # noqa: E402
import peer_report  # noqa: E402
from peer_worker import DEFAULT_SYSTEMS, FORK_INSTALLED, SYSTEMS, worker  # noqa: E402
from spawn import start_ranks  # noqa: E402
from workload import save_random_base  # noqa: E402

SHAPES = {"small": "tiny", "1.1b": "tinyllama", "8b": "llama3-8b"}
MODES = ("lora", "full", "qlora")
DEFAULT_MODES = ("lora", "full")
CHECKPOINTING = ("nonreentrant", "reentrant")


def listed(choices):
    def parse(text):
        values = [value.strip() for value in text.split(",") if value.strip()]
        unknown = [value for value in values if value not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {','.join(choices)}")
        return values

    return parse


def configurations(args):
    """(world, system, mode, ac) in the order a round runs them, the systems of one setting side by side;
    plain runs at world size 1 only."""
    return [(world, system, mode, ac) for world in args.world for mode in args.modes for ac in args.ac
            if not (mode == "full" and ac in args.lora_only_ac)
            for system in args.systems if not (system == "plain" and world > 1)]


def run_configuration(args, world, system, mode, ac):
    """One configuration in fresh processes; the rank results merged (peak memory: the largest rank's)."""
    child = argparse.Namespace(**{**vars(args), "system": system, "mode": mode, "ac": ac})
    ranks = start_ranks(worker, world, child, env={"ZERO3_AC_DISABLE": "0" if system in FORK_INSTALLED else "1"})
    finished = ranks.join(args.timeout_s)
    by_rank = dict(ranks.drain())
    ranks.close()
    result = dict(by_rank.get(0) or {})
    if not finished:
        result.setdefault("error", None)
        result["error"] = result["error"] or f"timed out after {args.timeout_s} s"
    elif len(by_rank) < world:
        result["error"] = result.get("error") or f"{world - len(by_rank)} rank(s) died without a result"
    elif any(rank.get("error") for rank in by_rank.values()):
        result["error"] = next(rank["error"] for rank in by_rank.values() if rank.get("error"))
    if not result["error"]:
        result["peak_mem_gib_by_rank"] = [by_rank[rank]["peak_mem_gib"] for rank in sorted(by_rank)]
        result["peak_mem_gib"] = max(result["peak_mem_gib_by_rank"])
    result.update(world=world, system=system, mode=mode, ac=ac, shape=args.shape, model=args.model, seq=args.seq,
                  mbs=args.mbs, device=args.device)
    return result


def saved_qlora_base(args):
    """A temporary directory with QLoRA's base checkpoint, written by a child process on GPU 0 (or the CPU),
    so that this process holds no GPU memory while the configurations run."""
    directory = tempfile.mkdtemp(prefix="peers_qlora_base_")
    process = torch.multiprocessing.get_context("spawn").Process(
        target=save_random_base, args=(args.model, directory, "cuda:0" if args.device == "cuda" else None))
    process.start()
    process.join()
    if process.exitcode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        raise SystemExit(f"saving the QLoRA base checkpoint of {args.model} failed (exit code {process.exitcode})")
    return directory


def environment():
    import torch
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "peft", "deepspeed", "bitsandbytes"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    if torch.cuda.is_available():
        versions["gpu"] = torch.cuda.get_device_name(0)
        versions["gpus"] = torch.cuda.device_count()
    versions["cpus"] = os.cpu_count()
    return versions


def write(args, command, runs, complete):
    os.makedirs(args.out, exist_ok=True)
    rows = peer_report.summarize(runs)
    settings = dict(device=args.device, shape=args.shape, model=args.model, seq=args.seq, mbs=args.mbs,
                    warmup=args.warmup, steps=args.steps, rounds=args.rounds, world=args.world)
    document = dict(command=command, complete=complete, note=args.note, settings=settings,
                    environment=args.environment, notes=peer_report.NOTES, summary=rows, runs=runs)
    with open(os.path.join(args.out, "results.json"), "w") as out:
        json.dump(document, out, indent=1)
    with open(os.path.join(args.out, "runs.jsonl"), "w") as out:
        out.writelines(json.dumps(run) + "\n" for run in runs)
    with open(os.path.join(args.out, "README.md"), "w") as out:
        out.write(peer_report.readme(document))
    if rows:
        peer_report.chart(rows, os.path.join(args.out, "peers.png"))


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: small on CPU, 1.1b on GPU")
    parser.add_argument("--systems", type=listed(SYSTEMS), default=list(DEFAULT_SYSTEMS),
                        help=f"default {','.join(DEFAULT_SYSTEMS)}; the compiled anchors: fsdp2_compile, deepcompile")
    parser.add_argument("--modes", type=listed(MODES), default=list(DEFAULT_MODES),
                        help="lora, full, qlora (LoRA r16 on a 4-bit NF4 base, bitsandbytes); default lora,full")
    parser.add_argument("--ac", type=listed(CHECKPOINTING), default=list(CHECKPOINTING))
    parser.add_argument("--lora-only-ac", type=listed(CHECKPOINTING), default=[],
                        help="checkpointing modes to run for LoRA only (not for the full fine-tune)")
    parser.add_argument("--world", type=listed([str(n) for n in range(1, 65)]), default=["1"],
                        help="world sizes, comma separated (plain runs at 1 only)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--mbs", type=int, default=None)
    parser.add_argument("--timeout-s", type=float, default=600, help="per configuration run")
    parser.add_argument("--budget-s", type=float, default=None, help="start no run after this many seconds")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--note", default="", help="a paragraph for the top of README.md (machine, load)")
    parser.add_argument("--paired", action="store_true", help="paired rounds (see above)")
    parser.add_argument("--aa", choices=SYSTEMS, default=None, help="--paired: a second copy of this system")
    parser.add_argument("--aa-path", default=None,
                        help="--paired: the A/A copy imports zero3_ac from this folder (another version of the fork: "
                        "a paired A/B of two versions; e.g. `git archive REV zero3_ac | tar -x -C DIR`)")
    parser.add_argument("--reference", choices=SYSTEMS, default=None, help="--paired: numerator of the ratios")
    parser.add_argument("--block", type=int, default=None,
                        help="--paired: steps a system runs per turn (default: 1 on cuda, 5 on cpu)")
    parser.add_argument("--pin-cores", action="store_true",
                        help="--paired: each rank process on cores of its own (see paired.py)")
    args = parser.parse_args(argv)
    if args.aa and args.aa not in args.systems:
        parser.error(f"--aa {args.aa} is not among --systems {','.join(args.systems)}")
    if args.aa_path and not (args.aa == "fork" and os.path.isdir(os.path.join(args.aa_path, "zero3_ac"))):
        parser.error(f"--aa-path needs --aa fork and a folder holding a zero3_ac package, not {args.aa_path}")
    args.aa_path = args.aa_path and os.path.abspath(args.aa_path)
    args.reference = args.reference or ("fork" if "fork" in args.systems else args.systems[0])
    gpu = args.device == "cuda"
    args.world = [int(world) for world in args.world]
    args.shape = args.shape or ("1.1b" if gpu else "small")
    args.model = SHAPES[args.shape]
    args.seq = args.seq or (2048 if gpu else 64)
    args.mbs = args.mbs or (1 if args.shape == "8b" else 2)
    args.warmup = args.warmup if args.warmup is not None else (2 if gpu else 1)
    args.steps = args.steps if args.steps is not None else (40 if args.paired else 5 if gpu else 3)
    args.block = args.block or (1 if gpu else 5)
    return args


def main(argv=None):
    args = parse(argv)
    command = "python " + shlex.join([os.path.relpath(sys.argv[0]) if argv is None else "benchmarks/peers.py",
                                      *(sys.argv[1:] if argv is None else argv)])
    args.environment = environment()
    if args.paired:
        return main_paired(args, command)
    configs = configurations(args)
    started = time.monotonic()
    args.qlora_base = saved_qlora_base(args) if "qlora" in args.modes else None
    try:
        runs, complete = run_rounds(args, command, configs, started)
    finally:
        if args.qlora_base:
            shutil.rmtree(args.qlora_base, ignore_errors=True)
    write(args, command, runs, complete)
    print(peer_report.markdown(peer_report.summarize(runs)))
    return 0 if complete and not any(run["error"] for run in runs) else 1


def main_paired(args, command):
    """``--paired``: rounds of paired.py, rows to runs.jsonl, the report after every configuration."""
    configs = list(dict.fromkeys((world, mode, ac) for world, _, mode, ac in configurations(args)))
    if "qlora" in args.modes:
        raise SystemExit("--paired does not run --modes qlora")
    settings = dict(device=args.device, shape=args.shape, model=args.model, seq=args.seq, mbs=args.mbs,
                    warmup=args.warmup, steps=args.steps, block=args.block, rounds=args.rounds, world=args.world,
                    systems=args.systems, aa=args.aa, aa_path=args.aa_path, reference=args.reference)
    document = dict(command=command, complete=False, note=args.note, settings=settings, environment=args.environment)
    os.makedirs(args.out, exist_ok=True)

    def write_rows(rows, complete):
        document["complete"] = complete
        with open(os.path.join(args.out, "settings.json"), "w") as out:
            json.dump(document, out, indent=1)
        with open(os.path.join(args.out, "runs.jsonl"), "w") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)
        return paired_report.write(args.out, document, rows)

    rows, complete = paired.run_paired(args, configs, time.monotonic(), write_rows)
    systems, pairs = write_rows(rows, complete)
    print(paired_report.markdown(systems, pairs))
    print("\n".join(paired_report.aa_verdicts(pairs)))
    return 0 if complete and not any(row["error"] for row in rows) else 1


def run_rounds(args, command, configs, started):
    """Every configuration once per round, each round shifted by one, until ``--rounds`` or ``--budget-s``."""
    runs, complete = [], True
    for round_index in range(args.rounds):
        shift = round_index % len(configs)
        for world, system, mode, ac in configs[shift:] + configs[:shift]:
            if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                complete = False
                break
            result = run_configuration(args, world, system, mode, ac)
            result["round"] = round_index
            runs.append(result)
            print(peer_report.line(result), flush=True)
            write(args, command, runs, complete=False)
        if not complete:
            print(f"budget of {args.budget_s} s spent: stopped in round {round_index}", flush=True)
            break
    return runs, complete


if __name__ == "__main__":
    sys.exit(main())
