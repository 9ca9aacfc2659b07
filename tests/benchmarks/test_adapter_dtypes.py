"""Note: [Adapter dtypes under ZeRO-3 bf16] (benchmarks/dtypes.py), on the real engine: with a bf16 config,
PEFT's fp32 LoRA adapters stay fp32 (param, partition and compute) when the base was built under
``zero.Init`` on a DeepSpeed with the per-policy cast (``_cast_module_mixed_precision``: 0.19.8, not 0.18.5),
and are cast to bf16 with everything else otherwise. Upstream's semantics: the same on stock DeepSpeed
(``--stock``) and the fork."""

import os
import sys

import pytest

from tests.unit.common import run_distributed

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def _dtypes_after_initialize(zero_init):
    import deepspeed
    import torch
    sys.path.insert(0, BENCHMARKS)
    from dtypes import ComputeDtypes
    from workload import build_model, zero3_config
    config = zero3_config("cpu", 1, torch.bfloat16)
    model = build_model("tiny", "none", False, torch.bfloat16, ds_config=config if zero_init else None)
    trainable = [param for param in model.parameters() if param.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-4), config=config)
    stored = {}
    for name, param in engine.module.named_parameters():
        if "layers.0.self_attn.q_proj." in name:
            role = "adapter" if ".lora_" in name else "base"
            stored.setdefault(role, set()).update({str(param.dtype), str(param.ds_tensor.dtype)})
    compute = ComputeDtypes(engine.module)
    ids = torch.randint(0, 512, (1, 16))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return {role: sorted(dtypes) for role, dtypes in stored.items()}, compute.take()


def _casts_per_policy():
    from deepspeed.runtime.engine import DeepSpeedEngine
    return hasattr(DeepSpeedEngine, "_cast_module_mixed_precision")


@pytest.mark.parametrize("zero_init", [True, False])
def test_bf16_engine_keeps_peft_adapters_fp32_only_under_zero_init_with_the_per_policy_cast(zero_init):
    adapter = "float32" if zero_init and _casts_per_policy() else "bfloat16"
    [(stored, compute)] = run_distributed(1, _dtypes_after_initialize, zero_init)
    assert stored == {"adapter": [f"torch.{adapter}"], "base": ["torch.bfloat16"]}
    assert compute == {"adapter": adapter, "base": "bfloat16"}
