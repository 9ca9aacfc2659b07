"""Where a step's extra time goes: forward, backward and optimizer step timed apart, plain PyTorch against ZeRO-3.

    ZERO3_AC_DISABLE=1 python benchmarks/step_phases.py --system plain
    python benchmarks/step_phases.py --system fork         # ZERO3_AC_DISABLE=1 ... --system stock for stock
    python benchmarks/step_phases.py --device cuda --shape 1.1b --system fsdp2   # one GPU, the peers' 1.1B workload

The peer benchmark's workload (``workload.py``: PEFT LoRA r16 on every linear layer, HF non-reentrant
checkpointing, AdamW, clipping 1.0; the tiny Llama in fp32 on CPU, the ``--shape`` model with a bf16 base on
GPU, built as ``peer_worker`` builds it), world size 1 (gloo on CPU, NCCL on GPU), one process. After
``--warmup`` steps, prints the median milliseconds of each phase over ``--steps`` steps: ``forward`` (the
model's or the engine's call), ``backward`` (``loss.backward()`` or ``engine.backward``), ``step`` (clipping,
``optimizer.step`` and ``zero_grad``, or ``engine.step``), and ``total``. On GPU the device is synchronized
before each phase ends, so a phase's time holds its kernels and no other phase's. Run the systems one after
the other, twice, and compare within a pass: the host's speed drifts between runs.

``--profile PHASE --profile-out FILE`` then runs 5 more steps with cProfile on during PHASE only, and writes
the functions with the most own time and the most cumulative time in it, per step (cProfile slows the host:
read the shares, not the milliseconds).

``--norm-check`` (fork only) then runs one more forward and backward, and for each optimizer sub-group
calls upstream's ``get_grad_norm_direct`` and the fork's (Note [The gradient norm's fp64 copies]) on its
gradients, alternately, ``--steps`` times each: whether the norms are equal bit for bit, how many gradients
the fork staged, and the median milliseconds of each (device synchronized).
"""

import argparse
import cProfile
import io
import os
import pstats
import socket
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import MODELS, build_model, zero3_config  # noqa: E402

