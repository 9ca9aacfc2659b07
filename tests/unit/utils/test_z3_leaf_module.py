"""Gather units on a real HF model: a tiny Llama with PEFT LoRA and HF gradient checkpointing (ZeRO-3, 2 gloo ranks).

The rules are tested in tests/unit/runtime/zero/test_gather_units.py; here the adapter
(zero3_ac/utils/z3_leaf_module.py) meets transformers, PEFT and DeepSpeed: which modules become
units under each setting, that training matches plain PyTorch and the per-module lifecycle, that
nothing stays gathered, and that units gather the same bytes with far fewer hooked modules.
"""

import copy

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (assert_close_deltas, assert_fork_state, assert_no_backward_regather,
                                               assert_nothing_drained, assert_partitioned, fork_disabled, named_values,
                                               zero_config)

WORLD_SIZE = 2
STEPS = 2
LR = 0.05
VOCAB = 64
LEAN = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}

pytestmark = pytest.mark.skipif(fork_disabled(), reason="gather units are the fork's")


def tiny_lora_llama(use_reentrant):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, max_position_embeddings=32))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    if use_reentrant:
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    # PEFT initialises lora_B to zeros; non-zero values make every LoRA path carry a gradient from the first step.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    model.train()
    return model


def batches(world_size):
    generator = torch.Generator().manual_seed(7)
    return [[torch.randint(0, VOCAB, (2, 12), generator=generator) for _ in range(world_size)] for _ in range(STEPS)]


def reference_deltas(model, data):
    """Plain PyTorch, the mean loss over the ranks' micro-batches per step (what data parallel averages)."""
    model = copy.deepcopy(model)
    initial = {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}
    optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=LR)
    for row in data:
        loss = sum(model(input_ids=ids, labels=ids).loss for ids in row) / len(row)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: param.detach() - initial[name] for name, param in model.named_parameters() if param.requires_grad}


def train_case(use_reentrant=False, config_units=None, api_units=None, user_leaf=None):
    """Train under ZeRO-3; returns the units chosen, the hooked module count and the bytes gathered per step."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import set_z3_leaf_modules
    import zero3_ac
    from zero3_ac.utils.gather_meter import GatherMeter
    from zero3_ac.utils.z3_leaf_module import is_gather_unit
    assert_fork_state()
    rank = dist.get_rank()
    model = tiny_lora_llama(use_reentrant)
    data = batches(dist.get_world_size())
    expected = reference_deltas(model, data)
    if user_leaf is not None:
        set_z3_leaf_modules(model, [user_leaf])
    if api_units is not None:
        zero3_ac.set_gather_units(model, api_units)
    config = zero_config(3, **LEAN)
    if config_units is not None:
        config["zero3_ac"] = {"gather_units": config_units}
    trainable = [param for param in model.parameters() if param.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trainable, lr=LR), config=config)
    initial = named_values(engine)
    gathers = GatherMeter(engine)
    step_bytes = []
    for index, row in enumerate(data):
        gathers.reset()
        loss = engine(input_ids=row[rank], labels=row[rank]).loss
        engine.backward(loss)
        assert_partitioned(engine, f"after backward {index}")
        assert_no_backward_regather(gathers, f"backward {index}")
        step_bytes.append(sum(gathers.phase_bytes.values()))
        engine.step()
        assert_partitioned(engine, f"after step {index}")
    final = named_values(engine)
    assert_close_deltas({name: final[name] - initial[name] for name in expected}, expected, torch.float32)
    assert_nothing_drained(engine, "gather units")
    names = {module: name for name, module in engine.module.named_modules()}
    result = dict(units=sorted(names[module] for module in names if is_gather_unit(module)),
                  user_leaf_params=sorted(name for name, param in engine.module.named_parameters()
                                          if hasattr(param, "ds_z3_leaf_module")),
                  hooked_modules=len(engine.optimizer.parameter_offload.forward_hooks) // 2,
                  step_bytes=step_bytes)
    engine.destroy()
    return result


LAYERS = ["base_model.model.model.layers.0", "base_model.model.model.layers.1"]


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_each_checkpointed_decoder_layer_is_a_unit_and_trains_like_pytorch_and_per_module(use_reentrant):
    units, per_module = (run_distributed(WORLD_SIZE, train_case, use_reentrant=use_reentrant, config_units=setting)[0]
                         for setting in (None, "off"))
    assert units["units"] == LAYERS and per_module["units"] == []
    assert units["user_leaf_params"] == []
    # Per-module ZeRO-3 gathers 8 KiB less in its first step than in the next (units: the same in both);
    # from the second step on both gather the same bytes.
    assert units["step_bytes"][-1] == per_module["step_bytes"][-1], (units, per_module)
    assert max(units["step_bytes"]) == per_module["step_bytes"][-1], (units, per_module)
    assert units["hooked_modules"] * 4 < per_module["hooked_modules"], (units, per_module)


def test_the_api_wins_over_the_config_and_class_names_choose_the_units():
    chosen = run_distributed(WORLD_SIZE, train_case, config_units="auto", api_units=["LlamaMLP"])[0]
    assert chosen["units"] == [f"{layer}.mlp" for layer in LAYERS]
    off = run_distributed(WORLD_SIZE, train_case, config_units="auto", api_units="off")[0]
    assert off["units"] == []


def test_a_users_leaf_stays_a_leaf_of_zero3_and_the_units_around_it_are_not_made():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    result = run_distributed(WORLD_SIZE, train_case, user_leaf=LlamaDecoderLayer)[0]
    assert result["units"] == []
    assert result["user_leaf_params"] and all(name.startswith(tuple(LAYERS)) for name in result["user_leaf_params"])


@pytest.mark.parametrize("units", ["all", [], [""], "LlamaMLP", 3])
def test_a_bad_setting_names_the_accepted_values(units):
    import zero3_ac
    with pytest.raises(ValueError, match=r'"auto", "off" or a non-empty list of module class names'):
        zero3_ac.set_gather_units(torch.nn.Linear(2, 2), units)


def test_a_config_section_with_an_unknown_key_is_refused():
    from zero3_ac.utils.z3_leaf_module import remember_config_setting
    with pytest.raises(ValueError, match=r'takes only "gather_units"'):
        remember_config_setting(torch.nn.Linear(2, 2), {"zero3_ac": {"gather_unit": "off"}})


def test_a_class_name_that_no_module_of_the_model_has_is_refused_with_the_models_classes():
    import zero3_ac
    from zero3_ac.utils.z3_leaf_module import mark_gather_units
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    zero3_ac.set_gather_units(model, ["NoSuchLayer", "Linear"])
    with pytest.raises(ValueError, match=r"\['NoSuchLayer'\].*\['Linear', 'Sequential'\]"):
        mark_gather_units(model, max_live_numel=10**9)


@pytest.mark.parametrize("section", ["off", ["LlamaDecoderLayer"], True])
def test_a_config_section_that_is_not_a_dict_shows_the_dict_it_takes(section):
    from zero3_ac.utils.z3_leaf_module import remember_config_setting
    with pytest.raises(ValueError, match=r'"zero3_ac" section must be a dict such as \{"gather_units": "off"\}'):
        remember_config_setting(torch.nn.Linear(2, 2), {"zero3_ac": section})
