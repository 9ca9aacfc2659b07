"""A user's ZeRO-3 leaf inside a gather unit keeps upstream's leaf semantics (2 gloo ranks, ZeRO-3).

A leaf's params are reduced together from the leaf's backward hook, with zeros for the ones that got
no gradient, so every rank reduces the same params in the same order whatever ran where (MoE experts
routed per rank). When the fork's unit around the leaf hid it, those params fell back to per-param
reduction: ranks whose experts differed reduced different buckets (a gloo size mismatch), or, with
experts of one shape, averaged different experts' gradients silently.

Both models below are compared with plain PyTorch on the mean loss over the ranks' micro-batches.
"""

import copy

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import assert_close_deltas, assert_fork_state, named_values, zero_config

WORLD_SIZE = 2
GAS = 2
STEPS = 2
LR = 0.05
VOCAB = 64
SEQ = 8
LEAN = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}


def _with_nonzero_lora_b(model):
    """PEFT starts lora_B at zero; non-zero values give every adapter a gradient from the first step."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    return model.train()


def switch_transformer():
    """HF SwitchTransformers with one module per expert and top-1 routing, LoRA on every linear, its
    sparse MLPs ZeRO-3 leaves as HF and DeepSpeed document for MoE under ZeRO-3."""
    from deepspeed.utils import set_z3_leaf_modules
    from peft import LoraConfig, get_peft_model
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration
    from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersSparseMLP
    torch.manual_seed(0)
    config = SwitchTransformersConfig(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
                                      num_heads=2, num_experts=4, num_sparse_encoder_layers=1,
                                      num_sparse_decoder_layers=1, expert_capacity=2 * SEQ, router_jitter_noise=0.0,
                                      dropout_rate=0.0, decoder_start_token_id=0)
    model = SwitchTransformersForConditionalGeneration(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules="all-linear"))
    set_z3_leaf_modules(model, [SwitchTransformersSparseMLP])
    return _with_nonzero_lora_b(model)


class AdapterChoosingMLP(torch.nn.Module):
    """A frozen MLP plus equal-shaped adapters, two of which each call picks from its data."""

    def __init__(self, mlp, hidden, adapters=4):
        super().__init__()
        self.mlp = mlp
        self.adapters = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(adapters))

    def forward(self, x):
        first = int(x.detach().flatten().argmax()) % len(self.adapters)
        chosen = (first, (first + 1) % len(self.adapters))
        return self.mlp(x) + sum(self.adapters[index](x) for index in chosen)


def llama_with_chosen_adapters():
    """A tiny HF Llama whose MLPs (ZeRO-3 leaves) pick adapters per call inside checkpointed layers."""
    from deepspeed.utils import set_z3_leaf_modules
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, max_position_embeddings=32))
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.mlp = AdapterChoosingMLP(layer.mlp, 16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    set_z3_leaf_modules(model, [AdapterChoosingMLP])
    return model.train()


MODELS = {"switch_transformer": switch_transformer, "llama_with_chosen_adapters": llama_with_chosen_adapters}


def _batches(world_size):
    """``data[step][micro][rank]``: different tokens per rank, so the ranks route differently."""
    generator = torch.Generator().manual_seed(11)
    return [[[torch.randint(2, VOCAB, (2, SEQ), generator=generator) for _ in range(world_size)] for _ in range(GAS)]
            for _ in range(STEPS)]


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _reference_deltas(model, data):
    model = copy.deepcopy(model)
    initial = {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}
    optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=LR)
    for micro_batches in data:
        for row in micro_batches:
            (sum(_loss(model, ids) for ids in row) / (len(row) * GAS)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: param.detach() - initial[name] for name, param in model.named_parameters() if param.requires_grad}


def train_like_pytorch(model_name):
    import deepspeed
    import deepspeed.comm as dist
    assert_fork_state()
    rank = dist.get_rank()
    model = MODELS[model_name]()
    data = _batches(dist.get_world_size())
    expected = _reference_deltas(model, data)
    trainable = [param for param in model.parameters() if param.requires_grad]
    engine, *_ = deepspeed.initialize(model=model,
                                      optimizer=torch.optim.SGD(trainable, lr=LR),
                                      config=zero_config(3, gas=GAS, **LEAN))
    initial = named_values(engine)
    for micro_batches in data:
        for row in micro_batches:
            engine.backward(_loss(engine, row[rank]))
            engine.step()
    final = named_values(engine)
    assert_close_deltas({name: final[name] - initial[name] for name in expected}, expected, torch.float32)
    leaf_params = sum(hasattr(param, "ds_z3_leaf_module") for param in engine.module.parameters())
    engine.destroy()
    return leaf_params


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_a_users_leaf_inside_a_checkpointed_layer_trains_like_pytorch(model_name):
    leaf_params = run_distributed(WORLD_SIZE, train_like_pytorch, model_name)
    assert leaf_params[0] > 0 and leaf_params[0] == leaf_params[1]