SHAPES = {"small": "tiny", "1.1b": "tinyllama", "8b": "llama3-8b"}
OWN_CODE = r"deepspeed/|zero3_ac/"  # the profile's third table: DeepSpeed's and the fork's functions only


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=("plain", "fsdp2", "stock", "fork"), required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq", type=int, default=None, help="default 64 on CPU, 2048 on GPU")
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--profile", choices=("forward", "backward", "step"), default=None)
    parser.add_argument("--profile-out", default=None)
    parser.add_argument("--norm-check", action="store_true")
    args = parser.parse_args()
    if args.norm_check and args.system != "fork":
        parser.error("--norm-check compares the fork's gradient norm with upstream's: --system fork")
    if bool(args.profile) != bool(args.profile_out):
        parser.error("--profile and --profile-out go together")
    gpu = args.device == "cuda"
    seq = args.seq or (2048 if gpu else 64)
    model_name = SHAPES[args.shape]
    warnings.filterwarnings("ignore")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if not gpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
    device = "cuda:0" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    if args.system in ("plain", "fsdp2"):
        model = build_model(model_name, "nonreentrant", False, dtype, device=device).to(device=device)
        if args.system == "fsdp2":
            from peer_worker import fsdp2_shard
            torch.distributed.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)
            model = fsdp2_shard(model, args.device, 1, None)
        trainable = [param for param in model.parameters() if param.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        forward, backward = model, lambda loss: loss.backward()

        def step():
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad()
    else:
        import deepspeed
        import zero3_ac
        from deepspeed.utils import logger
        logger.setLevel("ERROR")
        if zero3_ac.is_active() != (args.system == "fork"):
            raise SystemExit(f"{args.system} asked for, but zero3_ac.is_active() is {zero3_ac.is_active()}: "
                             "set ZERO3_AC_DISABLE=1 for stock, unset it for the fork")
        deepspeed.init_distributed(dist_backend="nccl" if gpu else "gloo")
        config = zero3_config(args.device, args.mbs, dtype)
        model = build_model(model_name, "nonreentrant", False, dtype, ds_config=config if gpu else None)
        trainable = [param for param in model.parameters() if param.requires_grad]
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-4), config=config)
        forward, backward, step = engine, engine.backward, engine.step
    synchronize = torch.cuda.synchronize if gpu else (lambda: None)
    generator = torch.Generator().manual_seed(0)
    times = {"forward": [], "backward": [], "step": [], "total": []}
    profiler = cProfile.Profile()
    profiled_steps = 5 if args.profile else 0

    def run_phase(name, profiled_step, function, *arguments):
        profiled = profiled_step and name == args.profile
        if profiled:
            profiler.enable()
        result = function(*arguments)
        synchronize()
        if profiled:
            profiler.disable()
        return result

    for index in range(args.warmup + args.steps + profiled_steps):
        profiled_step = index >= args.warmup + args.steps
        ids = torch.randint(0, MODELS[model_name]["vocab_size"], (args.mbs, seq), generator=generator).to(device)
        synchronize()
        start = time.perf_counter()
        loss = run_phase("forward", profiled_step, lambda: forward(input_ids=ids, labels=ids).loss)
        forward_end = time.perf_counter()
        run_phase("backward", profiled_step, backward, loss)
        backward_end = time.perf_counter()
        run_phase("step", profiled_step, step)
        end = time.perf_counter()
        if args.warmup <= index < args.warmup + args.steps:
            for phase, seconds in zip(times, (forward_end - start, backward_end - forward_end, end - backward_end,
                                              end - start)):
                times[phase].append(seconds)
    print(args.system, " ".join(f"{name} {statistics.median(values) * 1e3:.2f} ms" for name, values in times.items()))
    if args.profile:
        with open(args.profile_out, "w") as out:
            out.write(f"{args.system}, {args.shape}, {args.device}: cProfile of the {args.profile} phase, "
                      f"{profiled_steps} steps; seconds are totals over them\n")
            for order, restrictions in (("tottime", (45,)), ("cumulative", (45,)),
                                        ("tottime", (OWN_CODE, 60))):
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(*restrictions)
                out.write(text.getvalue())
    if args.norm_check:
        ids = torch.randint(0, MODELS[model_name]["vocab_size"], (args.mbs, seq), generator=generator).to(device)
        backward(forward(input_ids=ids, labels=ids).loss)
        norm_check(engine.optimizer, args.steps, synchronize)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        if not gpu:
            from zero3_ac.utils.spawn import remove_shm_buffers
            remove_shm_buffers(port, "127.0.0.1", 0)


def norm_check(optimizer, repeats, synchronize):
    from zero3_ac import activation
    from zero3_ac.runtime.zero.stage3_grad_norm import staged_count
    upstream = activation._originals[(type(optimizer), "get_grad_norm_direct")]
    for index, params in enumerate(optimizer.fp16_groups):
        gradients = optimizer.averaged_gradients[index]
        seconds = {"upstream": [], "fork": []}
        norms = {}
        for _ in range(repeats):
            for name, function in (("upstream", lambda: upstream(optimizer, gradients, params)),
                                   ("fork", lambda: optimizer.get_grad_norm_direct(gradients, params))):
                synchronize()
                start = time.perf_counter()
                norms[name] = function()
                synchronize()
                seconds[name].append(time.perf_counter() - start)
        staged = staged_count(optimizer, params)
        print(f"norm check, sub-group {index}: {len(gradients)} gradients, {staged} staged, norm {norms['fork'].item()!r},"
              f" bitwise equal {torch.equal(norms['fork'], norms['upstream'])}, "
              + " ".join(f"{name} {statistics.median(values) * 1e3:.3f} ms" for name, values in seconds.items()))


if __name__ == "__main__":
    main()
