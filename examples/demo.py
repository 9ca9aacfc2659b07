"""Stock DeepSpeed vs deepspeed-zero3-ac on a tiny LoRA fine-tune, on CPU with 2 ranks.

A Llama built from a small config (random init, nothing downloaded), PEFT LoRA on every linear
layer, HF gradient checkpointing with ``use_reentrant=False``, ZeRO-3. The same script runs twice,
once with ``ZERO3_AC_DISABLE=1`` (stock) and once with the fork, and prints one row per step:
whether the step crashed, left params gathered (leak) or ran clean, and the bytes all-gathered in
the forward, the recompute and the backward.

    python examples/demo.py [--steps 4] [--world-size 2]
"""

import argparse
import os
import socket
import traceback

import torch
import torch.multiprocessing as mp

MODES = ("stock", "fork")


def build_model(seed=0):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model, lora)


def gathered_params(engine):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return sum(1 for p in engine.module.parameters() if p.ds_status != ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist)


def run_rank(rank, world_size, port, mode, steps, queue):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    if mode == "stock":
        os.environ["ZERO3_AC_DISABLE"] = "1"
    import warnings
    warnings.filterwarnings("ignore")
    import deepspeed
    from deepspeed.utils import logger
    from transformers.utils import logging as hf_logging
    from zero3_ac.utils.gather_meter import GatherMeter
    logger.setLevel("ERROR")
    hf_logging.set_verbosity_error()
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        # As examples/ds_config_zero3.json: without these a model this small stays gathered from its
        # first forward on (persistent or kept for reuse), and ZeRO-3 never releases and gathers it
        # again, which is what a model far larger than the thresholds goes through.
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                              "stage3_prefetch_bucket_size": 0},
    }
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    meter = GatherMeter(engine)  # the same instrument for stock and fork
    generator = torch.Generator().manual_seed(rank)
    for step in range(steps):
        ids = torch.randint(0, 256, (2, 32), generator=generator)
        row = {"mode": mode, "step": step}
        try:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        except Exception as error:
            row.update(status=f"crash: {type(error).__name__}", loss=float("nan"), **meter.take()["phase_bytes"])
            if rank == 0:
                queue.put(row)
                queue.put(("detail", mode, traceback.format_exception_only(type(error), error)[-1].strip()))
            break
        leaked = gathered_params(engine)
        row.update(status=f"leak: {leaked} params" if leaked else "ok", loss=loss.item(), **meter.take()["phase_bytes"])
        if rank == 0:
            queue.put(row)
    if rank == 0:
        queue.put(("done", mode))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_mode(mode, world_size, steps):
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = free_port()
    processes = [
        context.Process(target=run_rank, args=(rank, world_size, port, mode, steps, queue))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    rows, details = [], []
    while not queue.empty():
        item = queue.get()
        if isinstance(item, dict):
            rows.append(item)
        elif item[0] == "detail":
            details.append(f"{item[1]}: {item[2][:160]}")
    return rows, details


def print_table(rows):
    mib = 1024 * 1024
    header = f"{'mode':<6} {'step':>4} {'loss':>8}  {'status':<20} {'fwd MiB':>8} {'recomp MiB':>10} {'bwd MiB':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['mode']:<6} {row['step']:>4} {row['loss']:>8.4f}  {row['status']:<20} "
              f"{row['forward'] / mib:>8.3f} {row['recompute'] / mib:>10.3f} {row['backward'] / mib:>8.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    from importlib.metadata import version
    print(f"deepspeed {version('deepspeed')}, torch {torch.__version__}")
    all_rows, all_details = [], []
    for mode in MODES:
        print(f"running {mode} DeepSpeed ({args.world_size} CPU ranks, {args.steps} steps)...", flush=True)
        rows, details = run_mode(mode, args.world_size, args.steps)
        all_rows += rows
        all_details += details
    print()
    print_table(all_rows)
    for line in all_details:
        print(line)


if __name__ == "__main__":
    main()
