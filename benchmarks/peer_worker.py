"""One rank of one peer-benchmark configuration: a system, LoRA, QLoRA or full, a checkpointing mode.

Systems: ``plain`` PyTorch; ``fsdp2`` (``fully_shard`` per decoder layer); ``fsdp2_compile``, the same with
``torch.compile`` on every decoder layer before it is sharded (torchtitan's order: the compiled layer is
what FSDP2 wraps, so its hooks stay outside the compiled region); ``stock`` and ``fork`` ZeRO-3; and
``deepcompile``, DeepSpeed's DeepCompile on ZeRO-3 (``compile.deepcompile`` and ``engine.compile()``), run
with the fork installed, which leaves such an engine to stock ZeRO-3 (zero3_ac/runtime/engine.py,
[Engines left to stock]).

``peers.py`` starts a fresh set of these processes for every configuration and round. Stock and fork
differ only in ``ZERO3_AC_DISABLE`` in the process environment (``FORK_INSTALLED``): the installed
package's start-up hook applies the fork when DeepSpeed is imported unless it is set; the worker checks
which one ran.
"""

import os
import statistics
import time
import warnings

import torch

from dtypes import ComputeDtypes, param_dtypes
from spawn import use_rank_device
from zero3_ac.utils import spawn as rank_spawn
from workload import (MODELS, QUANT_STORAGE, AllGatherCounter, build_model, build_qlora_model, cast_unquantized,
                      zero3_config)

SYSTEMS = ("plain", "fsdp2", "fsdp2_compile", "stock", "deepcompile", "fork")
DEFAULT_SYSTEMS = ("plain", "fsdp2", "stock", "fork")
ZERO_SYSTEMS = ("stock", "deepcompile", "fork")
FSDP2_SYSTEMS = ("fsdp2", "fsdp2_compile")
# The systems whose processes run with the fork applied (ZERO3_AC_DISABLE=0); the others with it off.
FORK_INSTALLED = ("fork", "deepcompile")
GIB = 1024**3
# Namespaces of the profiler's operator events that do a step's work (compute, collectives);
# the rest of a CPU step is host-side framework time.
WORK_OPS = ("aten::", "c10d::", "fsdp::", "_c10d_functional::")


class PeakMemory:
    """Peak memory over the measured steps: ``torch.cuda.max_memory_allocated``, or on CPU the process's peak RSS.

    On CPU the kernel's peak (VmHWM) is reset by writing 5 to /proc/self/clear_refs; where that is
    refused, the peak since the process started (``ru_maxrss``, model construction included) is kept.
    """

    def __init__(self, device):
        self.device = device
        self.kind = "cuda max_memory_allocated" if device == "cuda" else "peak RSS (VmHWM)"

    def reset(self):
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
        except OSError:
            self.kind = "peak RSS since start (ru_maxrss)"

    def peak_gib(self):
        if self.device == "cuda":
            return torch.cuda.max_memory_allocated() / GIB
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / GIB
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def busy_seconds(profile, device):
    """Time covered by the step's work in a profile: the union of CUDA kernel/copy intervals on GPU;
    on CPU the union of outermost operator events (``WORK_OPS``; an op inside another op counts once).
    None where the profile holds no such event."""
    from torch.autograd import DeviceType
    if device == "cuda":
        # The raw events: building the profiler's event tree of a large ZeRO step takes many seconds.
        spans = [(event.start_ns() / 1e3, event.end_ns() / 1e3) for event in profile.profiler.kineto_results.events()
                 if event.device_type() == DeviceType.CUDA]
        return _covered_seconds(spans)
    spans = []
    for event in profile.events():
        if event.device_type != DeviceType.CPU or not event.name.startswith(WORK_OPS):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(WORK_OPS):
            parent = parent.cpu_parent
        if parent is None:
            spans.append((event.time_range.start, event.time_range.end))
    return _covered_seconds(spans)


def _covered_seconds(spans):
    """Seconds covered by the union of (start, end) intervals in microseconds; None for none."""
    if not spans:
        return None
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered / 1e6


def module_calls_and_busy(step, device):
    """One more step under the profiler with a global forward pre-hook: (module calls, busy s, wall s)."""
    calls = [0]

    def count(module, inputs):
        calls[0] += 1

    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        with torch.profiler.profile(activities=activities) as profile:
            start = time.perf_counter()
            step()
            wall = time.perf_counter() - start
    finally:
        handle.remove()
    return calls[0], busy_seconds(profile, device), wall


