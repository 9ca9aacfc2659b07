"""Setups around the lifecycle: where it steps aside, where it must still hold (2 gloo ranks).

Applying the fork twice and unsupported DeepSpeed versions are covered in ``test_activation``.
"""

import contextlib
import copy
import functools
import typing
from importlib.metadata import version

import pytest
import torch
from packaging.version import Version

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.test_checkpoint_lifecycle import train_and_check
from tests.unit.runtime.zero.test_selective_checkpointing import SEQUENCE, SelectiveStack
from tests.unit.runtime.zero.zero_case import (DIM, LR, CheckpointedStack, assert_close_deltas, assert_fork_state,
                                               assert_nothing_drained, assert_partitioned, fork_disabled,
                                               hpz_group_forgotten_at_exit, make_engine, micro_batches, named_values,
                                               reference_deltas, stock_deepspeed, torch_linear, zero_config)

WORLD_SIZE = 2


def train_plainly(model, config, steps=2, prepare=None):
    """Train under ``config`` and compare with plain PyTorch; returns the engine.

    ``engine.backward``: ZeRO stage 0 does not support a user ``loss.backward()``.
    """
    import deepspeed.comm as dist
    assert_fork_state()
    rank = dist.get_rank()
    batches = micro_batches(steps, dist.get_world_size(), requires_grad=True)
    expected = reference_deltas(model, batches, gas=1)
    engine = make_engine(model, config)
    if prepare is not None:
        prepare(engine)
    initial = named_values(engine)
    for row in batches:
        engine.backward(engine(row[rank]))
        engine.step()
    final = named_values(engine)
    assert_close_deltas({name: final[name] - initial[name] for name in expected}, expected, torch.float32)
    return engine


# ---------------------------------------------------------------------------- ZeRO 0-2
def lower_stage_case(stage):
    import zero3_ac
    torch.manual_seed(40)
    engine = train_plainly(CheckpointedStack(blocks=2), zero_config(stage))
    assert zero3_ac.lifecycle_stats(engine) is None, "the lifecycle must not touch a ZeRO stage below 3"
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_below_3_are_left_to_deepspeed(stage):
    """ZeRO 0-2 never partition params, so the fork installs nothing there."""
    run_distributed(WORLD_SIZE, lower_stage_case, stage)


# ---------------------------------------------------------------------------- parameter offload
def param_offload_case(use_reentrant):
    torch.manual_seed(41)
    train_and_check(CheckpointedStack(blocks=3, use_reentrant=use_reentrant),
                    zero_options={"offload_param": {
                        "device": "cpu"
                    }})


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_parameter_offload_to_cpu(use_reentrant):
    run_distributed(WORLD_SIZE, param_offload_case, use_reentrant)


# ---------------------------------------------------------------------------- ZeRO++
ZERO_PLUS_PLUS = {
    "hpz": {"zero_hpz_partition_size": WORLD_SIZE},
    "quantized_weights": {"zero_quantized_weights": True},
}


def zero_plus_plus_case(feature):
    torch.manual_seed(42)
    with hpz_group_forgotten_at_exit():
        train_and_check(CheckpointedStack(blocks=3), zero_options=ZERO_PLUS_PLUS[feature])


def _quantizer_on_this_accelerator() -> bool:
    return torch.cuda.is_available()


@pytest.mark.parametrize("feature", [
    "hpz",
    pytest.param("quantized_weights",
                 marks=pytest.mark.skipif(not _quantizer_on_this_accelerator(),
                                          reason="DeepSpeed's weight quantizer has no CPU kernel "
                                          "('This op had not been implemented on CPU backend')")),
])
def test_zero_plus_plus(feature):
    run_distributed(WORLD_SIZE, zero_plus_plus_case, feature)


# ---------------------------------------------------------------------------- compilers
def torch_compile_case(use_reentrant):
    torch.manual_seed(43)
    engine = train_plainly(CheckpointedStack(blocks=2, use_reentrant=use_reentrant),
                           zero_config(3),
                           prepare=lambda engine: engine.compile(backend="eager"))
    engine.destroy()


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_torch_compiled_module(use_reentrant):
    run_distributed(WORLD_SIZE, torch_compile_case, use_reentrant)


# ---------------------------------------------------------------------------- engines left to stock
class StepIdSGD(torch.optim.SGD):
    """SGD taking the ``step_id`` that ZenFlow's ZeRO-3 passes to the optimizer of an offloaded step."""

    def step(self, closure=None, step_id=None):
        return super().step(closure)


def deepcompile_config():
    config = zero_config(3)
    config["compile"] = {"deepcompile": True}
    return config


