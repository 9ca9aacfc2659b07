"""What dtypes a benchmarked system stores its params in and computes in, for the results rows.

Note: [Adapter dtypes under ZeRO-3 bf16]
PEFT creates LoRA adapters in fp32 (``autocast_adapter_dtype``) on a bf16 base. With
``"bf16": {"enabled": true}``, DeepSpeed 0.19.8's ``deepspeed.initialize`` casts the params to bf16 only
when the model was built outside ``zero.Init`` (``_cast_module_mixed_precision``); for a model built under
``zero.Init`` (what transformers' ``from_pretrained`` does under ZeRO-3, and what the GPU benchmarks do) it
casts nothing, and ``_convert_to_zero_parameters`` partitions the adapters as they are: ``param.dtype``
and ``param.ds_tensor.dtype`` fp32, and the adapters' matmuls run in fp32 (PEFT casts the layer input to
the adapter weight's dtype). DeepSpeed 0.18.5 calls ``module.bfloat16()`` instead, adapters included,
``zero.Init`` or not. Stock DeepSpeed and the fork behave the same (tests/benchmarks/test_adapter_dtypes.py).
The benchmarks therefore keep PEFT's fp32 adapters on the bf16 base for plain PyTorch and FSDP2 too, and
FSDP2 casts no param for compute (a ``param_dtype`` would run the adapters in bf16): like for like with
ZeRO-3 on 0.19.8. Every row records what each system stored and computed in.
"""

import collections

import torch


def _name(dtype):
    return str(dtype).replace("torch.", "")


def param_dtypes(model):
    """{"trainable": {dtype: elements}, "frozen": {dtype: elements}} over ``model``'s params (ZeRO-3 params
    by their full size, FSDP2's DTensors by their global size)."""
    found = {"trainable": collections.Counter(), "frozen": collections.Counter()}
    for param in model.parameters():
        kind = "trainable" if param.requires_grad else "frozen"
        found[kind][_name(param.dtype)] += getattr(param, "ds_numel", param.numel())
    return {kind: dict(sorted(counts.items())) for kind, counts in found.items()}


def describe(dtypes):
    """"trainable fp32, frozen bf16"-style text of :func:`param_dtypes`'s result."""
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    parts = []
    for kind in ("trainable", "frozen"):
        names = "+".join(short.get(name, name) for name in dtypes.get(kind, {}))
        if names:
            parts.append(f"{kind} {names}")
    return ", ".join(parts)


class ComputeDtypes:
    """The output dtype of the first LoRA ``lora_A`` linear and of the first other linear in the next forward:
    the dtypes the adapters and the base layers compute in."""

    def __init__(self, model):
        self.seen = {}
        self._handles = []
        for role, wanted in (("adapter", lambda name: ".lora_A." in name),
                             ("base", lambda name: ".lora_" not in name and name.endswith(("q_proj", "base_layer")))):
            module = next((module for name, module in model.named_modules()
                           if isinstance(module, torch.nn.Linear) and wanted(name)), None)
            if module is not None:
                self._handles.append(module.register_forward_hook(self._recorder(role)))

    def _recorder(self, role):
        def record(module, inputs, output):
            self.seen.setdefault(role, _name(output.dtype))

        return record

    def take(self):
        """The dtypes seen; removes the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return dict(self.seen)
