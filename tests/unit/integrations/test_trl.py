"""``zero3_ac.integrations.trl.KeepNonReentrantCheckpointing`` with TRL's trainers, on one CPU rank under ZeRO-3.

- TRL's six trainers that force ``use_reentrant=True`` for PEFT + ZeRO-3 (SFT, DPO, GRPO, KTO,
  Reward, RLOO) do so without the callback, and keep the user's ``use_reentrant=False`` with it.
- SFT and DPO trained with the callback run torch's non-reentrant checkpoint (seen from inside the
  decoder layers: forward under its checkpoint hook, recompute under its recomputation hook), gather
  no frozen param twice in a backward and leave nothing gathered, and log what TRL's reentrant run
  of the same trainer logs.
- An explicit ``use_reentrant=True`` is kept; without the fork, or added after the trainer was
  built, the callback refuses.
"""

import contextlib
import importlib.util
import json
import math
import os
import sys
import tempfile

import pytest

from tests.unit.common import run_distributed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLES = os.path.join(REPO, "examples")
VOCAB = 64
SEQ_LEN = 16
LAYERS = 2
STEPS = 3
BATCH = 2
# Reentrant and non-reentrant checkpointing run the same ops on the same values in the same order
# (the recompute replays the forward), so on one rank the two runs agree to the last bit in practice;
# the tolerance (that of tests/integration/test_parity_with_stock.py) leaves room for a reduction
# order that differs, not for a wrong step.
RTOL = 1e-5
ATOL = 1e-6
TRAINERS = ["sft", "dpo", "grpo", "kto", "reward", "rloo"]


# --------------------------------------------------------------------------- run in the worker


def _examples_importable():
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)


@contextlib.contextmanager
def _trainer_state_dropped():
    """Leave no HF/accelerate global behind for the next call in this worker (what transformers' tests do)."""
    try:
        yield
    finally:
        from accelerate.state import AcceleratorState, GradientState
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        unset_hf_deepspeed_config()


def _peft_model(sequence_classification=False):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * SEQ_LEN,
                         pad_token_id=0, num_labels=1)
    model_class = LlamaForSequenceClassification if sequence_classification else LlamaForCausalLM
    task_type = "SEQ_CLS" if sequence_classification else "CAUSAL_LM"
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type=task_type,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model_class(config), lora)