def zenflow_config():
    # ZenFlow's selective (top-k) steps after its warm-up rounds allocate on "cuda"
    # (``update_selected_channels``), so CPU runs stay inside the warm-up.
    config = zero_config(3,
                         offload_optimizer={"device": "cpu"},
                         zenflow={
                             "topk_ratio": 0.5,
                             "select_strategy": "step",
                             "select_interval": 1,
                             "update_interval": 1,
                             "full_warm_up_rounds": 100
                         })
    config["zero_force_ds_cpu_optimizer"] = False
    return config


class LeftToStock(typing.NamedTuple):
    config: typing.Callable
    optimizer: type
    model: typing.Callable
    input_dim: int
    as_plain_pytorch: bool  # whether stock trains it as plain PyTorch does


# Reentrant checkpoints: stock DeepSpeed before 0.19.3 raises CheckpointError on frozen params under
# non-reentrant ones, and so does an engine left to stock. ZenFlow's update is its own (params
# transposed between the hooks): only stock is its reference. Under selective checkpointing stock's
# linear adds the bias twice (linear.py's Note [Selective checkpointing and an in-place bias]) and
# the fork's does not: the engine left to stock must too.
REENTRANT_STACK = functools.partial(CheckpointedStack, use_reentrant=True)
LEFT_TO_STOCK = {
    "deepcompile": LeftToStock(deepcompile_config, torch.optim.SGD, REENTRANT_STACK, DIM, True),
    "deepcompile_selective": LeftToStock(deepcompile_config, torch.optim.SGD, functools.partial(SelectiveStack, True),
                                         SEQUENCE * DIM, False),
    "zenflow": LeftToStock(zenflow_config, StepIdSGD, REENTRANT_STACK, DIM, False),
}