def plain_step(model, optimizer, trainable):
    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def fsdp2_shard(model, device, world_size, param_dtype, compile_layers=False):
    """``fully_shard`` on every decoder layer, then on the root; ``param_dtype`` None computes every param in
    its own dtype (Note: [Adapter dtypes under ZeRO-3 bf16] in dtypes.py). ``compile_layers``: each decoder
    layer is replaced in its ``ModuleList`` by ``torch.compile(layer)`` first, and FSDP2 shards that."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    mesh = init_device_mesh(device, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype)
    layers = next(module for module in model.modules()
                  if isinstance(module, torch.nn.ModuleList) and isinstance(module[0], LlamaDecoderLayer))
    for index, layer in enumerate(layers):
        if compile_layers:
            layer = torch.compile(layer)
            layers[index] = layer
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def setup(args, system, world_size, device_name):
    """(step function, ZeRO engine or None, trainable param count, model) for ``system``."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    full = args.mode == "full"
    qlora = args.mode == "qlora"
    if system in ZERO_SYSTEMS:
        import deepspeed
        import zero3_ac
        if system != "deepcompile" and zero3_ac.is_active() != (system == "fork"):
            raise RuntimeError(f"{system} asked for, but zero3_ac.is_active() is {zero3_ac.is_active()}")
        config = zero3_config(args.device, args.mbs, dtype)
        if getattr(args, "gather_units", None) is not None:
            config["zero3_ac"] = {"gather_units": args.gather_units}
        if system == "deepcompile":
            config["compile"] = {"deepcompile": True}
        if qlora:
            model = build_qlora_model(args.qlora_base, args.ac, dtype, device_name)
        else:
            model = build_model(args.model, args.ac, full, dtype, ds_config=config if args.device == "cuda" else None)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        if system == "deepcompile":
            engine.compile()

        def step(ids):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss

        return step, engine, sum(getattr(p, "ds_numel", p.numel()) for p in trainable), engine.module
    param_dtype = None
    if qlora:
        # FSDP2's policy casts every param to param_dtype, the packed 4-bit weights too (an fp32 cast breaks
        # their packing): under FSDP2 every param takes their storage dtype (bf16), which the cast leaves as it is.
        param_dtype = QUANT_STORAGE if system in FSDP2_SYSTEMS else dtype
        model = cast_unquantized(build_qlora_model(args.qlora_base, args.ac, dtype, device_name), param_dtype)
    else:
        # The base in ``dtype``, PEFT's adapters fp32: Note: [Adapter dtypes under ZeRO-3 bf16] in dtypes.py.
        model = build_model(args.model, args.ac, full, dtype, device=device_name).to(device=device_name)
    if system in FSDP2_SYSTEMS:
        model = fsdp2_shard(model, args.device, world_size, param_dtype, compile_layers=system == "fsdp2_compile")
    trainable = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in trainable) * (world_size if system in FSDP2_SYSTEMS else 1)
    return plain_step(model, torch.optim.AdamW(trainable, lr=1e-4), trainable), None, count, model


def measure(args, system, rank, world_size, allgathers):
    device_name = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    step, engine, trainable, model = setup(args, system, world_size, device_name)
    compute = ComputeDtypes(model)
    gathers = None
    if engine is not None:
        from zero3_ac.utils.gather_meter import GatherMeter
        gathers = GatherMeter(engine)
    peak = PeakMemory(args.device)
    generator = torch.Generator().manual_seed(1234 + rank)
    vocab = MODELS[args.model]["vocab_size"]

    def batch():
        return torch.randint(0, vocab, (args.mbs, args.seq), generator=generator).to(device_name)

    def synchronize():
        if args.device == "cuda":
            torch.cuda.synchronize()

    times, calls, nbytes, phases = [], [], [], []
    for index in range(args.warmup + args.steps):
        ids = batch()
        if index == args.warmup:
            allgathers.take()
            if gathers is not None:
                gathers.take()
            peak.reset()
        synchronize()
        start = time.perf_counter()
        loss = step(ids)
        synchronize()
        elapsed = time.perf_counter() - start
        if index == 0:
            dtypes = dict(param_dtypes=param_dtypes(model), compute_dtypes=compute.take())
        if index >= args.warmup:
            times.append(elapsed)
            step_calls, step_bytes = allgathers.take()
            calls.append(step_calls)
            nbytes.append(step_bytes)
            if gathers is not None:
                phases.append(gathers.take()["phase_bytes"])
    peak_gib = peak.peak_gib()
    ids = batch()

    def profiled_step():
        step(ids)
        synchronize()

    module_calls, busy_s, profiled_s = module_calls_and_busy(profiled_step, args.device)
    step_s = statistics.median(times)
    # Note: [Host time per module call] On GPU the profiler slows the host, not the kernels: the idle
    # time is the unprofiled median step less the profiled step's kernel time. On CPU the profiler
    # stretches the operators it records, so both sides of the difference come from the profiled step.
    host_s = None if busy_s is None else (step_s if args.device == "cuda" else profiled_s) - busy_s
    result = dict(step_s=times, step_s_median=step_s, tokens_per_s=world_size * args.mbs * args.seq / step_s,
                  peak_mem_gib=peak_gib, peak_mem_kind=peak.kind, trainable_params=trainable,
                  allgather_calls_per_step=statistics.mean(calls), allgather_gib_per_step=statistics.mean(nbytes) / GIB,
                  module_calls_per_step=module_calls, busy_s=busy_s, profiled_step_s=profiled_s,
                  host_us_per_module_call=host_s / module_calls * 1e6 if module_calls and host_s is not None else None,
                  last_loss=float(loss.item()), **dtypes)
    if phases:
        result["zero_gathered_gib_by_phase"] = {phase: statistics.mean(p[phase] for p in phases) / GIB
                                                for phase in phases[0]}
        import zero3_ac
        result["fork_active"] = zero3_ac.is_active()
    return result


def init_process_group(args, rank, world_size):
    """The system's process group: DeepSpeed's for the ZeRO systems, torch's for FSDP2, none for plain."""
    backend = "gloo" if args.device == "cpu" else "nccl"
    if args.system in ZERO_SYSTEMS:
        import deepspeed
        from deepspeed.utils import logger
        logger.setLevel("ERROR")
        deepspeed.init_distributed(dist_backend=backend)
    elif args.system in FSDP2_SYSTEMS:
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)


def worker(rank, world_size, port, args, queue):
    use_rank_device(rank, args.device)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    allgathers = AllGatherCounter()
    try:
        init_process_group(args, rank, world_size)
        result = measure(args, args.system, rank, world_size, allgathers)
        result["error"] = None
    except Exception as exc:
        result = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
    queue.put((rank, result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    rank_spawn.remove_own_shm_buffer()

