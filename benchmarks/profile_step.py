"""cProfile of ZeRO-3 LoRA training steps on one GPU: where the host time of a step goes.

The peer benchmark's workload (``workload.py``: Llama shape, PEFT LoRA r16 on every linear layer,
bf16, HF non-reentrant checkpointing, AdamW), one process, world size 1. Stock or fork as the
environment says (``ZERO3_AC_DISABLE=1`` runs stock). Warms up, times ``--steps`` steps, then
profiles ``--profiled`` more and writes the top functions by own and cumulative time, and the raw
stats next to them.

    python benchmarks/profile_step.py --out benchmarks/results/<dir> --tag fork
    python benchmarks/profile_step.py --units off --tag fork-per-module ...   # the fork without gather units
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
from workload import MODELS, build_model, zero3_config  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="tinyllama")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--units", default=None, help='the fork\'s "zero3_ac": {"gather_units": ...}; default: not set')
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--profiled", type=int, default=3)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29633")
    warnings.filterwarnings("ignore")
    import deepspeed
    from deepspeed.utils import logger
    import zero3_ac
    logger.setLevel("ERROR")
    deepspeed.init_distributed(dist_backend="nccl")
    torch.cuda.set_device(0)
    config = zero3_config("cuda", args.mbs, torch.bfloat16)
    if args.units is not None:
        config["zero3_ac"] = {"gather_units": args.units}
    model = build_model(args.model, "nonreentrant", False, torch.bfloat16, ds_config=config)
    trainable = [param for param in model.parameters() if param.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-4), config=config)
    generator = torch.Generator().manual_seed(0)
    vocab = MODELS[args.model]["vocab_size"]

    def step():
        ids = torch.randint(0, vocab, (args.mbs, args.seq), generator=generator).cuda()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        torch.cuda.synchronize()

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    step_s = (time.perf_counter() - start) / args.steps
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.profiled):
        step()
    profile.disable()
    text = io.StringIO()
    text.write(f"{args.tag}: fork active {zero3_ac.is_active()}, gather units {args.units or 'default'}, "
               f"unprofiled step {step_s:.4f} s, {args.profiled} profiled steps\n\n")
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"profile-{args.tag}.txt")
    with open(path, "w") as handle:
        handle.write(text.getvalue())
    profile.dump_stats(path + ".prof")
    print(f"{args.tag}: step {step_s:.4f} s; profile in {path}")


if __name__ == "__main__":
    main()
