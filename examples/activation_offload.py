"""CPU offload of the activations checkpointing keeps, for ``trl_sft_lora.py --offload-activations``.

Three offloaders, each a ``saved_tensors_hooks`` that copies saved tensors to host memory in the
forward and back in the backward (docs/clients.md, "Activation offload"):

- ``trl``: TRL's ``SFTConfig(activation_offloading=True)`` (``trl.models.activation_offloading``):
  every saved tensor of the step except parameters and the LM head's; needs an accelerator.
- ``deepspeed``: DeepSpeed's ``CheckpointHiddenStatesOffload`` (0.19.8+): only the hidden states a
  ``GradientCheckpointingLayer`` checkpoints, marked when the layer is called.
- ``transformers``: ``activation_checkpointing_kwargs={"offload": True}`` (transformers 5): the inputs
  of each checkpointed layer, under ``torch.autograd.graph.save_on_cpu``; needs pinned memory.

The trainer logs ``offload/tensors``, how many tensors the offloader moved to host memory in the
step, where the offloader counts them (TRL's and DeepSpeed's).
"""

CHOICES = ("trl", "deepspeed", "transformers")


def config_changes(how):
    """(SFTConfig arguments, checkpointing kwargs) that select offloader ``how`` (None: no offload)."""
    if how == "trl":
        return {"activation_offloading": True}, {}
    if how == "transformers":
        return {}, {"offload": True}
    return {}, {}


def offloading_trainer(trainer_class, how):
    """A ``trainer_class`` that offloads with ``how`` (see :func:`config_changes`) and logs ``offload/tensors``."""
    if how == "deepspeed":
        try:
            from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload
        except ImportError as error:
            raise SystemExit("--offload-activations deepspeed needs DeepSpeed 0.19.8 or later "
                             f"(CheckpointHiddenStatesOffload): {error}")

    class OffloadingTrainer(trainer_class):

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.offloaded_tensors = None
            if how == "deepspeed":
                self.hidden_states_offload = CheckpointHiddenStatesOffload()
            if how == "trl":
                self._count_trl_offloads(self.maybe_activation_offload_context)

        def _count_trl_offloads(self, offload):
            pack = offload.pack_hook

            def counting_pack(tensor):
                tensor_id = pack(tensor)
                if offload.tracker[tensor_id][1]:  # TRL marks a tensor it copied to the host
                    self.offloaded_tensors += 1
                return tensor_id

            offload.pack_hook = counting_pack

        def training_step(self, *args, **kwargs):
            if how == "trl":
                self.offloaded_tensors = 0
            if how != "deepspeed":
                return super().training_step(*args, **kwargs)
            with self.hidden_states_offload:
                loss = super().training_step(*args, **kwargs)
            self.offloaded_tensors = self.hidden_states_offload.stats.offloaded_tensors
            return loss

        def log(self, logs, *args, **kwargs):
            if "loss" in logs and self.offloaded_tensors is not None:
                logs["offload/tensors"] = self.offloaded_tensors
            return super().log(logs, *args, **kwargs)

    return OffloadingTrainer
