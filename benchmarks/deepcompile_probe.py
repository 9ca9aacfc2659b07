"""Whether DeepCompile trains the benchmarks' LoRA workload, with the fork installed and without it.

    python benchmarks/deepcompile_probe.py [--shape 1.1b] [--ac nonreentrant,none] [--steps 3]

For each checkpointing mode, one world-1 rank process with ``ZERO3_AC_DISABLE=1`` (stock) and one with ``0``
(the fork installed; it leaves a DeepCompile engine to stock ZeRO-3, [Engines left to stock] in
zero3_ac/runtime/engine.py) builds the ``deepcompile`` system of peer_worker.py and trains ``--steps`` steps.
Prints the losses or the error with the last frames of its traceback. On the device machine the JIT build of
DeepCompile's op needs ``TORCH_CUDA_ARCH_LIST=9.0``: DeepSpeed 0.19.8's builder cannot parse the image's
``9.0a``.
"""

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spawn import start_ranks  # noqa: E402


def probe(rank, world_size, port, args, queue):
    import torch
    torch.cuda.set_device(rank)
    try:
        import deepspeed
        import zero3_ac
        from peer_worker import setup
        from workload import MODELS
        deepspeed.init_distributed(dist_backend="nccl")
        step, engine, _, _ = setup(args, "deepcompile", world_size, f"cuda:{rank}")
        vocab = MODELS[args.model]["vocab_size"]
        losses = [float(step(torch.randint(0, vocab, (args.mbs, args.seq), device=f"cuda:{rank}")).item())
                  for _ in range(args.steps)]
        queue.put((rank, dict(fork_active=zero3_ac.is_active(), losses=losses)))
    except Exception as exc:
        queue.put((rank, dict(error=f"{type(exc).__name__}: {exc}"[:500],
                              where="".join(traceback.format_tb(exc.__traceback__)[-6:]))))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main():
    from peers import SHAPES
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1.1b", choices=["1.1b", "8b"])
    parser.add_argument("--ac", default="nonreentrant,none")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=2048)
    options = parser.parse_args()
    for ac in options.ac.split(","):
        for disable in ("1", "0"):
            args = argparse.Namespace(device="cuda", mbs=2 if options.shape == "1.1b" else 1, seq=options.seq,
                                      model=SHAPES[options.shape], ac=ac,
                                      mode="lora", qlora_base=None, steps=options.steps)
            ranks = start_ranks(probe, 1, args, env={"ZERO3_AC_DISABLE": disable})
            ranks.join(600)
            result = dict(ranks.drain()).get(0, dict(error="no result"))
            ranks.close()
            label = "stock" if disable == "1" else "fork installed"
            print(f"--- DeepCompile, {options.shape}, checkpointing {ac}, {label}:")
            for key, value in result.items():
                print(f"{key}: {value}")


if __name__ == "__main__":
    main()