def _reward(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


def _config(kind, use_reentrant):
    import trl
    with open(os.path.join(EXAMPLES, "ds_config_zero3_tiny_model.json")) as ds_config:
        deepspeed = json.load(ds_config)
    common = dict(output_dir=tempfile.mkdtemp(prefix=f"zero3ac-trl-{kind}-"), deepspeed=deepspeed, max_steps=STEPS,
                  per_device_train_batch_size=BATCH, learning_rate=1e-2, lr_scheduler_type="constant",
                  warmup_steps=0, max_grad_norm=1.0, bf16=False, gradient_checkpointing=True, logging_steps=1,
                  save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    if use_reentrant is not None:
        common["gradient_checkpointing_kwargs"] = {"use_reentrant": use_reentrant}
    generation = dict(num_generations=BATCH, max_completion_length=4)
    config_class, extra = {
        "sft": (trl.SFTConfig, dict(max_length=SEQ_LEN)),
        "dpo": (trl.DPOConfig, dict(max_length=SEQ_LEN)),
        "kto": (trl.KTOConfig, dict(max_length=SEQ_LEN)),
        "reward": (trl.RewardConfig, dict(max_length=SEQ_LEN)),
        "grpo": (trl.GRPOConfig, generation),
        "rloo": (trl.RLOOConfig, generation),
    }[kind]
    return config_class(**common, **extra)


def _trainer(kind, config, callbacks=(), trainer_class=None):
    import trl
    from datasets import Dataset
    _examples_importable()
    from trl_dpo_lora import counting_text, preference_pairs
    from trl_sft_lora import build_tokenizer
    rows = BATCH * STEPS
    prompts = [counting_text(range(7 * i, 7 * i + SEQ_LEN // 2), VOCAB) for i in range(rows)]
    pairs = preference_pairs(rows, SEQ_LEN // 2, SEQ_LEN // 4, VOCAB)
    if kind == "sft":
        train = Dataset.from_dict({"text": [counting_text(range(7 * i, 7 * i + SEQ_LEN), VOCAB) for i in range(rows)]})
    elif kind in ("dpo", "reward"):
        train = Dataset.from_dict(pairs if kind == "dpo" else {
            "chosen": [p + c for p, c in zip(pairs["prompt"], pairs["chosen"])],
            "rejected": [p + r for p, r in zip(pairs["prompt"], pairs["rejected"])]})
    elif kind == "kto":
        train = Dataset.from_dict({"prompt": pairs["prompt"] * 2, "completion": pairs["chosen"] + pairs["rejected"],
                                   "label": [True] * rows + [False] * rows})
    else:
        train = Dataset.from_dict({"prompt": prompts})
    trainer_class = trainer_class or {"sft": trl.SFTTrainer, "dpo": trl.DPOTrainer, "kto": trl.KTOTrainer,
                                      "reward": trl.RewardTrainer, "grpo": trl.GRPOTrainer,
                                      "rloo": trl.RLOOTrainer}[kind]
    kwargs = dict(model=_peft_model(sequence_classification=kind == "reward"), args=config, train_dataset=train,
                  processing_class=build_tokenizer(VOCAB), callbacks=list(callbacks))
    if kind == "dpo":
        kwargs["ref_model"] = None
    if kind in ("grpo", "rloo"):
        kwargs["reward_funcs"] = _reward
    return trainer_class(**kwargs)


def _both_names(args):
    return {name: (getattr(args, name) or {}).get("use_reentrant")
            for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")}


def _use_reentrant_after_init(kind, user_value, with_callback):
    from zero3_ac.integrations.trl import KeepNonReentrantCheckpointing
    with _trainer_state_dropped():
        config = _config(kind, user_value)
        callbacks = [KeepNonReentrantCheckpointing(config)] if with_callback else []
        return _both_names(_trainer(kind, config, callbacks).args)


class _CheckpointObserver:
    """Which of torch's checkpoints runs the decoder layers: the saved-tensors hook on top at each call.

    torch's non-reentrant checkpoint runs the forward under ``_checkpoint_hook`` and the recompute,
    inside the backward, under ``_recomputation_hook``; the reentrant one installs no hook (its
    forward runs under ``no_grad``, its recompute is a plain forward inside the backward).
    transformers checkpoints a decoder layer's ``forward``, not its ``__call__`` (the layer's own
    hooks stay outside), so the observer hooks the first module inside: ``input_layernorm``.
    """

    def __init__(self, model):
        self.calls = {}
        layers = [module for module in model.modules() if type(module).__name__ == "LlamaDecoderLayer"]
        assert len(layers) == LAYERS
        self.handles = [layer.input_layernorm.register_forward_pre_hook(self._record) for layer in layers]

    def _record(self, module, args):
        import torch
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        hook = hooks[0].__qualname__.split(".")[0] if hooks is not None else None
        key = f"{phase}:{hook}"
        self.calls[key] = self.calls.get(key, 0) + 1


def _train(kind, with_callback):
    from zero3_ac.integrations.trl import KeepNonReentrantCheckpointing
    _examples_importable()
    from lifecycle_probe import train_with_probe
    with _trainer_state_dropped():
        config = _config(kind, False)
        callbacks = [KeepNonReentrantCheckpointing(config)] if with_callback else []
        trainer = _trainer(kind, config, callbacks)
        observer = _CheckpointObserver(trainer.model)
        summary = train_with_probe(trainer).summary
        return {"calls": observer.calls, **{key: summary[key] for key in ("logs", "steps", "use_reentrant",
                                                                         "engine_uses_fork", "lifecycle_stats")}}


def _checkpoint_calls_per_step(kind, user_value, with_callback):
    from transformers import TrainerCallback
    from zero3_ac.integrations.trl import KeepNonReentrantCheckpointing

    class EachStep(TrainerCallback):

        def __init__(self):
            self.calls = []

        def on_step_end(self, args, state, control, **kwargs):
            self.calls.append(dict(observer.calls))
            observer.calls.clear()

    with _trainer_state_dropped():
        config = _config(kind, user_value)
        each_step = EachStep()
        callbacks = [KeepNonReentrantCheckpointing(config)] if with_callback else []
        trainer = _trainer(kind, config, [*callbacks, each_step])
        observer = _CheckpointObserver(trainer.model)
        trainer.train()
        return each_step.calls


def _refused_without_the_fork():
    import zero3_ac
    from zero3_ac.activation import DISABLE_ENV
    was_active, was_disabled = zero3_ac.is_active(), os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = "1"
    zero3_ac.remove()
    try:
        _use_reentrant_after_init("sft", False, with_callback=True)
    except RuntimeError as error:
        return str(error)
    finally:
        if was_disabled is None:
            del os.environ[DISABLE_ENV]
        else:
            os.environ[DISABLE_ENV] = was_disabled
        if was_active:
            zero3_ac.apply()
    return None


def _refused_when_added_late():
    from zero3_ac.integrations.trl import KeepNonReentrantCheckpointing
    with _trainer_state_dropped():
        config = _config("sft", False)
        trainer = _trainer("sft", config)
        trainer.add_callback(KeepNonReentrantCheckpointing(config))
        try:
            trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
        except RuntimeError as error:
            return str(error)
    return None


# --------------------------------------------------------------------------- tests


@pytest.mark.stock_fails
@pytest.mark.parametrize("kind", TRAINERS)
def test_trl_forces_reentrant_and_the_callback_keeps_the_users_non_reentrant(kind):
    forced = run_distributed(1, _use_reentrant_after_init, kind, False, with_callback=False)[0]
    assert forced["gradient_checkpointing_kwargs"] is True, forced  # TRL's override, which the callback undoes
    kept = run_distributed(1, _use_reentrant_after_init, kind, False, with_callback=True)[0]
    assert kept == {"activation_checkpointing_kwargs": False, "gradient_checkpointing_kwargs": False}


def test_with_use_reentrant_unset_trl_forces_only_the_deprecated_alias():
    # transformers 5 enables checkpointing from activation_checkpointing_kwargs, which TRL leaves None here:
    # the model starts non-reentrant, until DPO, KTO, GRPO or RLOO enable it again from the alias.
    assert run_distributed(1, _use_reentrant_after_init, "sft", None, with_callback=False)[0] == {
        "activation_checkpointing_kwargs": None, "gradient_checkpointing_kwargs": True}


@pytest.mark.stock_fails
def test_with_use_reentrant_unset_dpo_turns_reentrant_after_its_first_reference_forward_unless_the_callback_runs():
    # The reference forward disables checkpointing and enables it again from the alias TRL forced.
    non_reentrant = {"forward:_checkpoint_hook": LAYERS, "forward:None": LAYERS, "backward:_recomputation_hook": LAYERS}
    reentrant = {"forward:None": 2 * LAYERS, "backward:None": LAYERS}
    assert run_distributed(1, _checkpoint_calls_per_step, "dpo", None, with_callback=False)[0] == (
        [non_reentrant] + [reentrant] * (STEPS - 1))
    assert run_distributed(1, _checkpoint_calls_per_step, "dpo", None, with_callback=True)[0] == [non_reentrant] * STEPS


@pytest.mark.stock_fails
def test_the_callback_makes_an_unset_use_reentrant_non_reentrant():
    assert run_distributed(1, _use_reentrant_after_init, "sft", None, with_callback=True)[0] == {
        "activation_checkpointing_kwargs": False, "gradient_checkpointing_kwargs": False}


def test_the_callback_keeps_an_explicit_use_reentrant_true():
    assert run_distributed(1, _use_reentrant_after_init, "sft", True, with_callback=True)[0] == {
        "activation_checkpointing_kwargs": True, "gradient_checkpointing_kwargs": True}


@pytest.mark.stock_fails
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_with_the_callback_torch_checkpoints_non_reentrantly_and_logs_what_trl_reentrant_logs(kind):
    ours = run_distributed(1, _train, kind, with_callback=True)[0]
    trl_default = run_distributed(1, _train, kind, with_callback=False)[0]
    layer_calls = LAYERS * STEPS
    assert ours["use_reentrant"] is False and trl_default["use_reentrant"] is True
    assert ours["calls"].get("forward:_checkpoint_hook") == layer_calls, ours["calls"]
    assert ours["calls"].get("backward:_recomputation_hook") == layer_calls, ours["calls"]
    assert trl_default["calls"].get("backward:None") == layer_calls, trl_default["calls"]
    for run in (ours, trl_default):
        assert sum(n for key, n in run["calls"].items() if key.startswith("backward:")) == layer_calls, run["calls"]
    assert ours["engine_uses_fork"]
    assert [step["params_gathered_after_step"] for step in ours["steps"]] == [0] * STEPS, ours["steps"]
    assert [step["frozen_backward_regathers"] for step in ours["steps"]] == [0] * STEPS, ours["steps"]
    assert ours["lifecycle_stats"]["total_drained_params"] == 0, ours["lifecycle_stats"]
    keys = ["loss", "grad_norm"] + (["rewards/chosen", "rewards/rejected"] if kind == "dpo" else [])
    for step, (mine, theirs) in enumerate(zip(ours["logs"], trl_default["logs"], strict=True), start=1):
        for key in keys:
            assert math.isclose(mine[key], theirs[key], rel_tol=RTOL, abs_tol=ATOL), (step, key, ours["logs"],
                                                                                       trl_default["logs"])
    assert len(ours["logs"]) == STEPS


def test_without_the_fork_the_callback_refuses_naming_the_fix():
    message = run_distributed(1, _refused_without_the_fork)[0]
    assert message is not None
    assert "ZERO3_AC_DISABLE" in message and "CheckpointError" in message and "remove the callback" in message


def test_a_callback_added_after_the_trainer_was_built_refuses():
    message = run_distributed(1, _refused_when_added_late)[0]
    assert message is not None and "callbacks=[KeepNonReentrantCheckpointing(config)]" in message, message
