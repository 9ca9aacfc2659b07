"""LoRA SFT of a Llama-style model with TRL's ``SFTTrainer``, DeepSpeed ZeRO-3 and non-reentrant checkpointing.

TRL forces ``use_reentrant=True`` when PEFT, ZeRO-3 and gradient checkpointing meet, because stock
DeepSpeed used to crash there (``CheckpointError``). With the fork installed that crash is gone, so
the script hands the trainer ``zero3_ac.integrations.trl.KeepNonReentrantCheckpointing``, which
keeps the config's non-reentrant checkpointing (docs/clients.md). ``--trl-default`` leaves it out, to compare.

``--offload-activations trl|deepspeed|transformers`` offloads activations to host memory on GPUs
(``activation_offload.py``).

Same model, data, launchers and options as ``hf_trainer_lora.py`` (docs/clients.md), e.g. on CPU:

    DS_ACCELERATOR=cpu accelerate launch --config_file examples/accelerate_zero3.yaml \\
        examples/trl_sft_lora.py --ddp-backend gloo
"""


import activation_offload
from hf_trainer_lora import RepeatingSequences, argument_parser, build_model, check_world_size, trainer_kwargs
from clean_exit import process_groups_destroyed_at_exit
from lifecycle_probe import train_with_probe


def trl_callbacks(args, config):
    """The callbacks that keep the config's checkpointing, unless ``--trl-default`` asks for TRL's choice."""
    from zero3_ac.integrations.trl import KeepNonReentrantCheckpointing
    return [] if args.trl_default else [KeepNonReentrantCheckpointing(config)]


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
    offload, offload_checkpointing_kwargs = activation_offload.config_changes(args.offload_activations)
    return SFTConfig(**trainer_kwargs(args, "trl_sft_lora_", **offload_checkpointing_kwargs),
                     max_length=args.seq_len,
                     **offload)


def main(argv=None):
    from datasets import Dataset
    from trl import SFTTrainer
    parser = argument_parser(__doc__)
    parser.add_argument("--trl-default", action="store_true", help="keep TRL's forced use_reentrant=True")
    parser.add_argument("--offload-activations", choices=activation_offload.CHOICES, default=None,
                        help="offload activations to host memory (GPUs): activation_offload.py")
    args = parser.parse_args(argv)
    config = sft_config(args)
    check_world_size(config)
    samples = RepeatingSequences(args.batch_size * config.world_size, args.seq_len, args.vocab_size)
    dataset = Dataset.from_dict({"input_ids": [samples[i]["input_ids"].tolist() for i in range(len(samples))]})
    trainer_class = activation_offload.offloading_trainer(SFTTrainer, args.offload_activations) \
        if args.offload_activations else SFTTrainer
    trainer = trainer_class(model=build_model(args), args=config, train_dataset=dataset,
                            processing_class=build_tokenizer(args.vocab_size), callbacks=trl_callbacks(args, config))
    train_with_probe(trainer, args.summary)


if __name__ == "__main__":
    with process_groups_destroyed_at_exit():
        main()
