"""Stock DeepSpeed against deepspeed-zero3-ac on a tiny LoRA fine-tune, 2 CPU ranks, in one run.

What HF Trainer users run, made small: a Llama built from a config (random init, nothing
downloaded) under ``deepspeed.zero.Init`` (transformers does that while an ``HfDeepSpeedConfig`` is
alive), PEFT LoRA on every linear layer of the decoder, HF gradient checkpointing with
``use_reentrant=False``, ZeRO-3. Each mode runs in fresh rank processes whose environment decides it
from interpreter start-up on (stock: ``ZERO3_AC_DISABLE=1``), with the same initial weights and
batches. Plain PyTorch (no DeepSpeed) trains from the same weights as the loss reference.

On DeepSpeed 0.18.5 - 0.19.2 stock ZeRO-3 crashes in the first backward (``CheckpointError``);
0.19.3+ trains but gathers the layers again between their recompute and their backward. The fork
trains on both, gathers each layer once in the backward pass, and its losses are plain PyTorch's.

    python examples/demo.py [--steps 4]
"""

import argparse
import contextlib
import io
import math
import os
import re
import sys
import time

from zero3_ac.utils.spawn import start_ranks

MODES = ("stock", "fork")
WORLD_SIZE = 2
MIB = 1024 * 1024
VOCAB, SEQ_LEN, BATCH = 256, 32, 2
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# examples/ds_config_zero3_tiny_model.json with the Trainer's "auto" values filled in: without a zero
# persistence threshold, reuse distance and prefetch a model this small stays gathered from its first
# forward on, and never goes through the release and gather again that a large model does.
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": BATCH,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,  # explicit: 0.19.8 defaults to 1.0, 0.19.2 to 0.0
    "steps_per_print": 10**9,
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                          "stage3_prefetch_bucket_size": 0},
}
LEARNING_RATE = 1e-2
# Every rank's environment from its start: the mode, the CPU accelerator, and nothing downloaded or logged
# beyond errors (HF's advisory warnings, the Hub).
RANK_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
TIMEOUT_S = 600


def quiet():
    """Errors only, from every library the demo loads; bitsandbytes is not loaded at all.

    ``import peft`` tries ``import bitsandbytes`` (peft/helpers.py), whose CPU backend logs a warning
    about a missing kernel package at import. The demo uses no quantization, so the import is
    refused (a ``None`` in ``sys.modules`` makes it raise ``ImportError``, which peft expects).
    """
    import logging
    import warnings
    sys.modules.setdefault("bitsandbytes", None)
    warnings.filterwarnings("ignore", module="torch")
    warnings.filterwarnings("ignore", module="transformers")
    warnings.filterwarnings("ignore", module="peft")
    warnings.filterwarnings("ignore", module="deepspeed")
    for name in ("DeepSpeed", "torch.distributed", "torch.utils.cpp_extension", "transformers", "peft", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)


def build_model():
    """The tiny Llama with LoRA and non-reentrant checkpointing; under ZeRO-3 (an ``HfDeepSpeedConfig``
    alive) transformers builds it inside ``deepspeed.zero.Init``, as ``from_pretrained`` does."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN)
    model = AutoModelForCausalLM.from_config(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS))


def batch(rank):
    """Rank ``rank``'s micro-batch, the same in every step: sequences counting up from an offset."""
    import torch
    offsets = torch.arange(BATCH) * 7 + rank * 101
    ids = (torch.arange(SEQ_LEN) + offsets[:, None]) % VOCAB
    return {"input_ids": ids, "labels": ids}


def optimizer_for(model):
    import torch
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)


def full_state(engine):
    """Every param of a ZeRO-3 engine, gathered, as numpy arrays (a collective: every rank calls it).

    numpy, not tensors: torch's multiprocessing pickler would share a tensor's memory with the parent
    through this process, which may have exited by the time the parent reads the queue."""
    import deepspeed
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: param.detach().numpy().copy() for name, param in params.items()}


def backward_pass_regathered_bytes(regathered_bytes):
    """Bytes released and gathered again within the backward pass (Note: [Re-gathers])."""
    return sum(nbytes for key, nbytes in regathered_bytes.items() if key.split("->")[0] in ("recompute", "backward"))


def crash_shapes(error):
    """For a ``CheckpointError``: the first differing tensor's shapes, saved in the forward and recomputed."""
    shapes = re.findall(r"'shape': torch\.Size\((\[[^\]]*\])\)", str(error))
    return f"saved {shapes[0]}, recomputed {shapes[1]}" if len(shapes) >= 2 else ""


