"""Non-reentrant activation checkpointing under TRL's trainers, with the fork.

    from zero3_ac.integrations.trl import KeepNonReentrantCheckpointing

    config = SFTConfig(..., gradient_checkpointing=True)
    trainer = SFTTrainer(model=peft_model, args=config, ..., callbacks=[KeepNonReentrantCheckpointing(config)])

Note: [TRL's reentrant override]
    TRL's SFT, DPO, GRPO, KTO, Reward and RLOO trainers (trl 1.16) set ``use_reentrant=True`` in
    ``__init__`` when a PEFT model, DeepSpeed ZeRO-3 and gradient checkpointing meet, and warn if
    the user asked for ``False``: stock DeepSpeed before 0.19.3 crashes there with
    ``CheckpointError`` (huggingface/trl#2514). Their comment waits for deepspeedai/DeepSpeed#8130,
    which was closed unmerged; #8148 was merged instead, and stock 0.19.3+ no longer crashes but
    gathers the frozen params again in each backward. With the fork the override only costs
    speed and memory (docs/clients.md). They write it into
    ``args.gradient_checkpointing_kwargs``, transformers 5's deprecated alias of
    ``activation_checkpointing_kwargs``: the same dict when the user passed one, a new dict when
    the user passed none (then only the alias holds it). The Trainer enables checkpointing on the
    model in ``train()`` from ``activation_checkpointing_kwargs``, so after the end of ``__init__``
    is not too late; DPO, KTO, GRPO and RLOO disable it around their reference forwards (and GRPO
    and RLOO around generation) and enable it again from the alias. So the callback sets
    ``use_reentrant`` on both names in ``on_init_end``. It reads the user's request when it is
    built, from the config, because ``__init__`` overwrites the user's dict in place.
"""

from transformers import TrainerCallback

# transformers 5's name first, then its deprecated alias (the only name before transformers 5)
CHECKPOINTING_KWARGS_NAMES = ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")


def checkpointing_kwargs(args) -> dict:
    """The checkpointing kwargs in ``args``, both names merged, transformers 5's name winning."""
    merged = {}
    for name in reversed(CHECKPOINTING_KWARGS_NAMES):
        kwargs = getattr(args, name, None)
        if isinstance(kwargs, dict):
            merged.update(kwargs)
    return merged


def checkpointing_enabled(args) -> bool:
    return bool(getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False))


def require_fork():
    """Raise unless the fork is active: without it, non-reentrant checkpointing is what TRL guards against."""
    from zero3_ac import doctor
    usable, state = doctor.fork_state()
    if not usable:
        raise RuntimeError(
            f"KeepNonReentrantCheckpointing needs the zero3_ac fork, and {state}. Without it TRL's "
            "use_reentrant=True is the safe choice for PEFT + ZeRO-3: stock DeepSpeed before 0.19.3 crashes "
            "under non-reentrant checkpointing with frozen params (CheckpointError), 0.19.3 and later gather "
            "the frozen params again in every backward. Activate the fork (unset ZERO3_AC_DISABLE, install "
            "deepspeed-zero3-ac non-editable next to a supported DeepSpeed, or call zero3_ac.apply() before "
            "building the trainer), or remove the callback to keep TRL's reentrant checkpointing.")


class KeepNonReentrantCheckpointing(TrainerCallback):
    """Undo TRL's ``use_reentrant=True`` for PEFT + ZeRO-3 (Note: [TRL's reentrant override]).

    Build it from the config before the trainer, and pass it in the trainer's ``callbacks``. The
    trainer then checkpoints non-reentrantly, unless ``config`` asked for ``use_reentrant=True``,
    which is kept. It changes nothing when TRL left ``use_reentrant`` alone (no PEFT, no ZeRO-3),
    and raises when it would set it back while the fork is not active.
    """

    def __init__(self, config):
        self.user_asked_reentrant = bool(checkpointing_kwargs(config).get("use_reentrant", False))
        self.init_seen = False

    def on_init_end(self, args, state, control, **kwargs):
        self.init_seen = True
        checkpoint_kwargs = checkpointing_kwargs(args)
        if self.user_asked_reentrant or not checkpointing_enabled(args) or not checkpoint_kwargs.get("use_reentrant"):
            return
        require_fork()
        checkpoint_kwargs["use_reentrant"] = False
        for name in CHECKPOINTING_KWARGS_NAMES:
            if hasattr(args, name):
                setattr(args, name, checkpoint_kwargs)
        from deepspeed.utils import logger
        logger.info("zero3_ac: set use_reentrant=False back after TRL forced True for PEFT + ZeRO-3; "
                    "the fork runs non-reentrant checkpointing without CheckpointError or frozen re-gathers")

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.init_seen:
            raise RuntimeError(
                "KeepNonReentrantCheckpointing was added after the trainer was built: TRL overwrites "
                "use_reentrant in __init__, so the callback can no longer tell your request from TRL's. Pass it to "
                "the constructor instead: Trainer(..., args=config, "
                "callbacks=[KeepNonReentrantCheckpointing(config)]).")
