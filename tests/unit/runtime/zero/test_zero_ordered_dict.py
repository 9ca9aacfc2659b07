"""zero_ordered_dict.py: every module of an engine that runs the lifecycle reads its params through the
fork's getter, which returns a gathered param at once and leaves every other read to upstream's
(Note [A param read that upstream's getter has nothing to do for])."""

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (CheckpointedStack, assert_fork_state, fork_disabled, make_engine,
                                               micro_batches, zero_config)


class _RecordingFallback:
    """Stands in for DeepCompile's eager fallback: records the reads upstream's getter reports to it."""

    def __init__(self):
        self.reads = []

    def record_param_access(self, param):
        self.reads.append(param)


def getter_case():
    import deepspeed.comm as dist
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    assert_fork_state()
    torch.manual_seed(5)
    model = CheckpointedStack(blocks=2)
    engine = make_engine(model, zero_config(3))
    row = micro_batches(1, dist.get_world_size())[0]
    engine(row[0]).backward()
    engine.step()
    kinds = sorted({type(module._parameters).__name__ for module in engine.module.modules()})

    # A partitioned param read in the engine's forward: upstream's getter gathers it for the module on top.
    block = engine.module.blocks[0]
    params = block.frozen._parameters
    weight = dict.__getitem__(params, "weight")
    assert weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    params._in_forward = True
    parameter_offload.FWD_MODULE_STACK.append(block)
    try:
        read = params["weight"]
        gathered = read is weight and read.ds_status == ZeroParamStatus.AVAILABLE
        registered = id(weight) in block._external_params
        # A gathered param read while an eager fallback is active: upstream's getter reports the read.
        fallback = _RecordingFallback()
        recorded = None
        try:
            from deepspeed.compile import z3_eager_fallback
        except ImportError:  # before 0.19.3: no eager fallback
            z3_eager_fallback = None
        if z3_eager_fallback is not None:
            z3_eager_fallback._ACTIVE_FALLBACK = fallback
            try:
                params["weight"]
            finally:
                z3_eager_fallback._ACTIVE_FALLBACK = None
            recorded = fallback.reads == [weight]
    finally:
        params._in_forward = False
        parameter_offload.FWD_MODULE_STACK.pop()
    return kinds, gathered, registered, recorded


def test_every_module_reads_through_the_forks_getter_which_leaves_every_case_with_work_to_upstreams():
    kinds, gathered, registered, recorded = run_distributed(1, getter_case)[0]
    if not fork_disabled():
        assert kinds == ["LifecycleParameters"], kinds  # the gather units' modules too
    assert gathered and registered, "a partitioned param read in the forward was not gathered and registered"
    assert recorded in (None, True), "a read under an active eager fallback was not reported to it"


def test_the_fast_read_skips_upstreams_getter_only_for_a_param_that_is_not_partitioned(monkeypatch):
    """Without an engine: a plain tensor, None and a gathered param come back without upstream's getter."""
    if fork_disabled():
        pytest.skip("the fork's getter")
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from zero3_ac.runtime.zero import zero_ordered_dict
    calls = []
    monkeypatch.setattr(zero_ordered_dict, "_stock_getitem", lambda params, key: calls.append(key) or "upstream")
    module = torch.nn.Linear(2, 2)
    params = zero_ordered_dict.LifecycleParameters(parent_module=module)
    gathered, partitioned = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    gathered.ds_status, partitioned.ds_status = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE
    for key, value in (("plain", torch.nn.Parameter(torch.ones(1))), ("none", None), ("gathered", gathered),
                       ("partitioned", partitioned)):
        params[key] = value
    assert [params[key] is dict.__getitem__(params, key) for key in ("plain", "none", "gathered")] == [True] * 3
    assert params["partitioned"] == "upstream" and calls == ["partitioned"]
    assert isinstance(params, parameter_offload.ZeROOrderedDict)
