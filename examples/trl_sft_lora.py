"""LoRA SFT of a Llama-style model with TRL's ``SFTTrainer``, DeepSpeed ZeRO-3 and non-reentrant checkpointing.

TRL forces ``use_reentrant=True`` when PEFT, ZeRO-3 and gradient checkpointing meet, because stock
DeepSpeed used to crash there (``CheckpointError``). With the fork installed that crash is gone, so
this script sets non-reentrant checkpointing back after building the trainer and before
``train()``, which is when the Trainer enables checkpointing on the model
(:func:`keep_non_reentrant_checkpointing`). ``--trl-default`` skips that, to compare.

Same model, data, launchers and options as ``hf_trainer_lora.py`` (docs/clients.md), e.g. on CPU:

    DS_ACCELERATOR=cpu accelerate launch --config_file examples/accelerate_zero3.yaml \\
        examples/trl_sft_lora.py --ddp-backend gloo
"""

import tempfile

from hf_trainer_lora import RepeatingSequences, argument_parser, build_model, check_world_size
from clean_exit import process_groups_destroyed_at_exit
from lifecycle_probe import train_with_probe


def keep_non_reentrant_checkpointing(trainer):
    """Undo TRL's ``use_reentrant=True`` for PEFT + ZeRO-3; call it between ``SFTTrainer(...)`` and ``train()``."""
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):  # new name, old alias
        if hasattr(trainer.args, name):
            setattr(trainer.args, name, {**(getattr(trainer.args, name) or {}), "use_reentrant": False})


def build_tokenizer(vocab_size):
    """A word-level tokenizer over ``t0 .. t<vocab_size-1>``: TRL's trainers want one, and none is downloaded.

    Words are split on whitespace, so ``"t3 t4 t1"`` is ``[3, 4, 1]`` and decodes back to that text.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0", eos_token="t1")


def sft_config(args):
    from trl import SFTConfig
    return SFTConfig(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="trl_sft_lora_"),
        deepspeed=args.deepspeed,
        ddp_backend=args.ddp_backend,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        bf16=args.bf16,
        warmup_steps=0,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": args.use_reentrant},
        max_length=args.seq_len,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=args.seed,
    )


def main(argv=None):
    from datasets import Dataset
    from trl import SFTTrainer
    parser = argument_parser(__doc__)
    parser.add_argument("--trl-default", action="store_true", help="keep TRL's forced use_reentrant=True")
    args = parser.parse_args(argv)
    config = sft_config(args)
    check_world_size(config)
    samples = RepeatingSequences(args.batch_size * config.world_size, args.seq_len, args.vocab_size)
    dataset = Dataset.from_dict({"input_ids": [samples[i]["input_ids"].tolist() for i in range(len(samples))]})
    trainer = SFTTrainer(model=build_model(args), args=config, train_dataset=dataset,
                         processing_class=build_tokenizer(args.vocab_size))
    if not (args.trl_default or args.use_reentrant):
        keep_non_reentrant_checkpointing(trainer)
    train_with_probe(trainer, args.summary)


if __name__ == "__main__":
    with process_groups_destroyed_at_exit():
        main()
