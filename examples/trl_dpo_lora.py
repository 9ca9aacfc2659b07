"""DPO of a LoRA adapter with TRL's ``DPOTrainer``, ``ref_model=None``, DeepSpeed ZeRO-3 and non-reentrant checkpointing.

With a PEFT policy and no reference model, TRL computes the reference log-probs with the same
model and its adapter disabled: each step runs two forwards of the one DeepSpeed engine (the
policy's, checkpointed and with grad; the reference's, under ``no_grad`` inside
``disable_adapter``) before the one backward. TRL forces ``use_reentrant=True`` there as in SFT;
the script keeps non-reentrant checkpointing with ``KeepNonReentrantCheckpointing``
(``--trl-default`` leaves it out). Same model, launchers and options as ``trl_sft_lora.py``; the
preference data is synthetic: the chosen completion continues the prompt's count, the rejected one
counts down. On CPU:

    DS_ACCELERATOR=cpu accelerate launch --config_file examples/accelerate_zero3.yaml \\
        examples/trl_dpo_lora.py --ddp-backend gloo
"""


from hf_trainer_lora import argument_parser, build_model, check_world_size, trainer_kwargs
from clean_exit import process_groups_destroyed_at_exit
from lifecycle_probe import train_with_probe
from trl_sft_lora import build_tokenizer, trl_callbacks

SPECIAL_TOKENS = 2  # t0 pads, t1 ends a completion


def counting_text(positions, vocab_size):
    """``"t<a> t<b> ..."`` for the given positions, skipping the special words t0 and t1."""
    return " ".join(f"t{SPECIAL_TOKENS + p % (vocab_size - SPECIAL_TOKENS)}" for p in positions)


def preference_pairs(samples, prompt_len, completion_len, vocab_size):
    """``{"prompt", "chosen", "rejected"}`` texts: the chosen completion counts on from the prompt, the rejected back."""
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for index in range(samples):
        end = 7 * index + prompt_len
        rows["prompt"].append(counting_text(range(end - prompt_len, end), vocab_size))
        rows["chosen"].append(" " + counting_text(range(end, end + completion_len), vocab_size) + " t1")
        rows["rejected"].append(" " + counting_text(range(end - 2, end - 2 - completion_len, -1), vocab_size) + " t1")
    return rows


def dpo_config(args):
    from trl import DPOConfig
    return DPOConfig(**trainer_kwargs(args, "trl_dpo_lora_"), max_length=args.seq_len, beta=args.beta)


def main(argv=None):
    from datasets import Dataset
    from trl import DPOTrainer
    parser = argument_parser(__doc__)
    parser.add_argument("--trl-default", action="store_true", help="keep TRL's forced use_reentrant=True")
    parser.add_argument("--beta", type=float, default=0.1)
    args = parser.parse_args(argv)
    config = dpo_config(args)
    check_world_size(config)
    completion_len = args.seq_len // 4
    dataset = Dataset.from_dict(preference_pairs(args.batch_size * config.world_size, args.seq_len - completion_len - 1,
                                                 completion_len, args.vocab_size))
    trainer = DPOTrainer(model=build_model(args), ref_model=None, args=config, train_dataset=dataset,
                         processing_class=build_tokenizer(args.vocab_size), callbacks=trl_callbacks(args, config))
    train_with_probe(trainer, args.summary)


if __name__ == "__main__":
    with process_groups_destroyed_at_exit():
        main()
