"""ZeRO++ hierarchical partitioning (hpZ) under activation checkpointing (ZeRO-3, 4 gloo ranks, hpZ groups of 2).

hpZ keeps a second, larger partition of each param (``ds_secondary_tensor``) over a smaller group
of ranks (one node), so that the all-gathers after the forward stay inside it. DeepSpeed issue
4784 reported that a checkpoint recompute was taken for a forward, and a checkpointed forward
(run under ``no_grad``) for a backward, so that they gathered from the wrong group: DeepSpeed
then chose the group from the phase. Since 0.13.2 (PR 4906) it chooses from the data, in 0.18.5
and 0.19.8 alike (the ``forward`` flag of ``fetch_sub_module`` no longer reaches the all-gather):
a gather reads the secondary partition, over the hpZ group, whenever the param has one, and the
primary partition, over the whole data-parallel group, otherwise. A param gets its secondary
partition when it is partitioned (in ``initialize``, and at every release), and the optimizer
step drops those of the trainable params, which it makes stale. So:

- forward, first step: every param over the hpZ group (``initialize`` partitioned it);
- forward, later steps: trainable params over the world (their secondary partition was dropped
  by the step), frozen ones over the hpZ group (theirs never goes stale);
- recompute and backward: over the hpZ group (the forward released the param, which built it).

The phase decides nothing, so a recompute can be neither misclassified nor gather from the wrong
group, under stock DeepSpeed or the fork (which gathers through upstream's ``fetch_sub_module``).
The test records the process group of every all-gather collective and the partition of every
param it gathered, by phase, and checks the table above, training like plain PyTorch, and that
no step leaves a param gathered or a trainable param with a secondary partition.

Stock: 0.19.8 passes; 0.18.5 raises ``CheckpointError`` under non-reentrant checkpointing
(frozen params released inside the recompute; not an hpZ fault) and passes reentrant.
"""

import contextlib
from dataclasses import dataclass, field

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (CheckpointedStack, assert_close_deltas, assert_fork_state,
                                               assert_nothing_drained, assert_partitioned, make_engine,
                                               hpz_group_forgotten_at_exit, micro_batches, named_values,
                                               reference_deltas, zero_config)
from zero3_ac.runtime.zero.partitioned_param_coordinator import TapListener

WORLD_SIZE = 4
HPZ_SIZE = 2
STEPS = 3
# Release every param at its module's end and prefetch nothing, so that each phase gathers.
LEAN = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
GROUP_OF_PARTITION = {"primary": "world", "secondary": "hpz"}


def expected_partition(step, phase, trainable) -> str:
    """The partition a gather must read (see the module docstring)."""
    return "primary" if phase == "forward" and trainable and step > 0 else "secondary"


@dataclass
class Gather:
    """One all-gather of the coordinator: its params as (name, trainable, partition), and the
    groups of the collectives it ran."""
    step: int
    phase: str
    params: list = field(default_factory=list)
    groups: set = field(default_factory=set)


def _partition(param) -> str:
    return "primary" if param.ds_secondary_tensor is None else "secondary"


def _group_name(group) -> str:
    import deepspeed.comm as dist
    ranks = tuple(torch.distributed.get_process_group_ranks(group or torch.distributed.group.WORLD))
    first = dist.get_rank() // HPZ_SIZE * HPZ_SIZE
    if ranks == tuple(range(dist.get_world_size())):
        return "world"
    if ranks == tuple(range(first, first + HPZ_SIZE)):
        return "hpz"
    return f"ranks {ranks}"


