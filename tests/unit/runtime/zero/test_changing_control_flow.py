"""Control flow that changes between micro-batches: params unused in some micro-batches of a window.

No checkpointing: each micro-batch routes through a different set of branches, and the updates
must match plain PyTorch accumulating the same micro-batches (ZeRO 1-3, 1 and 2 gloo ranks). The
last test reaches the same ZeRO-3 accumulation path with a param reduced twice in one micro-step.
"""

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (DIM, assert_close_deltas, assert_fork_state, assert_partitioned,
                                               make_engine, micro_batches, named_values, reference_deltas,
                                               zero_config)

WINDOWS = 3
BRANCHES = ("late", "early", "alternate")


def route(index, gas):
    """The branches micro-batch ``index`` uses: ``late`` skips the first micro-batch of each window,
    ``early`` the last one, ``alternate`` every other window."""
    window, micro = divmod(index, gas)
    used = {"late": micro > 0, "early": micro < gas - 1, "alternate": window % 2 == 0}
    return tuple(name for name in BRANCHES if used[name])


class RoutedModel(torch.nn.Module):
    """A trunk, the branches a micro-batch routes through, and a head."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.trunk = torch.nn.Linear(dim, dim)
        self.branches = torch.nn.ModuleDict({name: torch.nn.Linear(dim, dim) for name in BRANCHES})
        self.head = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x, branches):
        h = torch.tanh(self.trunk(x))
        for name in branches:
            h = h + torch.tanh(self.branches[name](h))
        return self.head(h).pow(2).mean()


def changing_control_flow_case(stage, gas, offload=False, managed=True):
    import deepspeed.comm as dist
    assert_fork_state()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(11)
    model = RoutedModel()
    batches = micro_batches(WINDOWS * gas, world_size)
    expected = reference_deltas(model, batches, gas, forward=lambda model, x, index: model(x, route(index, gas)))
    config = zero_config(stage, gas=gas, **({"offload_optimizer": {"device": "cpu"}} if offload else {}))
    config["zero_force_ds_cpu_optimizer"] = False  # torch SGD on the offloaded partitions
    if not managed:
        config["managed_gradient_accumulation"] = False  # 0.19.8+: step() is the boundary
    engine = make_engine(model, config)
    initial = named_values(engine)
    for index, row in enumerate(batches):
        loss = engine(row[rank], route(index, gas))
        loss.backward()
        assert_partitioned(engine, f"after backward {index}")
        if managed or (index + 1) % gas == 0:
            engine.step()
        assert_partitioned(engine, f"after step {index}")
    final = named_values(engine)
    assert_close_deltas({name: final[name] - initial[name] for name in expected}, expected, torch.float32,
                        context=f"stage {stage}, gas {gas}: ")
    engine.destroy()


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("gas", [1, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_params_unused_in_some_micro_batches_train_like_pytorch(stage, gas, world_size):
    run_distributed(world_size, changing_control_flow_case, stage, gas)


@pytest.mark.parametrize("gas", [1, 3])
def test_params_unused_in_some_micro_batches_with_the_optimizer_offloaded(gas):
    """ZeRO-3 copies gradient partitions to the offloaded optimizer at the boundary micro-batch."""
    run_distributed(2, changing_control_flow_case, 3, gas, offload=True)


@pytest.mark.parametrize("offload", [False, True])
def test_params_unused_in_some_micro_batches_with_unmanaged_accumulation(offload):
    """``managed_gradient_accumulation: false``: N backwards, then one ``step()`` that is the boundary.
    Offloaded, upstream copies at that boundary only the partitions reduced in the window."""
    import deepspeed.runtime.constants as constants
    if not hasattr(constants, "MANAGED_GRADIENT_ACCUMULATION"):
        pytest.skip("this DeepSpeed has no unmanaged gradient accumulation")
    run_distributed(2, changing_control_flow_case, 3, 3, offload=offload, managed=False)


class SharedByTwoReentrantCheckpoints(torch.nn.Module):
    """One Linear called in two reentrant checkpoints: its gradient arrives in two nested backwards."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.shared = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.shared, x, use_reentrant=True)
        h = torch.utils.checkpoint.checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        return self.head(h).pow(2).mean()


def shared_param_case(stage, gas):
    import deepspeed.comm as dist
    assert_fork_state()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(12)
    model = SharedByTwoReentrantCheckpoints()
    batches = micro_batches(2 * gas, world_size, requires_grad=True)
    expected = reference_deltas(model, batches, gas)
    # A bucket of one param reduces each gradient on arrival; with both in one bucket upstream asserts.
    engine = make_engine(model, zero_config(stage, gas=gas, reduce_bucket_size=1))
    initial = named_values(engine)
    for index, row in enumerate(batches):
        engine(row[rank]).backward()
        assert_partitioned(engine, f"after backward {index}")
        engine.step()
        assert_partitioned(engine, f"after step {index}")
    final = named_values(engine)
    assert_close_deltas({name: final[name] - initial[name] for name in expected}, expected, torch.float32,
                        context=f"stage {stage}, gas {gas}: ")
    engine.destroy()


@pytest.mark.parametrize("gas", [1, 2])
def test_param_reduced_twice_in_one_backward_trains_like_pytorch(gas):
    """The two reentrant checkpoints run two nested backwards: ZeRO-3 reduces the shared param twice."""
    run_distributed(2, shared_param_case, 3, gas)
