"""The coordinator's cached ``iter_params`` (partitioned_param_coordinator.py): the same params as upstream's."""

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
