"""QLoRA: LoRA on a 4-bit (NF4) Llama with the HF Trainer, DeepSpeed ZeRO-3 and non-reentrant checkpointing.

The base model is built from a small config (random init), saved to a temporary directory and
loaded back with a bitsandbytes ``BitsAndBytesConfig`` (4-bit NF4 weights packed in bf16 storage,
the PEFT recipe for QLoRA under ZeRO-3), as a downloaded checkpoint would be; then
``peft.prepare_model_for_kbit_training`` and LoRA on every linear layer. Nothing here mentions the
fork. Same launchers and options as ``hf_trainer_lora.py`` (docs/clients.md); the 4-bit layers
compute in fp32 by default (bitsandbytes runs them on CPU too), in bf16 with ``--bf16``. On CPU:

    DS_ACCELERATOR=cpu accelerate launch --config_file examples/accelerate_zero3.yaml \\
        examples/qlora_lora.py --ddp-backend gloo

The summary (``--summary DIR``) also says how ZeRO-3 holds the 4-bit weights (``quantized_weights``).

Note: [4-bit weights under ZeRO-3]
transformers never creates a quantized model under ``deepspeed.zero.Init`` (``from_pretrained``
leaves it out whenever a quantizer is given, whatever ``zero3_init_flag`` says), so every rank
first loads the whole 4-bit model, unpartitioned. The weights become ZeRO-3 params in
``deepspeed.initialize``: the engine converts every param that is not one yet
(``DeepSpeedZeRoOffload._convert_to_zero_parameters``, ``zero.Init(module=...)``), broadcast from
rank 0 byte for byte and partitioned like any frozen param: each rank keeps 1/world of the packed
bf16 storage (``ds_tensor``), and ZeRO-3's hooks gather the whole packed tensor before the layer
runs and release it after, in the forward, the recompute and the backward alike. The param stays
a bitsandbytes ``Params4bit``; its ``quant_state`` (one absmax per 64-weight block, the NF4 code,
the shape) is a plain attribute, not a param or buffer, so it is neither partitioned nor gathered:
every rank keeps all of it, from its own (deterministic) quantization of the same checkpoint.
The bf16 storage keeps DeepSpeed's bf16 cast of floating params (``bf16.enabled``) a no-op on the
packed weights.
"""

import math
import tempfile
from importlib import metadata

import torch

from hf_trainer_lora import (RepeatingSequences, argument_parser, check_world_size, llama_config, lora_config,
                             training_arguments)
from clean_exit import process_groups_destroyed_at_exit
from lifecycle_probe import LifecycleProbe, train_with_probe

QUANT_STORAGE = torch.bfloat16


def quantization_config(args):
    from transformers import BitsAndBytesConfig
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                              bnb_4bit_quant_storage=QUANT_STORAGE)


def save_random_base(args, directory):
    """The random-init Llama of ``args`` as a checkpoint in ``directory`` (in the quant storage dtype).

    Call it before the process group exists (before ``TrainingArguments``): once torch.distributed
    is initialized, ``save_pretrained`` writes on rank 0 only, and each rank here has its own directory.
    """
    from transformers import LlamaForCausalLM
    torch.manual_seed(args.seed)
    LlamaForCausalLM(llama_config(args)).to(QUANT_STORAGE).save_pretrained(directory)


def load_qlora_model(args, directory):
    """The checkpoint in ``directory`` loaded in 4 bits, prepared for k-bit training, with LoRA.

    No ``device_map``: transformers refuses one under ZeRO-3, and bitsandbytes' quantizer then loads
    the model on the current device (the rank's GPU, which ``TrainingArguments`` has set; or the CPU).
    """
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(directory, quantization_config=quantization_config(args),
                                             dtype=QUANT_STORAGE)
    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": args.use_reentrant})
    torch.manual_seed(args.seed)
    return get_peft_model(model, lora_config(args))


def quantized_weights(engine, world_size):
    """How the engine holds the model's ``Params4bit`` weights (Note: [4-bit weights under ZeRO-3])."""
    from bitsandbytes.nn import Params4bit
    weights = [p for p in engine.module.parameters() if isinstance(p, Params4bit)]
    zero = [p for p in weights if hasattr(p, "ds_id")]
    return {
        "count": len(weights),
        "zero_params": len(zero),
        "trainable": sum(p.requires_grad for p in weights),
        "with_quant_state": sum(p.quant_state is not None for p in weights),
        "storage_dtypes": sorted({str(getattr(p, "ds_tensor", p).dtype) for p in weights}),
        "packed_elements": sum(p.ds_numel for p in zero),
        "partition_elements": sum(p.ds_tensor.numel() for p in zero),
        "partitioned_evenly": sum(p.ds_tensor.numel() == math.ceil(p.ds_numel / world_size) for p in zero),
        "quant_state_absmax_elements": sum(p.quant_state.absmax.numel() for p in weights if p.quant_state is not None),
    }


class QLoRAProbe(LifecycleProbe):
    """:class:`LifecycleProbe` that also records, at the start of training, how ZeRO-3 holds the 4-bit weights."""

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self.summary["versions"]["bitsandbytes"] = metadata.version("bitsandbytes")
        self.summary["quantized_weights"] = quantized_weights(self.engine, args.world_size)


def main(argv=None):
    from transformers import Trainer
    args = argument_parser(__doc__).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qlora_base_") as base:
        save_random_base(args, base)
        training_args = training_arguments(args)
        check_world_size(training_args)
        model = load_qlora_model(args, base)
    dataset = RepeatingSequences(args.batch_size * training_args.world_size, args.seq_len, args.vocab_size)
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    train_with_probe(trainer, args.summary, probe_class=QLoRAProbe)


if __name__ == "__main__":
    with process_groups_destroyed_at_exit():
        main()
