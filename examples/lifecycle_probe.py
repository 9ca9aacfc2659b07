"""A ``TrainerCallback`` that records what ZeRO-3 did in each step and writes it as JSON, one file per rank.

The examples add it so that a test (or a curious user) can see, without touching the training
code: the losses, whether the fork was active in this process and in the engine, how many params
were still gathered after each optimizer step, and how often frozen params were gathered again
during a backward (the re-gathers that the fork removes). It works on stock DeepSpeed too. Under a
ZeRO stage below 3 (a reference run without parameter partitioning) it records the losses and
logs only.
"""

import json
import os
import time
import traceback
from importlib import metadata

from transformers import TrainerCallback


def gathered_params(engine) -> int:
    """Non-persistent params that are not partitioned (anything else than NOT_AVAILABLE)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return sum(1 for p in engine.module.parameters() if p.ds_status != ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist)


def checkpointing_use_reentrant(model):
    """``use_reentrant`` of the checkpoint functions set on the model's layers (HF's convention).

    None without checkpointing; a list of the values found when the layers disagree.
    """
    found = []
    for module in model.modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if function is not None:
            value = getattr(function, "keywords", {}).get("use_reentrant")
            if value not in found:
                found.append(value)
    if not found:
        return None
    return found[0] if len(found) == 1 else found


def _synchronize():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_memory():
    """Peak accelerator memory of this process so far (GPUs), or None on CPU."""
    import torch
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


class LifecycleProbe(TrainerCallback):
    """Per-step ZeRO-3 checks for an HF ``Trainer`` (or TRL trainer) running DeepSpeed ZeRO-3."""

    def __init__(self, trainer, summary_dir=None):
        self.trainer = trainer
        self.summary_dir = summary_dir
        self.engine = None
        self.meter = None
        self.summary = {
            "versions": {name: _version(name) for name in ("torch", "deepspeed", "transformers", "peft", "trl")},
            "zero_stage": None,
            "fork_active": None,
            "engine_uses_fork": None,
            "use_reentrant": None,
            "losses": [],
            "logs": [],
            "steps": [],
            "lifecycle_stats": None,
            "error": None,
        }

    def on_train_begin(self, args, state, control, **kwargs):
        import zero3_ac
        from zero3_ac.utils.gather_meter import GatherMeter
        self.engine = self.trainer.deepspeed
        if self.engine is None:
            raise RuntimeError("LifecycleProbe needs a DeepSpeed run: pass a ds_config (--deepspeed, or an accelerate "
                               "config with a deepspeed plugin); its ZeRO-3 checks need zero_optimization.stage 3.")
        stage = self.engine.zero_optimization_stage()
        self.meter = GatherMeter(self.engine) if stage == 3 else None
        self.summary.update(rank=args.process_index, world_size=args.world_size, zero_stage=stage,
                            fork_active=zero3_ac.is_active(),
                            engine_uses_fork=zero3_ac.lifecycle_stats(self.engine) is not None,
                            use_reentrant=checkpointing_use_reentrant(self.engine.module))

    def on_step_begin(self, args, state, control, **kwargs):
        _synchronize()
        self._step_started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _synchronize()
        step = {"step": state.global_step, "seconds": time.perf_counter() - self._step_started,
                "peak_memory_bytes": _peak_memory()}
        if self.meter is not None:
            regathers = self.meter.frozen_regathers()
            step.update(params_gathered_after_step=gathered_params(self.engine),
                        frozen_backward_regathers=sum(n - 1 for n in regathers.values()),
                        gathered_bytes=self.meter.take()["phase_bytes"])
        self.summary["steps"].append(step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.summary["losses"].append(float(logs["loss"]))
            self.summary["logs"].append({key: float(value) for key, value in logs.items()
                                         if isinstance(value, (int, float))})

    def on_train_end(self, args, state, control, **kwargs):
        import zero3_ac
        self.summary["lifecycle_stats"] = zero3_ac.lifecycle_stats(self.engine)

    def record_error(self, error):
        self.summary["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()

    def write(self):
        if self.summary_dir is None:
            return None
        os.makedirs(self.summary_dir, exist_ok=True)
        path = os.path.join(self.summary_dir, f"rank{self.trainer.args.process_index}.json")
        with open(path, "w") as out:
            json.dump(self.summary, out, indent=1, default=str)
        return path


def train_with_probe(trainer, summary_dir=None, probe_class=LifecycleProbe):
    """``trainer.train()`` with a :class:`LifecycleProbe` (or ``probe_class``, a subclass); the summary is
    written even when training fails."""
    probe = probe_class(trainer, summary_dir)
    trainer.add_callback(probe)
    try:
        trainer.train()
    except Exception as error:
        probe.record_error(error)
        raise
    finally:
        probe.write()
    return probe


def _version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
