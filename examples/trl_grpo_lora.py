"""Online RL of a LoRA adapter with TRL's ``GRPOTrainer``, DeepSpeed ZeRO-3 and non-reentrant checkpointing.

Between optimizer steps the trainer samples completions from the policy itself (``model.generate``
on the ZeRO-3 engine, which TRL runs with all params gathered: ``ds3_gather_for_generation``),
scores them with a Python reward function and trains on them; no vLLM, so it runs on CPU. TRL
forces ``use_reentrant=True`` here as in SFT; the script keeps non-reentrant checkpointing with
``KeepNonReentrantCheckpointing`` (``--trl-default`` leaves it out). Same model, launchers and
options as ``trl_sft_lora.py``; the reward is the share of even-numbered words in a completion. On CPU:

    DS_ACCELERATOR=cpu accelerate launch --config_file examples/accelerate_zero3.yaml \\
        examples/trl_grpo_lora.py --ddp-backend gloo
"""


from hf_trainer_lora import argument_parser, build_model, check_world_size, trainer_kwargs
from clean_exit import process_groups_destroyed_at_exit
from lifecycle_probe import train_with_probe
from trl_dpo_lora import counting_text
from trl_sft_lora import build_tokenizer, trl_callbacks


def even_words(completions, **kwargs):
    """The reward: for each completion, the share of its words ``t<n>`` with an even ``n``."""
    rewards = []
    for completion in completions:
        numbers = [int(word[1:]) for word in completion.split() if word[1:].isdigit()]
        rewards.append(sum(n % 2 == 0 for n in numbers) / max(1, len(numbers)))
    return rewards


def grpo_config(args):
    from trl import GRPOConfig
    return GRPOConfig(**trainer_kwargs(args, "trl_grpo_lora_"),
                      num_generations=args.num_generations,
                      max_completion_length=args.completion_len,
                      beta=args.beta)


def main(argv=None):
    from datasets import Dataset
    from trl import GRPOTrainer
    parser = argument_parser(__doc__)
    parser.add_argument("--trl-default", action="store_true", help="keep TRL's forced use_reentrant=True")
    parser.add_argument("--num-generations", type=int, default=4, help="completions sampled per prompt")
    parser.add_argument("--completion-len", type=int, default=8, help="max new tokens per completion")
    parser.add_argument("--beta", type=float, default=0.0, help="KL weight; > 0 adds a reference forward")
    args = parser.parse_args(argv)
    config = grpo_config(args)
    check_world_size(config)
    prompt_len = args.seq_len - args.completion_len
    prompts = [counting_text(range(7 * index, 7 * index + prompt_len), args.vocab_size) for index in range(args.steps * 4)]
    trainer = GRPOTrainer(model=build_model(args), reward_funcs=even_words, args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=build_tokenizer(args.vocab_size), callbacks=trl_callbacks(args, config))
    train_with_probe(trainer, args.summary)


if __name__ == "__main__":
    with process_groups_destroyed_at_exit():
        main()
