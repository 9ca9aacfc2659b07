"""The fork under activation offloading: TRL SFT, PEFT LoRA, ZeRO-3, non-reentrant checkpointing, one CPU rank.

An activation offloader is a ``saved_tensors_hooks`` around the training step: it packs saved
tensors (the inputs torch's non-reentrant checkpoint keeps among them) into host memory and unpacks
them in the backward, so it is on the hook stack while the fork tells a replay recompute from a
forward (Note: [Recompute and replay] in zero3_ac/runtime/zero/autograd_context.py). On CPU none of
the offloaders moves anything (examples/activation_offload.py; docs/clients.md): TRL's cannot be
built without an accelerator, transformers' needs pinned memory, DeepSpeed's skips every tensor
of a synchronized device. So the CPU tests run a stand-in that copies each saved tensor as
an offloader does, and DeepSpeed's as it runs on CPU; tests/integration/test_activation_offload.py
runs the real ones on a GPU. Each must train as without offloading (same logs), with torch's
non-reentrant checkpoint, nothing left gathered, no frozen re-gather, nothing left packed.
"""

import importlib.util
import math

import pytest
from packaging.version import Version

from tests.unit.common import run_distributed
from tests.unit.integrations.test_trl import (ATOL, LAYERS, RTOL, STEPS, _CheckpointObserver, _config,
                                              _examples_importable, _trainer, _trainer_state_dropped)
from zero3_ac import version_guard

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed")

HIDDEN_SIZE = 32  # tests/unit/integrations/test_trl.py's model


def _copying_trainer(trainer_class):
    """``trainer_class`` whose training steps run under a saved-tensors hook that copies as an offloader does.

    Like TRL's and DeepSpeed's offloaders it leaves parameters alone, packs every other saved tensor
    as a copy in new storage (the offloader's device-to-host copy) and unpacks a copy of that (the
    host-to-device copy), so the backward sees other tensors than the forward saved.
    """
    import torch

    class CopyingTrainer(trainer_class):

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.packed_hidden_states = self.unpacked_hidden_states = 0
            self.offload = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

        def _pack(self, tensor):
            if isinstance(tensor, torch.nn.Parameter):
                return tensor, False, False
            hidden_states = tensor.dim() == 3 and tensor.shape[-1] == HIDDEN_SIZE
            self.packed_hidden_states += hidden_states
            return tensor.detach().clone(), True, hidden_states

        def _unpack(self, packed):
            tensor, copied, hidden_states = packed
            self.unpacked_hidden_states += hidden_states
            return tensor.clone() if copied else tensor

        def training_step(self, *args, **kwargs):
            with self.offload:
                return super().training_step(*args, **kwargs)

    return CopyingTrainer


def _train_under(offloader):
    import trl
    from zero3_ac.integrations.trl import KeepNonReentrantCheckpointing
    _examples_importable()
    from activation_offload import offloading_trainer
    from lifecycle_probe import train_with_probe
    if offloader == "copying":
        trainer_class = _copying_trainer(trl.SFTTrainer)
    elif offloader == "deepspeed":
        trainer_class = offloading_trainer(trl.SFTTrainer, "deepspeed")
    else:
        trainer_class = trl.SFTTrainer
    with _trainer_state_dropped():
        config = _config("sft", False)
        trainer = _trainer("sft", config, [KeepNonReentrantCheckpointing(config)], trainer_class)
        observer = _CheckpointObserver(trainer.model)
        summary = train_with_probe(trainer).summary
        counts = {name: getattr(trainer, name) for name in ("packed_hidden_states", "unpacked_hidden_states")
                  if hasattr(trainer, name)}
        if offloader == "deepspeed":
            counts = dict(vars(trainer.hidden_states_offload.stats))
        return {"calls": observer.calls, "counts": counts,
                **{key: summary[key] for key in ("logs", "steps", "engine_uses_fork", "lifecycle_stats")}}


def _hidden_states_deepspeed_finds_without_zero():
    """(marked, found) hidden states of DeepSpeed's offloader in one forward and backward without ZeRO.

    On CPU a marked tensor that reaches its pack hook is counted as skipped.
    """
    import torch
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload
    from tests.unit.integrations.test_trl import VOCAB, _peft_model
    model = _peft_model()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.arange(16).remainder(VOCAB).view(2, 8)
    offload = CheckpointHiddenStatesOffload()
    with offload:
        model(input_ids=ids, labels=ids).loss.backward()
    return offload.stats.marked_tensors, offload.stats.skipped_marked_tensors


def _assert_trained_as_without_offloading(offloaded, plain):
    layer_calls = LAYERS * STEPS
    for run in (offloaded, plain):
        assert run["calls"] == {"forward:_checkpoint_hook": layer_calls, "backward:_recomputation_hook": layer_calls}
        assert run["engine_uses_fork"]
        assert [step["params_gathered_after_step"] for step in run["steps"]] == [0] * STEPS, run["steps"]
        assert [step["frozen_backward_regathers"] for step in run["steps"]] == [0] * STEPS, run["steps"]
        assert run["lifecycle_stats"]["total_drained_params"] == 0, run["lifecycle_stats"]
    for step, (mine, theirs) in enumerate(zip(offloaded["logs"], plain["logs"], strict=True), start=1):
        for key in ("loss", "grad_norm"):
            assert math.isclose(mine[key], theirs[key], rel_tol=RTOL, abs_tol=ATOL), (step, key, offloaded["logs"],
                                                                                       plain["logs"])
    assert len(offloaded["logs"]) == STEPS


@pytest.mark.stock_fails
def test_under_a_saved_tensors_hook_that_copies_as_an_offloader_the_fork_trains_as_without_it():
    offloaded = run_distributed(1, _train_under, "copying")[0]
    plain = run_distributed(1, _train_under, None)[0]
    _assert_trained_as_without_offloading(offloaded, plain)
    counts = offloaded["counts"]
    # Each step packs the hidden states that enter both checkpointed layers (and the final norm), and
    # the backward takes every one back. (Tensors saved by nodes no backward runs, such as TRL's
    # metrics, are packed and never unpacked.)
    assert counts["packed_hidden_states"] >= LAYERS * STEPS, counts
    assert counts["unpacked_hidden_states"] == counts["packed_hidden_states"], counts


@pytest.mark.stock_fails
def test_under_deepspeeds_checkpoint_hidden_states_offload_the_fork_trains_as_without_it():
    if Version(version_guard.installed_deepspeed_version()) < Version("0.19.8"):
        pytest.skip("DeepSpeed's CheckpointHiddenStatesOffload is new in 0.19.8")
    offloaded = run_distributed(1, _train_under, "deepspeed")[0]
    plain = run_distributed(1, _train_under, None)[0]
    _assert_trained_as_without_offloading(offloaded, plain)
    # In the last step it marked the hidden states of both checkpointed layer calls, and found neither
    # among the tensors the checkpoints saved: ZeRO-3's forward pre-hook hands the layer's forward, which
    # transformers checkpoints, another tensor (docs/clients.md, "Activation offload"). Without ZeRO-3 it
    # finds both. (On CPU a found tensor is counted as skipped, never offloaded.)
    counts = offloaded["counts"]
    assert (counts["marked_tensors"], counts["skipped_marked_tensors"], counts["offloaded_tensors"]) == (LAYERS, 0, 0)
    assert run_distributed(1, _hidden_states_deepspeed_finds_without_zero)[0] == (LAYERS, LAYERS)