def train_rank(rank, queue, mode, steps):
    """One rank of one mode: train, then destroy the process groups and remove the rank's shm buffer."""
    quiet()
    from zero3_ac.utils.spawn import finish_rank
    try:
        train(rank, queue, mode, steps)
    finally:
        finish_rank()


def train(rank, queue, mode, steps):
    """Train ``steps`` steps, reporting each to the parent; a crash is reported and ends the run."""
    import deepspeed
    import zero3_ac
    from transformers.integrations import HfDeepSpeedConfig
    from zero3_ac.utils.gather_meter import GatherMeter
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed print()s that it built its CPU comm op
        deepspeed.init_distributed(dist_backend="gloo")
    hf_ds_config = HfDeepSpeedConfig(DS_CONFIG)  # noqa: F841  (alive while the model is built)
    model = build_model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer_for(model), config=DS_CONFIG)
    initial = full_state(engine)
    queue.put(dict(kind="start", mode=mode, rank=rank, fork_active=zero3_ac.is_active(),
                   initial_state=initial if rank == 0 else None))
    meter = GatherMeter(engine)
    inputs = batch(rank)
    for step in range(steps):
        try:
            loss = engine(**inputs).loss
            engine.backward(loss)
            engine.step()
        except Exception as error:
            queue.put(dict(kind="crash", mode=mode, rank=rank, step=step, error=type(error).__name__,
                           message=str(error).strip().split("\n")[0], shapes=crash_shapes(error)))
            return
        taken = meter.take()
        queue.put(dict(kind="step", mode=mode, rank=rank, step=step, loss=loss.item(), phase_bytes=taken["phase_bytes"],
                       regathered_bytes=backward_pass_regathered_bytes(taken["regathered_bytes"])))
    engine.destroy()


def run_mode(mode, steps):
    """Run one mode on fresh ranks; returns the rank-0 step reports, crash reports, the initial weights
    and the ranks' exit codes. Prints one line per step as rank 0 reports it."""
    env = {**RANK_ENV, "ZERO3_AC_DISABLE": "1" if mode == "stock" else "0"}
    run = {"mode": mode, "steps": {}, "crashes": [], "initial_state": None, "fork_active": None}
    started = time.monotonic()
    with start_ranks(train_rank, WORLD_SIZE, args=(mode, steps), env=env) as ranks:
        for report in ranks.reports(timeout=TIMEOUT_S):
            if report["kind"] == "start":
                run["fork_active"] = report["fork_active"] if run["fork_active"] is None else run["fork_active"]
                run["initial_state"] = run["initial_state"] or report["initial_state"]
            elif report["kind"] == "crash":
                run["crashes"].append(report)
                print(f"  {mode:<5} step {report['step']}: rank {report['rank']} crashed: "
                      f"{report['error']}: {report['message']} ({report['shapes']})", flush=True)
            else:
                run["steps"].setdefault(report["step"], {})[report["rank"]] = report
                if len(run["steps"][report["step"]]) == WORLD_SIZE:
                    row = summarize_step(run["steps"][report["step"]])
                    print(f"  {mode:<5} step {report['step']}: loss {row['loss']:.4f}, gathered MiB forward "
                          f"{row['forward']:.3f} recompute {row['recompute']:.3f} backward {row['backward']:.3f}",
                          flush=True)
        run["exit_codes"] = ranks.exit_codes
    run["seconds"] = time.monotonic() - started
    run["rows"] = [summarize_step(run["steps"][step]) for step in sorted(run["steps"])
                   if len(run["steps"][step]) == WORLD_SIZE]
    return run


def summarize_step(reports):
    """One step over the ranks: the mean loss (the global batch's), rank 0's gathered MiB by phase."""
    first = reports[0]
    return dict(loss=sum(r["loss"] for r in reports.values()) / len(reports),
                regathered=first["regathered_bytes"] / MIB,
                **{phase: nbytes / MIB for phase, nbytes in first["phase_bytes"].items()})


