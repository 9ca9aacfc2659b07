"""cProfile of LoRA training steps on one GPU: where the host time of a step goes, for any peer system.

The peer benchmark's workload (``workload.py``: Llama shape, PEFT LoRA r16 on every linear layer,
bf16, HF non-reentrant checkpointing, AdamW), one process, world size 1, set up as the peer benchmark
sets up ``--system`` (``peer_worker.setup``): plain PyTorch, FSDP2, stock ZeRO-3 or the fork (stock
needs ``ZERO3_AC_DISABLE=1`` in the environment, as the peer benchmark runs it). Warms up, times
``--steps`` steps, then profiles ``--profiled`` more and writes the top functions by own and cumulative
time, a line of calls and own time per library (DeepSpeed, zero3_ac, torch, transformers, peft, built-ins,
the rest), and the raw stats next to them.

    python benchmarks/profile_step.py --out benchmarks/results/<dir> --tag fork
    python benchmarks/profile_step.py --system fsdp2 --tag fsdp2 --out ...
    python benchmarks/profile_step.py --units off --tag fork-per-module ...   # the fork without gather units
    python benchmarks/profile_step.py --sampler pyinstrument --tag fork ...   # wall time by sampling (see below)

cProfile counts every call exactly but charges each Python frame its own overhead, so cheap frames look
expensive (a ``Tensor.__hash__`` costs some 40 ns unprofiled, several times that profiled). ``--sampler
pyinstrument`` (needs the pyinstrument package; on the device machine carry its wheel) samples the stack every
``--interval`` seconds instead: the ``sample-TAG.txt`` table gives, per step, the wall time of each DeepSpeed or
zero3_ac function (inclusive, and the part spent outside any deeper DeepSpeed or zero3_ac frame, torch and built-in
calls included), and the time each library's code was entered from outside it; and the wall time of every function as the innermost
frame. The sampled steps run with autograd's multithreading off (see ``sample``).

``--sampler kernels`` counts, per step, the CUDA kernels and copies the steps launch (by name) and the ``aten::``
operators they call (every nesting level), under torch's profiler: the host work a GPU step pays per launch, to
compare systems launch by launch (``kernels-TAG.txt``).

``--sampler waits`` runs ``--profiled`` steps back to back, the device synchronized only after the last, as a
training loop runs them, and times each call that makes the host wait for the GPU (a stream's, an event's or the
device's ``synchronize``, a tensor's ``item``, ``bool``, ``tolist`` or ``cpu``, ``torch.tensor`` onto the GPU):
``waits-TAG.txt`` gives the host's ms per step blocked in them, by the DeepSpeed or zero3_ac line that made the call.
Where a step's host work runs ahead of its kernels, such a wait is the GPU's backlog at that point: host work after
it no longer overlaps the kernels queued before it.

``--sampler gaps`` says where a GPU step waits for the host (``gaps-TAG.txt``): the GPU's idle intervals
of the profiled steps, each charged to what the thread that launches the next kernel is running in the
middle of it (its Python stack, from torch's profiler with ``with_stack``): the innermost DeepSpeed or
zero3_ac function, and the innermost function of any library. An idle interval is host work that
delays the next launch, or a wait. It also runs one step under ``torch.cuda.set_sync_debug_mode``
and counts the synchronizing calls by the DeepSpeed or zero3_ac line that makes them.
"""

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_worker import FSDP2_SYSTEMS, SYSTEMS, ZERO_SYSTEMS, setup  # noqa: E402
from workload import MODELS  # noqa: E402

# First match wins: torch last, as its own package (the device image's site-packages is under /opt/torch).
LIBRARIES = tuple((name, os.sep + name + os.sep) for name in ("deepspeed", "zero3_ac", "transformers", "peft")) + (
    ("torch", os.sep + "site-packages" + os.sep + "torch" + os.sep),)


def library_of(filename):
    if filename == "~":
        return "built-in"
    return next((name for name, part in LIBRARIES if part in filename), "other")


def by_library(stats, steps):
    """``library: calls k / own ms`` per step, built-ins counted apart (attributing them to callers double counts)."""
    calls, own = {}, {}
    for (filename, _, _), (_, ncalls, tottime, _, _) in stats.stats.items():
        library = library_of(filename)
        calls[library] = calls.get(library, 0) + ncalls
        own[library] = own.get(library, 0.0) + tottime
    return ", ".join(f"{name} {calls[name] / steps / 1e3:.1f}k calls / {own[name] / steps * 1e3:.1f} ms"
                     for name in sorted(calls, key=lambda name: -own[name]))