def train_steps(model, config, optimizer_class, batches):
    """An engine trained on ``batches``; returns it, its losses and its final param values."""
    import deepspeed
    import deepspeed.comm as dist
    optimizer = optimizer_class([param for param in model.parameters() if param.requires_grad], lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses = []
    for row in batches:
        loss = engine(row[dist.get_rank()])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    return engine, torch.stack(losses), named_values(engine)


@contextlib.contextmanager
def deepspeed_log():
    """The messages DeepSpeed's logger emits inside."""
    import logging
    from deepspeed.utils import logger
    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def left_to_stock_case(setup):
    import deepspeed.comm as dist
    import zero3_ac
    from zero3_ac.utils.z3_leaf_module import is_gather_unit
    assert_fork_state()
    case = LEFT_TO_STOCK[setup]
    config = case.config()
    batches = micro_batches(3, dist.get_world_size(), requires_grad=True, dim=case.input_dim)
    torch.manual_seed(44)
    models = {"before": CheckpointedStack(blocks=2), "aside": case.model(), "after": CheckpointedStack(blocks=2)}
    for model in models.values():
        zero3_ac.set_gather_units(model, [type(model.blocks[0]).__name__])
    twin = copy.deepcopy(models["aside"])
    initial = {name: param.detach().clone() for name, param in twin.named_parameters()}
    with torch_linear():
        expected = reference_deltas(twin, batches, gas=1)

    before = make_engine(models["before"], zero_config(3))
    with deepspeed_log() as messages:
        aside, losses, values = train_steps(models["aside"], config, case.optimizer, batches)
    after = make_engine(models["after"], zero_config(3))

    stepping_aside = [message for message in messages if "runs stock ZeRO-3" in message]
    assert len(stepping_aside) == int(zero3_ac.is_active()), f"log lines saying the fork stands aside: {stepping_aside}"
    assert zero3_ac.lifecycle_stats(aside) is None, "the engine left to stock runs the lifecycle"
    assert not any(is_gather_unit(module) for module in aside.module.modules()), "gather units marked on a stock engine"
    assert_partitioned(aside, "after training")
    if case.as_plain_pytorch:
        assert_close_deltas({name: values[name] - initial[name] for name in expected}, expected, torch.float32)
    for name, engine in (("before", before), ("after", after)):
        engine.backward(engine(micro_batches(1, dist.get_world_size(), requires_grad=True)[0][dist.get_rank()]))
        engine.step()
        assert (zero3_ac.lifecycle_stats(engine) is not None) == zero3_ac.is_active(), f"engine created {name}"
        assert any(is_gather_unit(module) for module in engine.module.modules()) == zero3_ac.is_active(), name
        assert_nothing_drained(engine, f"engine created {name}")

    with stock_deepspeed():
        _, stock_losses, stock_values = train_steps(twin, config, case.optimizer, batches)
    assert torch.equal(losses, stock_losses), f"losses {losses.tolist()} against stock's {stock_losses.tolist()}"
    for name, value in stock_values.items():
        assert torch.equal(values[name], value), f"{name} differs from stock's"


# Selective checkpointing is non-reentrant: an engine left to stock on DeepSpeed before 0.19.3 gets stock's
# CheckpointError on its frozen params there, as stock itself does.
STOCK_CRASHES_NON_REENTRANT = Version(version("deepspeed")) < Version("0.19.3")


@pytest.mark.parametrize("setup", [
    pytest.param(name,
                 marks=pytest.mark.skipif(name == "deepcompile_selective" and STOCK_CRASHES_NON_REENTRANT,
                                          reason="stock ZeRO-3 before 0.19.3 crashes under non-reentrant checkpointing"))
    for name in LEFT_TO_STOCK
])
def test_engine_left_to_stock_trains_as_stock_beside_fork_engines(setup):
    """DeepCompile and ZenFlow (ZeRO-3) engines run stock, bit for bit, beside engines that keep the fork.

    On CPU the DeepCompile engine trains before ``engine.compile()`` (DeepCompile's op needs CUDA),
    and ZenFlow inside its full warm-up rounds (see ``zenflow_config``).
    """
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    if setup == "zenflow" and "zenflow" not in DeepSpeedZeroConfig.model_fields:
        pytest.skip("this DeepSpeed has no ZenFlow")
    run_distributed(WORLD_SIZE, left_to_stock_case, setup)


def deepcompile_switched_on_late_case():
    from zero3_ac.runtime.engine import UnsupportedSetup
    torch.manual_seed(44)
    engine = make_engine(CheckpointedStack(blocks=2), zero_config(3))
    engine._config.compile_config.deepcompile = True
    with pytest.raises(UnsupportedSetup, match="config passed to deepspeed.initialize"):
        engine.compile()
    engine.destroy()


def test_deepcompile_switched_on_after_initialize_is_refused():
    """The fork's hooks are on every module by then: DeepCompile would silently take over from them."""
    if fork_disabled():
        pytest.skip("stock DeepSpeed runs DeepCompile (its op needs CUDA)")
    run_distributed(WORLD_SIZE, deepcompile_switched_on_late_case)


class OptionalTail(torch.nn.Module):
    """A trunk and a head, and between them ``late`` once someone attaches it."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.trunk = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, dim, bias=False)
        self.late = None

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        if self.late is not None:
            h = h + self.late(h)
        return self.head(h).pow(2).mean()


def late_module_case():
    import deepspeed.comm as dist
    assert_fork_state()
    rank = dist.get_rank()
    torch.manual_seed(46)
    model = OptionalTail()
    reference = copy.deepcopy(model)
    engine = make_engine(model, zero_config(3))
    # Stock registers no hooks on a module attached now: its forward runs on its plain torch params.
    # (Stock's step() then fails on them, in ``release_and_reset_all``; the forward and backward work.)
    engine.module.late = torch.nn.Linear(DIM, DIM)
    reference.late = copy.deepcopy(engine.module.late)
    for index, row in enumerate(micro_batches(2, dist.get_world_size())):
        loss = engine(row[rank])
        assert torch.allclose(loss, reference(row[rank]), rtol=1e-5, atol=1e-7), f"forward {index}"
        engine.backward(loss)
        assert_partitioned(engine, f"after backward {index}")
        assert_nothing_drained(engine, f"after backward {index}")
        assert engine.module.late.weight.grad is not None


def test_module_attached_after_initialize_runs_as_plain_torch():
    """A module attached to the model after ``deepspeed.initialize`` is not a ZeRO module."""
    from deepspeed.runtime.zero import parameter_offload
    if not hasattr(parameter_offload, "ensure_zero_ordered_dict"):
        pytest.skip("this DeepSpeed's own forward prologue fails on a module attached after initialize")
    run_distributed(WORLD_SIZE, late_module_case)


class AttributeDelegatingWrapper(torch.nn.Module):
    """Looks up attributes it lacks on the module it wraps (as some PEFT and FSDP wrappers do)."""

    def __init__(self, module):
        super().__init__()
        self.wrapped = module

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("wrapped"), name)

    def forward(self, x):
        return self.wrapped(x)


class DelegatingModel(torch.nn.Module):

    def __init__(self, dim=DIM):
        super().__init__()
        self.input = torch.nn.Linear(dim, dim)
        self.output = AttributeDelegatingWrapper(torch.nn.Linear(dim, dim))

    def forward(self, x):
        return self.output(torch.tanh(self.input(x))).pow(2).mean()


def delegating_wrapper_case():
    torch.manual_seed(47)
    engine = train_plainly(DelegatingModel(), zero_config(3))
    assert_partitioned(engine, "after training")
    assert_nothing_drained(engine, "after training")
    engine.destroy()


def test_attribute_delegating_wrapper_trains_like_pytorch():
    """Upstream's counterpart asserts its per-module ``pre_bwd_fn``; the fork's hook state is keyed by
    the module object, so a wrapper never reads the wrapped module's (docs/porting.md)."""
    run_distributed(WORLD_SIZE, delegating_wrapper_case)