def plain_pytorch_losses(initial_state, steps):
    """The same training without DeepSpeed, one process, both ranks' micro-batches in one batch."""
    import torch
    model = build_model()
    model.load_state_dict({name: torch.from_numpy(values) for name, values in initial_state.items()})
    optimizer = optimizer_for(model)
    inputs = [batch(rank) for rank in range(WORLD_SIZE)]
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        # the mean of the ranks' mean losses: DeepSpeed averages the ranks' gradients
        loss = sum(model(**micro).loss for micro in inputs) / WORLD_SIZE
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def fork_trained(run, steps):
    """Every step ran on every rank, with the fork active, and every rank exited 0."""
    return (len(run["rows"]) == steps and not run["crashes"] and run["fork_active"] is True
            and run["exit_codes"] == [0] * WORLD_SIZE)


def max_difference(a, b):
    return max((abs(x - y) for x, y in zip(a, b)), default=math.nan)


def verdict(version, runs, plain, steps):
    """Two lines: what stock did, what the fork did."""
    stock, fork = runs["stock"], runs["fork"]
    fork_losses = [row["loss"] for row in fork["rows"]]
    if not fork_trained(fork, steps):
        fork_line = (f"the fork did NOT train {steps} steps (crashes: {fork['crashes'][:1]}, active: "
                     f"{fork['fork_active']}, rank exit codes {fork['exit_codes']})")
    else:
        fork_line = (f"the fork trained {steps} steps, loss {fork_losses[0]:.4f} -> {fork_losses[-1]:.4f}, "
                     f"plain PyTorch's to {max_difference(fork_losses, plain):.1e}")
    if stock["crashes"]:
        crash = stock["crashes"][0]
        return (f"DeepSpeed {version}: stock crashed in step {crash['step']}: {crash['error']} ({crash['shapes']})",
                fork_line)
    stock_losses = [row["loss"] for row in stock["rows"]]
    stock_regathered = sum(row["regathered"] for row in stock["rows"]) / max(1, len(stock["rows"]))
    fork_regathered = sum(row["regathered"] for row in fork["rows"]) / max(1, len(fork["rows"]))
    stock_backward = sum(row["recompute"] + row["backward"] for row in stock["rows"]) / max(1, len(stock["rows"]))
    fork_backward = sum(row["recompute"] + row["backward"] for row in fork["rows"]) / max(1, len(fork["rows"]))
    return (f"DeepSpeed {version}: stock trained but gathered {stock_backward:.3f} MiB per step in recompute+backward, "
            f"{stock_regathered:.3f} of it released and gathered again",
            f"{fork_line}; the fork gathered {fork_backward:.3f} MiB, {fork_regathered:.3f} again; "
            f"stock's losses equal the fork's to {max_difference(stock_losses, fork_losses):.1e}")


def print_table(runs):
    header = f"{'mode':<6} {'step':>4} {'loss':>8} {'fwd MiB':>8} {'recomp MiB':>10} {'bwd MiB':>8} {'again MiB':>9}"
    print(header)
    print("-" * len(header))
    for mode, run in runs.items():
        for step, row in enumerate(run["rows"]):
            print(f"{mode:<6} {step:>4} {row['loss']:>8.4f} {row['forward']:>8.3f} {row['recompute']:>10.3f} "
                  f"{row['backward']:>8.3f} {row['regathered']:>9.3f}")
        for crash in run["crashes"][:1]:
            print(f"{mode:<6} {crash['step']:>4} crashed: {crash['error']}")


def run_demo(steps):
    """Both modes and plain PyTorch; returns (runs by mode, plain losses, verdict lines)."""
    from importlib.metadata import version
    ds_version = version("deepspeed")
    print(f"DeepSpeed {ds_version}, torch {version('torch')}, transformers {version('transformers')}, "
          f"peft {version('peft')}: {WORLD_SIZE} CPU ranks, {steps} steps per mode", flush=True)
    runs = {}
    for mode in MODES:
        print(f"{mode}: starting {WORLD_SIZE} ranks ...", flush=True)
        runs[mode] = run_mode(mode, steps)
        print(f"{mode}: done in {runs[mode]['seconds']:.0f} s", flush=True)
    initial = runs["fork"]["initial_state"] or runs["stock"]["initial_state"]
    plain = plain_pytorch_losses(initial, steps) if initial is not None else []
    return runs, plain, verdict(ds_version, runs, plain, steps)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    os.environ.update(RANK_ENV)
    quiet()
    runs, plain, lines = run_demo(args.steps)
    print()
    print_table(runs)
    print(f"plain PyTorch losses: {', '.join(f'{loss:.4f}' for loss in plain)}")
    print()
    for line in lines:
        print(line)
    return 0 if fork_trained(runs["fork"], args.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