def one_gpu_step(system, model, seq=2048, mbs=2, units=None, seed=0, synchronized=True):
    """A LoRA training step of ``system`` on GPU 0, world size 1, set up as the peer benchmark sets it up
    (``peer_worker.setup``), each call on a fresh random batch; the device synchronized at its end unless
    ``synchronized`` is False."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29633")
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(0)
    if system in ZERO_SYSTEMS:
        import deepspeed
        from deepspeed.utils import logger
        logger.setLevel("ERROR")
        deepspeed.init_distributed(dist_backend="nccl")
    elif system in FSDP2_SYSTEMS:
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    worker_args = argparse.Namespace(device="cuda", mode="lora", ac="nonreentrant", model=model, seq=seq,
                                     mbs=mbs, qlora_base=None, gather_units=units)
    train_step, _, _, _ = setup(worker_args, system, 1, "cuda:0")
    generator = torch.Generator().manual_seed(seed)
    vocab = MODELS[model]["vocab_size"]

    def step():
        ids = torch.randint(0, vocab, (mbs, seq), generator=generator).cuda()
        train_step(ids)
        if synchronized:
            torch.cuda.synchronize()

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=SYSTEMS, default="fork")
    parser.add_argument("--model", choices=sorted(MODELS), default="tinyllama")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--units", default=None, help='the fork\'s "zero3_ac": {"gather_units": ...}; default: not set')
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--profiled", type=int, default=3)
    parser.add_argument("--sampler", choices=("cprofile", "pyinstrument", "kernels", "gaps", "waits"), default="cprofile")
    parser.add_argument("--interval", type=float, default=0.0005, help="pyinstrument's sampling interval, seconds")
    parser.add_argument("--tag", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    unsynchronized_step = one_gpu_step(args.system, args.model, args.seq, args.mbs, args.units, synchronized=False)

    def step():
        unsynchronized_step()
        torch.cuda.synchronize()

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    step_s = (time.perf_counter() - start) / args.steps
    if args.sampler == "pyinstrument":
        return sample(args, step, step_s)
    if args.sampler == "kernels":
        return count_launches(args, step, step_s)
    if args.sampler == "gaps":
        return idle_gaps(args, step, step_s)
    if args.sampler == "waits":
        return host_waits(args, unsynchronized_step, step_s)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.profiled):
        step()
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    text.write(f"{args.tag}: system {args.system}, gather units {args.units or 'default'}, "
               f"unprofiled step {step_s:.4f} s, {args.profiled} profiled steps\n"
               f"per step: {by_library(stats, args.profiled)}\n\n")
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"profile-{args.tag}.txt")
    with open(path, "w") as handle:
        handle.write(text.getvalue())
    profile.dump_stats(path + ".prof")
    print(f"{args.tag}: step {step_s:.4f} s; profile in {path}")


def _own_library(identifier):
    """``deepspeed`` or ``zero3_ac`` for a pyinstrument frame identifier in their code, else None."""
    path = identifier.split("\x00")[1] if "\x00" in identifier else ""
    return next((name for name in ("deepspeed", "zero3_ac") if os.sep + name + os.sep in path), None)


def sampled_times(frame_records, steps):
    """(inclusive, outside-deeper-own, entered-from-outside, innermost) wall ms per step, from pyinstrument's
    records; the first two for DeepSpeed's and zero3_ac's functions, the last for every function."""
    inclusive, outside, entered, innermost_ms = {}, {}, {}, {}
    for stack, seconds in frame_records:
        ms = seconds * 1e3 / steps
        if stack:
            frame = stack[-1].split("\x01")[0]
            innermost_ms[frame] = innermost_ms.get(frame, 0.0) + ms
        own = [(index, identifier) for index, identifier in enumerate(stack) if _own_library(identifier)]
        for name in {identifier.split("\x01")[0] for _, identifier in own}:
            inclusive[name] = inclusive.get(name, 0.0) + ms
        if own:
            innermost = own[-1][1].split("\x01")[0]
            outside[innermost] = outside.get(innermost, 0.0) + ms
            outer = _own_library(own[0][1])
            entered[outer] = entered.get(outer, 0.0) + ms
    return inclusive, outside, entered, innermost_ms


def sample(args, step, step_s):
    """Note: autograd runs a CUDA backward on a device thread of its own, which a sampler of this thread
    does not see; with its multithreading off the backward (its hooks included) runs here, in the same order."""
    from pyinstrument import Profiler
    torch.autograd.set_multithreading_enabled(False)
    for _ in range(2):
        step()
    profiler = Profiler(interval=args.interval)
    profiler.start()
    start = time.perf_counter()
    for _ in range(args.profiled):
        step()
    sampled_s = (time.perf_counter() - start) / args.profiled
    session = profiler.stop()
    inclusive, outside, entered, innermost_ms = sampled_times(session.frame_records, args.profiled)

    def name(identifier):
        function, path, line = identifier.split("\x00")[:3]
        return f"{path.split(os.sep + 'site-packages' + os.sep)[-1]}:{line}({function})"

    lines = [f"{args.tag}: system {args.system}, unprofiled step {step_s:.4f} s, sampled step {sampled_s:.4f} s "
             f"({args.profiled} steps, interval {args.interval} s)",
             "entered from outside, ms per step: " + ", ".join(f"{lib} {ms:.1f}" for lib, ms in entered.items()),
             "", "    incl ms   outside ms  function (DeepSpeed and zero3_ac, by inclusive wall time per step)"]
    for identifier in sorted(inclusive, key=lambda key: -inclusive[key])[:120]:
        lines.append(f"{inclusive[identifier]:10.2f} {outside.get(identifier, 0.0):12.2f}  {name(identifier)}")
    lines += ["", "    self ms  function (any library, by time as the innermost frame per step)"]
    for identifier in sorted(innermost_ms, key=lambda key: -innermost_ms[key])[:80]:
        lines.append(f"{innermost_ms[identifier]:10.2f}  {name(identifier)}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"sample-{args.tag}.txt")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, f"sample-{args.tag}.txt.tree"), "w") as handle:
        handle.write(profiler.output_text(unicode=False, color=False))
    print(f"{args.tag}: step {step_s:.4f} s, sampled {sampled_s:.4f} s; table in {path}")


def launch_counts(events, steps):
    """(CUDA kernels and copies by name, ``aten::`` operators by name) per step, from the profiler's raw events."""
    from torch.autograd import DeviceType
    device, operators = {}, {}
    for event in events:
        name = event.name()
        if event.device_type() == DeviceType.CUDA:
            device[name] = device.get(name, 0) + 1 / steps
        elif name.startswith("aten::"):
            operators[name] = operators.get(name, 0) + 1 / steps
    return device, operators


