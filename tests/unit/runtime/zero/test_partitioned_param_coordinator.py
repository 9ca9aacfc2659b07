"""partitioned_param_coordinator.py: the cached ``iter_params`` (the same params as upstream's), the tap's releases,
reuse distance per fetch, and the step boundary's release in one pass (stock's outcome)."""

import contextlib

import torch
from deepspeed.runtime.zero.partitioned_param_coordinator import get_all_parameters
from deepspeed.utils import set_z3_leaf_module

from zero3_ac.runtime.zero.partitioned_param_coordinator import cached_iter_params


class Block(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.ones(4))
        self._external_params = {}

    def ds_external_parameters(self):
        return self._external_params.items()


def _upstream(module, recurse):
    return [param for _, param in get_all_parameters(module, recurse)]


def test_the_params_a_modules_hooks_gather_come_from_the_cache_and_equal_upstreams():
    block = Block()
    first = cached_iter_params(block, recurse=False)
    assert first == _upstream(block, False) and cached_iter_params(block, recurse=False) is first
    assert list(cached_iter_params(block, recurse=True)) == _upstream(block, True)  # not what the hooks gather


def test_a_leaf_gathers_its_subtree_and_an_external_param_invalidates_the_cache():
    block = Block()
    set_z3_leaf_module(block, True)
    leaf = cached_iter_params(block, recurse=True)
    assert leaf == _upstream(block, True) and cached_iter_params(block, recurse=True) is leaf
    external = torch.nn.Parameter(torch.zeros(2))
    block._external_params[id(external)] = external
    assert cached_iter_params(block, recurse=True) == _upstream(block, True) == [*leaf, external]


class _Coordinator:
    """Upstream's name-mangled release and gather, recording what reaches them."""

    def __init__(self):
        self.released = []

    def _PartitionedParameterCoordinator__all_gather_params(self, params, forward):
        pass

    def _PartitionedParameterCoordinator__release_param(self, param, free_data=True):
        self.released.append(param.name)

    def fetch_sub_module(self, module, forward):
        pass


class _Param:

    def __init__(self, name, status, active=()):
        self.name, self.ds_status, self.ds_active_sub_modules = name, status, set(active)
        self.ds_persist = self.is_external_param = False
        self.ds_tensor = self.data = None  # on neither of the fork's own release paths: upstream's release takes it


def test_a_release_of_many_params_reaches_upstream_as_releases_one_by_one_and_a_later_wrapper_sees_each():
    """Note [A release of many params at once]: the same params reach upstream's release, in order; once
    something wraps the coordinator's release after the fork, every param passes through the wrapper."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from zero3_ac.runtime.zero.partitioned_param_coordinator import InvocationParams
    params = [_Param("first", ZeroParamStatus.AVAILABLE), _Param("partitioned", ZeroParamStatus.NOT_AVAILABLE),
              _Param("in use", ZeroParamStatus.AVAILABLE, active=[-3]), _Param("second", ZeroParamStatus.AVAILABLE)]
    coordinator = _Coordinator()
    invocation_params = InvocationParams(coordinator, 0, will_open=lambda module: False)
    invocation_params.release(params)
    assert coordinator.released == ["first", "second"]
    wrapped = []
    tap_release = coordinator._PartitionedParameterCoordinator__release_param

    def wrapper(param, free_data=True):
        wrapped.append(param.name)
        return tap_release(param, free_data)

    coordinator.released = []
    coordinator._PartitionedParameterCoordinator__release_param = wrapper
    invocation_params.release(params)
    assert wrapped == ["first", "partitioned", "in use", "second"] and coordinator.released == ["first", "second"]


def test_the_forks_tap_returns_at_once_for_a_release_that_releases_nothing():
    """Note [Releases that release nothing]: only a gathered param no module is active on reaches upstream."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from zero3_ac.runtime.zero.partitioned_param_coordinator import CoordinatorTap
    params = [_Param("gathered", ZeroParamStatus.AVAILABLE), _Param("partitioned", ZeroParamStatus.NOT_AVAILABLE),
              _Param("in use", ZeroParamStatus.AVAILABLE, active=[-3])]
    for phase_source, expected in ((lambda: "forward", ["gathered"]), (None, ["gathered", "partitioned", "in use"])):
        coordinator = _Coordinator()
        CoordinatorTap.of(coordinator, phase_source)
        for param in params:
            coordinator._PartitionedParameterCoordinator__release_param(param)
        assert coordinator.released == expected


