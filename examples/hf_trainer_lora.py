"""LoRA fine-tune of a Llama-style model with the HF Trainer, DeepSpeed ZeRO-3 and non-reentrant checkpointing.

Nothing here mentions the fork: installing ``deepspeed-zero3-ac`` is the only change. The model is
built from a small config (random init) and trained on a small synthetic dataset, so nothing is
downloaded. Launch it like any Trainer script (docs/clients.md), on GPUs:

    deepspeed --num_gpus 2 examples/hf_trainer_lora.py --deepspeed examples/ds_config_zero3_auto.json

    accelerate launch --config_file examples/accelerate_zero3.yaml examples/hf_trainer_lora.py

On CPU (DS_ACCELERATOR=cpu) add ``--ddp-backend gloo``, and give the deepspeed launcher the config
through accelerate's environment instead of ``--deepspeed`` (docs/clients.md says why):

    DS_ACCELERATOR=cpu LOCAL_SIZE=2 ACCELERATE_USE_DEEPSPEED=true \\
        ACCELERATE_DEEPSPEED_CONFIG_FILE=examples/ds_config_zero3_tiny_model.json \\
        deepspeed --num_gpus 2 examples/hf_trainer_lora.py --ddp-backend gloo

    DS_ACCELERATOR=cpu accelerate launch --config_file examples/accelerate_zero3.yaml \\
        examples/hf_trainer_lora.py --ddp-backend gloo

``--summary DIR`` makes each rank write ``DIR/rank<N>.json`` (losses, fork state, params left
gathered and frozen params gathered again in each backward); ``ZERO3_AC_DISABLE=1`` runs stock DeepSpeed.
"""

import argparse
import os
import tempfile

import torch
from torch.utils.data import Dataset

from clean_exit import process_groups_destroyed_at_exit
from lifecycle_probe import train_with_probe


class RepeatingSequences(Dataset):
    """Token sequences that count up from a per-sample offset: a pattern a few steps of LoRA can learn."""

    def __init__(self, samples, seq_len, vocab_size):
        self.samples = samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size

    def __len__(self):
        return self.samples

    def __getitem__(self, index):
        ids = (torch.arange(self.seq_len) + 7 * index) % self.vocab_size
        return {"input_ids": ids, "labels": ids.clone()}


# The benchmark's model (benchmarks/bench.py): TinyLlama-1.1B's shape, random init.
TINYLLAMA_1_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4)


def llama_config(args):
    """The Llama config of ``--shape``: TinyLlama-1.1B's, or a tiny one from the size options."""
    from transformers import LlamaConfig
    if args.shape == "tinyllama":
        return LlamaConfig(**TINYLLAMA_1_1B, max_position_embeddings=max(2048, args.seq_len))
    return LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                       num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=args.seq_len)


def lora_config(args):
    """LoRA of rank ``--lora-rank`` on every linear layer of the decoder (the LM head excepted)."""
    from peft import LoraConfig
    return LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def build_model(args):
    from peft import get_peft_model
    from transformers import LlamaForCausalLM
    torch.manual_seed(args.seed)
    return get_peft_model(LlamaForCausalLM(llama_config(args)), lora_config(args))


def trainer_kwargs(args, prefix, **checkpointing_kwargs):
    """The arguments every example gives its Trainer config (``TrainingArguments`` or a TRL config)."""
    return dict(output_dir=args.output_dir or tempfile.mkdtemp(prefix=prefix),
                deepspeed=args.deepspeed,
                ddp_backend=args.ddp_backend,
                max_steps=args.steps,
                per_device_train_batch_size=args.batch_size,
                learning_rate=args.lr,
                lr_scheduler_type="constant",
                bf16=args.bf16,
                warmup_steps=0,
                gradient_checkpointing=True,
                gradient_checkpointing_kwargs={"use_reentrant": args.use_reentrant, **checkpointing_kwargs},
                logging_steps=1,
                save_strategy="no",
                report_to="none",
                disable_tqdm=True,
                seed=args.seed)


def training_arguments(args):
    from transformers import TrainingArguments
    return TrainingArguments(**trainer_kwargs(args, "hf_trainer_lora_"))


def check_world_size(training_args):
    """Refuse a run in which each rank's Trainer thinks it is alone (unsharded data, no cross-rank logging)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if training_args.world_size != launched:
        raise SystemExit(
            f"The launcher started {launched} processes but the Trainer sees {training_args.world_size}. On CPU, "
            "accelerate sets up a process group for DeepSpeed only when it is given a backend, and "
            "TrainingArguments(deepspeed=...) does not pass one: launch with --ddp-backend gloo and the DeepSpeed "
            "config in ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_CONFIG_FILE=<ds_config> (or accelerate "
            "launch) instead of --deepspeed. See docs/clients.md.")


def argument_parser(description=__doc__):
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed", default=None,
                        help="ds_config JSON (deepspeed launcher); leave out under accelerate launch, whose config names it")
    parser.add_argument("--ddp-backend", default=None, help="torch.distributed backend; gloo on CPU (docs/clients.md)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--shape", choices=["tiny", "tinyllama"], default="tiny",
                        help="tinyllama: TinyLlama-1.1B's shape (GPUs); the size options then apply to tiny only")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPUs); fp32 by default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--use-reentrant", action="store_true", help="reentrant checkpointing (default: non-reentrant)")
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--summary", default=None, help="directory for one JSON summary per rank")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher adds it
    return parser


def main(argv=None):
    from transformers import Trainer
    args = argument_parser().parse_args(argv)
    training_args = training_arguments(args)
    check_world_size(training_args)
    dataset = RepeatingSequences(args.batch_size * training_args.world_size, args.seq_len, args.vocab_size)
    trainer = Trainer(model=build_model(args), args=training_args, train_dataset=dataset)
    train_with_probe(trainer, args.summary)


if __name__ == "__main__":
    with process_groups_destroyed_at_exit():
        main()