class HpzGatherLog(TapListener):
    """Listens to an engine's ``CoordinatorTap`` and, while
    :meth:`collectives` is entered, to the collectives ZeRO-3's all-gathers launch.

    The tap reports a gather's params just before it runs the gather, whose collectives follow:
    a param reported after a collective starts the next gather.
    """

    def __init__(self, engine):
        from zero3_ac.utils.gather_meter import engine_tap
        self.tap = engine_tap(engine)
        self.names = {param: name for name, param in engine.module.named_parameters()}
        self.step = 0
        self.gathers = []
        self.tap.add(self)

    def gathered(self, param, phase):
        if not self.gathers or self.gathers[-1].groups:
            self.gathers.append(Gather(self.step, phase))
        self.gathers[-1].params.append((self.names[param], param.requires_grad, _partition(param)))

    @contextlib.contextmanager
    def collectives(self):
        """Record the group of every all-gather collective (``partition_parameters._dist_allgather_fn``)."""
        from deepspeed.runtime.zero import partition_parameters
        launch = partition_parameters._dist_allgather_fn

        def recording(input_tensor, output_tensor, group=None):
            assert self.gathers, "an all-gather collective outside the coordinator's gathers"
            self.gathers[-1].groups.add(_group_name(group))
            return launch(input_tensor, output_tensor, group)

        partition_parameters._dist_allgather_fn = recording
        try:
            yield
        finally:
            partition_parameters._dist_allgather_fn = launch

    def table(self):
        """(step, phase, trainable, partition) -> params gathered; for messages."""
        counts = {}
        for gather in self.gathers:
            for _, trainable, partition in gather.params:
                key = (gather.step, gather.phase, "trainable" if trainable else "frozen", partition)
                counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items()))


def assert_gathers_follow_the_secondary_partition(log):
    table = log.table()
    for gather in log.gathers:
        want_groups = {GROUP_OF_PARTITION[partition] for _, _, partition in gather.params}
        assert gather.groups == want_groups, (
            f"step {gather.step} {gather.phase}: collectives over {gather.groups} for params {gather.params}")
        for name, trainable, partition in gather.params:
            want = expected_partition(gather.step, gather.phase, trainable)
            assert partition == want, (f"step {gather.step} {gather.phase}: {name} gathered from its {partition} "
                                       f"partition, expected {want}; gathers: {table}")
    later = {(gather.phase, group) for gather in log.gathers if gather.step > 0 for group in gather.groups}
    for phase, group in [("forward", "world"), ("forward", "hpz"), ("recompute", "hpz"), ("backward", "hpz")]:
        assert (phase, group) in later, f"no {phase} gather over the {group} group after the first step: {table}"


def hpz_case(use_reentrant):
    import deepspeed.comm as dist
    from deepspeed.utils import groups
    assert_fork_state()
    rank = dist.get_rank()
    torch.manual_seed(48)
    model = CheckpointedStack(blocks=2, use_reentrant=use_reentrant)
    batches = micro_batches(STEPS, WORLD_SIZE, requires_grad=True)
    reference_losses = []

    def reference_loss(model, x, index):
        reference_losses.append(model(x))
        return reference_losses[-1]

    expected = reference_deltas(model, batches, gas=1, forward=reference_loss)
    engine = make_engine(model, zero_config(3, zero_hpz_partition_size=HPZ_SIZE, **LEAN))
    assert dist.get_world_size(groups._get_zero_param_intra_parallel_group()) == HPZ_SIZE, "no hpZ groups"
    initial = named_values(engine)
    log = HpzGatherLog(engine)
    with log.collectives():
        for step, row in enumerate(batches):
            log.step = step
            loss = engine(row[rank])
            want = reference_losses[step * WORLD_SIZE + rank]
            assert torch.allclose(loss, want, rtol=1e-5, atol=1e-7), f"step {step}: loss {loss} vs plain {want}"
            loss.backward()
            assert_nothing_drained(engine, f"after backward {step}")
            engine.step()
            assert_partitioned(engine, f"after step {step}")
            stale = [name for name, param in engine.module.named_parameters()
                     if param.requires_grad and param.ds_secondary_tensor is not None]
            assert not stale, f"step {step}: trainable params keep a secondary partition past the step: {stale}"
    final = named_values(engine)
    assert_close_deltas({name: final[name] - initial[name] for name in expected}, expected, torch.float32)
    assert_gathers_follow_the_secondary_partition(log)
    engine.destroy()


def forgetting_hpz_case(use_reentrant):
    with hpz_group_forgotten_at_exit():
        hpz_case(use_reentrant)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_each_phase_gathers_from_the_partition_hpz_keeps_for_it(use_reentrant):
    run_distributed(WORLD_SIZE, forgetting_hpz_case, use_reentrant)
