"""Where a CPU step's extra time goes: forward, backward and optimizer step timed apart, plain PyTorch against ZeRO-3.

    ZERO3_AC_DISABLE=1 python benchmarks/step_phases.py --system plain
    python benchmarks/step_phases.py --system fork         # ZERO3_AC_DISABLE=1 ... --system stock for stock

The CPU peer benchmark's workload (``workload.py``: the tiny Llama, PEFT LoRA r16 on every linear layer, HF
non-reentrant checkpointing, AdamW, clipping 1.0), world size 1 (gloo), one process. After ``--warmup`` steps,
prints the median milliseconds of each phase over ``--steps`` steps: ``forward`` (the model's or the engine's
call), ``backward`` (``loss.backward()`` or ``engine.backward``), ``step`` (clipping, ``optimizer.step`` and
``zero_grad``, or ``engine.step``). Run the systems one after the other, twice, and compare within a pass: the
host's speed drifts between runs.
"""

import argparse
import os
import socket
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import MODELS, build_model, zero3_config  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=("plain", "stock", "fork"), required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", DS_ACCELERATOR="cpu",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.manual_seed(0)
    model = build_model("tiny", "nonreentrant", False, torch.float32)
    trainable = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    if args.system == "plain":
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
        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero3_config("cpu", 2, torch.float32))
        forward, backward, step = engine, engine.backward, engine.step
    generator = torch.Generator().manual_seed(0)
    times = {"forward": [], "backward": [], "step": []}
    for index in range(args.warmup + args.steps):
        ids = torch.randint(0, MODELS["tiny"]["vocab_size"], (2, args.seq), generator=generator)
        start = time.perf_counter()
        loss = forward(input_ids=ids, labels=ids).loss
        forward_end = time.perf_counter()
        backward(loss)
        backward_end = time.perf_counter()
        step()
        end = time.perf_counter()
        if index >= args.warmup:
            for phase, seconds in zip(times, (forward_end - start, backward_end - forward_end, end - backward_end)):
                times[phase].append(seconds)
    print(args.system, " ".join(f"{phase} {statistics.median(values) * 1e3:.2f} ms" for phase, values in times.items()))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        from zero3_ac.utils.spawn import remove_shm_buffers
        remove_shm_buffers(port, "127.0.0.1", 0)


if __name__ == "__main__":
    main()