def test_a_whole_model_walk_is_upstreams_and_sees_params_added_later():
    """The step boundary's ``iter_params(root, recurse=True)``: cached per tree shape (Note [Module
    trees that change shape]), with the root's external params."""
    from zero3_ac.utils import module_tree
    was_counting = module_tree.generation() is not None
    module_tree.start_counting()
    try:
        root = torch.nn.Sequential(Block(), Block())
        root._external_params = {}
        root.ds_external_parameters = lambda: root._external_params.items()
        first = cached_iter_params(root, recurse=True)
        assert first == _upstream(root, True) and cached_iter_params(root, recurse=True) is first
        root[1].inner = torch.nn.Linear(4, 2)  # a replaced layer, as PEFT's injection does
        replaced = cached_iter_params(root, recurse=True)
        assert replaced == _upstream(root, True) and not any(param is root[1].inner.weight for param in first)
        external = torch.nn.Parameter(torch.zeros(2))
        root._external_params[id(external)] = external
        assert cached_iter_params(root, recurse=True) == _upstream(root, True)
        assert cached_iter_params(root, recurse=True)[-1] is external
    finally:
        if not was_counting:
            module_tree.stop_counting()


def hf_steps_keep_the_model_walk_case():
    import zero3_ac
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.unit.runtime.zero.zero_case import make_engine, zero_config
    from zero3_ac.utils import module_tree
    if not zero3_ac.is_active():
        return "skipped"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = make_engine(model, zero_config(3))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    seen = []
    for _ in range(3):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        seen.append((module_tree.generation(), id(cached_iter_params(engine.module, recurse=True))))
    engine.destroy()
    assert seen[1] == seen[2], seen  # after the first step nothing registers, so the walk is reused
    return "ok"


def test_hf_llama_steps_reuse_the_model_walk():
    """transformers' decoder slices its ``ModuleList`` in every forward (Note [Module trees that change
    shape]); that must not count as a change, or the step boundary walks the whole model again."""
    from tests.unit.common import run_distributed
    assert run_distributed(1, hf_steps_keep_the_model_walk_case) in (["ok"], ["skipped"])


class FrozenLeafTower(torch.nn.Module):
    """A frozen tower (marked a ZeRO-3 leaf, as users mark MoE blocks) before a trainable head; its input
    needs no grad, so no backward reaches it and nothing after its forward gathers its params again."""

    def __init__(self):
        super().__init__()
        self.tower = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).requires_grad_(False)
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.tower(x)).pow(2).mean()


def leaf_status_after_forward_case():
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from tests.unit.runtime.zero.zero_case import assert_fork_state, make_engine, zero_config
    assert_fork_state()
    torch.manual_seed(0)
    model = FrozenLeafTower()
    set_z3_leaf_module(model.tower, True)
    engine = make_engine(model, zero_config(3))
    gathered = []
    for step in range(3):  # the trace is complete from the second step on
        loss = engine(torch.randn(2, 8))
        gathered.append([param.ds_status == ZeroParamStatus.AVAILABLE for param in model.tower.parameters()])
        engine.backward(loss)
        engine.step()
    engine.destroy()
    return gathered


def test_a_leaf_nothing_reuses_is_released_at_its_forward_end():
    """The rules' [Reuse distance]: the later fetch of the root (its backward) gathers the root's own
    params, not the leaf's. Stock scans the trace with the leaf's flag applied to the root, so it keeps
    the whole tower gathered from the second step's forward to the step's end."""
    from tests.unit.common import run_distributed
    [gathered] = run_distributed(1, leaf_status_after_forward_case)
    assert gathered == [[False] * 4] * 3, f"tower params still gathered after each step's forward: {gathered}"