def _ranked(table, limit):
    """``(key, value)`` of ``table``, largest values first, at most ``limit``."""
    return sorted(table.items(), key=lambda item: -item[1])[:limit]


def _write_report(args, kind, lines):
    """``lines`` into ``OUT/KIND-TAG.txt``; prints the first."""
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{kind}-{args.tag}.txt"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print(lines[0])


def count_launches(args, step, step_s):
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(args.profiled):
            step()
    device, operators = launch_counts(profile.profiler.kineto_results.events(), args.profiled)
    lines = [f"{args.tag}: system {args.system}, unprofiled step {step_s:.4f} s; per step: "
             f"{sum(device.values()):.0f} CUDA kernels and copies, {sum(operators.values()):.0f} aten operators "
             f"({args.profiled} profiled steps)", "", "  per step  CUDA kernel or copy"]
    lines += [f"{count:10.1f}  {name[:150]}" for name, count in _ranked(device, 60)]
    lines += ["", "  per step  aten operator"]
    lines += [f"{count:10.1f}  {name}" for name, count in _ranked(operators, 80)]
    _write_report(args, "kernels", lines)


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _frame_name(name):
    """``path(line): function`` of a Python frame or profiler event, its path from its library's folder on
    (the profiler names most frames that way already)."""
    for library, part in LIBRARIES:
        index = name.find(part)
        if index >= 0:
            return name[index + len(part) - len(library) - 1:]
    return name