def step_boundary_case():
    """Three steps of a fork engine and of its stock twin; before each ``step()``, a param gathered
    outside any hook and left with a module's id in its set of active modules, as stock code can leave one."""
    import copy

    import deepspeed.comm as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from tests.unit.runtime.zero.zero_case import (DIM, CheckpointedStack, assert_fork_state, make_engine,
                                                   micro_batches, named_values, stock_deepspeed, zero_config)
    assert_fork_state()
    torch.manual_seed(47)
    model = CheckpointedStack(blocks=2, use_reentrant=True)  # stock before 0.19.3 fails non-reentrant ones
    twin = copy.deepcopy(model)
    config = zero_config(3, persistence=DIM)  # the norms' weights and biases and the biases are persistent
    rank = dist.get_rank()
    results = []
    for engine_model, stock in ((model, False), (twin, True)):
        with stock_deepspeed() if stock else contextlib.nullcontext():
            engine = make_engine(engine_model, config)
        losses, left = [], []
        for row in micro_batches(3, dist.get_world_size(), requires_grad=True):
            loss = engine(row[rank])
            engine.backward(loss)
            engine.module.head.weight.all_gather()
            engine.module.head.weight.ds_active_sub_modules.add(10**6)
            engine.step()
            losses.append(loss.detach())
            left.append([
                name for name, param in engine.module.named_parameters()
                if param.ds_status != ZeroParamStatus.NOT_AVAILABLE or param.ds_active_sub_modules
            ])
        available = engine.optimizer.parameter_offload.get_param_coordinator(
        )._PartitionedParameterCoordinator__n_available_params
        results.append((torch.stack(losses), named_values(engine), left, available))
        engine.destroy()
    return results


def test_a_step_releases_and_resets_every_param_as_stock_does():
    """Note [The step boundary's release in one pass]: after each ``step()`` the params stock leaves gathered
    (persistent ones the step gathers again) and no other are gathered, no module is active on any, the
    coordinator counts what stock counts, and training is stock's bit for bit."""
    from tests.unit.common import run_distributed
    for (losses, values, left, available), (stock_losses, stock_values, stock_left, stock_available) in run_distributed(
            2, step_boundary_case):
        assert left == stock_left, f"params left gathered or active after step(): {left}, stock {stock_left}"
        assert all("head.weight" not in names for names in left), left
        assert available == stock_available, f"available elements counted: {available}, stock {stock_available}"
        assert torch.equal(losses, stock_losses), f"losses {losses.tolist()} against stock's {stock_losses.tolist()}"
        for name, value in stock_values.items():
            assert torch.equal(values[name], value), f"{name} differs from stock's"


def wrapped_release_and_reset_all_case():
    import zero3_ac

    from tests.unit.runtime.zero.zero_case import CheckpointedStack, assert_partitioned, make_engine, zero_config
    if not zero3_ac.is_active():
        return "skipped"
    torch.manual_seed(48)
    engine = make_engine(CheckpointedStack(blocks=2), zero_config(3))
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    calls = []
    upstream = coordinator.release_and_reset_all

    def wrapper(module):
        calls.append(module)
        return upstream(module)

    coordinator.release_and_reset_all = wrapper
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 16)))
        engine.step()
    assert_partitioned(engine, "after step()")
    engine.destroy()
    return len(calls)


def test_a_wrapped_release_and_reset_all_still_runs_at_each_step():
    """Whoever wraps the coordinator's ``release_and_reset_all`` sees every step boundary: the fork's
    one pass stands aside for it."""
    from tests.unit.common import run_distributed
    assert run_distributed(1, wrapped_release_and_reset_all_case) in ([2], ["skipped"])


def plain_param_at_step_case():
    import zero3_ac
    from deepspeed.runtime.zero import parameter_offload

    from tests.unit.runtime.zero.test_setups import OptionalTail
    from tests.unit.runtime.zero.zero_case import DIM, make_engine, zero_config
    if not zero3_ac.is_active() or not hasattr(parameter_offload, "ensure_zero_ordered_dict"):
        return "skipped"  # stock, or a DeepSpeed whose forward prologue fails on a module attached after initialize
    torch.manual_seed(49)
    engine = make_engine(OptionalTail(), zero_config(3))
    engine.module.late = torch.nn.Linear(DIM, DIM)
    engine.backward(engine(torch.randn(2, DIM)))
    try:
        engine.step()
    except RuntimeError as error:
        return str(error)
    finally:
        engine.destroy()
    return "step() passed"


def test_a_step_names_a_module_attached_after_initialize():
    """A plain torch param at the step boundary fails with an error that says why and what to do (stock
    fails there with an ``AttributeError`` on ``ds_active_sub_modules``)."""
    from tests.unit.common import run_distributed
    [message] = run_distributed(1, plain_param_at_step_case)
    assert message == "skipped" or (message.startswith("zero3_ac: late.weight is a plain torch param")
                                    and "Attach modules before deepspeed.initialize" in message), message