def gap_sites(trace, min_gap_us=5.0):
    """GPU idle time in a chrome trace of torch's profiler, charged to the launching thread's Python stack.

    Returns (busy us, idle us, {own site: idle us}, {innermost site: idle us}): an idle interval between two
    GPU events goes to the Python functions open, in the middle of the interval, on the thread that
    launches the event after it; "own" is the innermost DeepSpeed or zero3_ac function there."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("args", {}).get("correlation")) for e in events
                 if e.get("cat") in GPU_CATEGORIES)
    launcher = {e["args"]["correlation"]: e["tid"] for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    frames = {}
    for e in events:
        if e.get("cat") == "python_function":
            frames.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e.get("dur", 0), _frame_name(e["name"])))
    for stack in frames.values():
        stack.sort()
    own, innermost = {}, {}
    busy = idle = 0.0
    end = None
    for start, stop, correlation in gpu:
        if end is not None and start - end >= min_gap_us:
            gap = start - end
            idle += gap
            middle = end + gap / 2
            open_frames = [f for f in frames.get(launcher.get(correlation), ()) if f[0] <= middle <= f[1]]
            open_frames.sort(key=lambda f: (f[0], -f[1]))
            inner = open_frames[-1][2] if open_frames else "(no Python frame)"
            ours = next((f[2] for f in reversed(open_frames)
                         if f[2].startswith(("deepspeed" + os.sep, "zero3_ac" + os.sep))), "(none)")
            own[ours] = own.get(ours, 0.0) + gap
            innermost[inner] = innermost.get(inner, 0.0) + gap
        if end is None or stop > end:
            busy += stop - max(start, end if end is not None else start)
            end = stop
    return busy, idle, own, innermost


# The calls that block the host until the GPU has run what they depend on (torch.tensor: a copy onto the GPU).
SYNCHRONIZING_CALLS = ((torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda, "synchronize"),
                       (torch.Tensor, "item"), (torch.Tensor, "__bool__"), (torch.Tensor, "tolist"),
                       (torch.Tensor, "cpu"), (torch, "tensor"))


def _innermost_own_site(frame, outside):
    """``path:line(function)`` of the innermost DeepSpeed or zero3_ac frame from ``frame`` outwards, else ``outside``."""
    while frame is not None:
        name = frame.f_code.co_filename
        if os.sep + "deepspeed" + os.sep in name or os.sep + "zero3_ac" + os.sep in name:
            return f"{_frame_name(name)}:{frame.f_lineno}({frame.f_code.co_name})"
        frame = frame.f_back
    return outside


def host_waits(args, step, step_s):
    """Writes ``waits-TAG.txt``; returns {(call, site): seconds over the steps}."""
    waited = {}

    def timed(name, call):
        def wrapper(*arguments, **kwargs):
            start = time.perf_counter()
            try:
                return call(*arguments, **kwargs)
            finally:
                key = (name, _innermost_own_site(sys._getframe(1), "(model or loop)"))
                waited[key] = waited.get(key, 0.0) + time.perf_counter() - start

        return wrapper

    saved = [(owner, name, owner.__dict__.get(name)) for owner, name in SYNCHRONIZING_CALLS]
    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        for owner, name in SYNCHRONIZING_CALLS:
            setattr(owner, name, timed(name, getattr(owner, name)))
        for _ in range(args.profiled):
            step()
    finally:
        for owner, name, call in saved:
            if call is None:
                delattr(owner, name)
            else:
                setattr(owner, name, call)
    torch.cuda.synchronize()  # the last steps' kernels, outside the table
    steps_s = (time.perf_counter() - start) / args.profiled
    total_ms = sum(waited.values()) * 1e3 / args.profiled
    lines = [f"{args.tag}: system {args.system}, synchronized step {step_s:.4f} s, back-to-back step {steps_s:.4f} s "
             f"({args.profiled} steps); host blocked in synchronizing calls {total_ms:.2f} ms a step", "",
             "   ms/step  call, by the DeepSpeed or zero3_ac line that made it"]
    lines += [f"{seconds * 1e3 / args.profiled:10.3f}  {name} {site}" for (name, site), seconds in _ranked(waited, 30)]
    _write_report(args, "waits", lines)
    return waited


def idle_gaps(args, step, step_s):
    import json
    import tempfile
    sync_sites = {}

    def on_warning(message, category, filename, lineno, file=None, line=None):
        site = _innermost_own_site(sys._getframe(1), "(model)")
        sync_sites[site] = sync_sites.get(site, 0) + 1

    with warnings.catch_warnings():  # restores the filters and showwarning
        warnings.simplefilter("always")
        warnings.showwarning = on_warning
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=True) as profile:
        for _ in range(args.profiled):
            step()
    with tempfile.NamedTemporaryFile(suffix=".json") as handle:
        profile.export_chrome_trace(handle.name)
        with open(handle.name) as trace_file:
            trace = json.load(trace_file)
    busy, idle, own, innermost = gap_sites(trace)
    per_step = 1e3 * args.profiled  # us over the profiled steps -> ms per step
    lines = [f"{args.tag}: system {args.system}, unprofiled step {step_s:.4f} s; profiled steps: GPU busy "
             f"{busy / per_step:.1f} ms, idle {idle / per_step:.1f} ms a step (gaps of 5 us or more)", "",
             "synchronizing calls in one step (set_sync_debug_mode), by DeepSpeed or zero3_ac line:"]
    lines += [f"{count:8d}  {site}" for site, count in _ranked(sync_sites, len(sync_sites))]
    lines += ["", " idle ms/step  innermost DeepSpeed or zero3_ac function open on the launching thread"]
    lines += [f"{us / per_step:13.2f}  {site}" for site, us in _ranked(own, 40)]
    lines += ["", " idle ms/step  innermost function open on the launching thread"]
    lines += [f"{us / per_step:13.2f}  {site}" for site, us in _ranked(innermost, 40)]
    _write_report(args, "gaps", lines)


if __name__ == "__main__":
    main()
