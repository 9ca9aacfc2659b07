"""Lifecycle cases beyond the matrix, each on a small model of its own (ZeRO-3, 2 gloo ranks)."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import (DIM, CheckpointedStack, FrozenLoraBlock, assert_close_deltas,
                                               assert_fork_state, assert_no_backward_regather,
                                               assert_nothing_drained, assert_partitioned, make_engine,
                                               micro_batches, named_values, reference_deltas, zero_config)
from zero3_ac.utils.gather_meter import GatherMeter

WORLD_SIZE = 2
LEAN = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}


def _zero_status(param):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return getattr(param, "ds_status", ZeroParamStatus.AVAILABLE)


class StatusProbe(torch.autograd.Function):
    """Identity; records a param's ZeRO status when its forward or backward runs inside a backward.

    The param comes in a list captured at construction: reading ``module.weight`` inside another
    module's forward would make ZeRO-3 register it as an external param of that module.
    """

    @staticmethod
    def forward(ctx, tensor, target, log, tag):
        param = target[0]
        ctx.param, ctx.log, ctx.tag = param, log, tag
        if torch._C._current_graph_task_id() != -1:
            log.append((f"{tag}/recompute", _zero_status(param)))
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append((f"{ctx.tag}/backward", _zero_status(ctx.param)))
        return grad, None, None, None


def train_and_check(model, steps=2, gas=1, input_requires_grad=True, zero_options=None, forward_context=None,
                    check_regather=True, dtype=torch.float32, after_backward=None):
    """Train ``model`` under ZeRO-3 with user backward and check the lifecycle contract."""
    import contextlib
    import deepspeed.comm as dist
    assert_fork_state()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = micro_batches(steps * gas, world_size, dtype, requires_grad=input_requires_grad)
    context = forward_context or contextlib.nullcontext
    with context():
        expected = reference_deltas(model, batches, gas)
    engine = make_engine(model, zero_config(3, dtype, gas, **(zero_options or {})))
    initial = named_values(engine)
    gathers = GatherMeter(engine)
    for index, row in enumerate(batches):
        gathers.reset()
        with context():
            loss = engine(row[rank])
        loss.backward()
        if after_backward is not None:
            after_backward(engine, index)
        assert_partitioned(engine, f"after backward {index}")
        if check_regather:
            assert_no_backward_regather(gathers, f"backward {index}")
        engine.step()
        assert_partitioned(engine, f"after step {index}")
    final = named_values(engine)
    assert_close_deltas({name: final[name] - initial[name] for name in expected}, expected, dtype)
    assert_nothing_drained(engine, "lifecycle case")
    engine.destroy()


# ---------------------------------------------------------------------------- prompt release
class ProbedBlock(FrozenLoraBlock):
    """A probe right before a frozen Linear; the block's own tanh triggers the recompute."""

    def __init__(self, log, dim=DIM):
        super().__init__(dim)
        self.log = log
        self.target = [self.frozen.weight]

    def forward(self, x):
        h = self.norm(x)
        probed = StatusProbe.apply(h, self.target, self.log, "frozen.weight")
        return x + torch.tanh(self.frozen(probed) + self.lora(h))


def probe_case(use_reentrant):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    torch.manual_seed(3)
    log = []
    model = CheckpointedStack(blocks=2, use_reentrant=use_reentrant, block=lambda dim: ProbedBlock(log, dim))

    def released_before_probe(engine, index):
        seen = [status for tag, status in log if tag.endswith("/backward")]
        log.clear()
        assert seen, "the probe's backward never ran"
        assert all(status == ZeroParamStatus.NOT_AVAILABLE for status in seen), (
            f"backward {index}: frozen.weight still gathered when the op before it ran its backward: {seen}")

    train_and_check(model, after_backward=released_before_probe, zero_options=LEAN)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_frozen_param_released_before_the_op_before_it(use_reentrant):
    run_distributed(WORLD_SIZE, probe_case, use_reentrant)


# ---------------------------------------------------------------------------- frozen embedding
class EmbeddingBlock(torch.nn.Module):
    """A frozen embedding of integer ids plus a trainable offset, inside one checkpoint."""

    def __init__(self, log, vocab=32, dim=DIM):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, dim)
        self.embedding.weight.requires_grad_(False)
        self.offset = torch.nn.Parameter(torch.zeros(dim))
        self.log = log
        self.target = [self.embedding.weight]

    def forward(self, ids):
        embedded = StatusProbe.apply(self.embedding(ids), self.target, self.log, "embedding.weight")
        return torch.tanh(embedded + self.offset)


class EmbeddingModel(torch.nn.Module):

    def __init__(self, log):
        super().__init__()
        self.block = EmbeddingBlock(log)
        self.head = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        ids = (x.detach().abs() * 7).long() % 32
        return self.head(checkpoint(self.block, ids, use_reentrant=False)).pow(2).mean()


def embedding_case():
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    torch.manual_seed(4)
    log = []

    def released_after_last_use(engine, index):
        seen = [status for tag, status in log if tag.endswith("/recompute")]
        log.clear()
        assert seen, "the checkpoint never recomputed the embedding"
        assert all(status == ZeroParamStatus.NOT_AVAILABLE for status in seen), (
            f"backward {index}: the frozen embedding stayed gathered after its last use in the recompute: {seen}")

    train_and_check(EmbeddingModel(log), input_requires_grad=False, after_backward=released_after_last_use,
                    zero_options=LEAN)


def test_frozen_embedding_released_at_last_use_in_recompute():
    run_distributed(WORLD_SIZE, embedding_case)


# ---------------------------------------------------------------------------- repeated calls
class RepeatedCallBlock(FrozenLoraBlock):
    """One frozen Linear called twice, and a recursive module, inside one checkpointed region."""

    def __init__(self, log, dim=DIM):
        super().__init__(dim)
        self.recursive = RecursiveLinear(dim)
        self.log = log
        self.target = [self.frozen.weight]

    def forward(self, x):
        h = StatusProbe.apply(self.norm(x), self.target, self.log, "before first call")
        first = self.frozen(h)
        between = StatusProbe.apply(torch.relu(first), self.target, self.log, "between calls")
        second = self.frozen(between)
        return x + torch.tanh(second + self.lora(h) + self.recursive(h, depth=3))


class RecursiveLinear(torch.nn.Module):

    def __init__(self, dim):
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim)
        self.linear.requires_grad_(False)
        self.lora = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x, depth):
        if depth == 0:
            return x
        return self(torch.tanh(self.linear(x) + self.lora(x)), depth=depth - 1)


def repeated_call_case(use_reentrant):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    torch.manual_seed(5)
    log = []
    model = CheckpointedStack(blocks=2, use_reentrant=use_reentrant, block=lambda dim: RepeatedCallBlock(log, dim))

    def each_call_retires(engine, index):
        statuses = {}
        for tag, status in log:
            statuses.setdefault(tag, []).append(status)
        log.clear()
        assert all(s == ZeroParamStatus.NOT_AVAILABLE for s in statuses["before first call/backward"]), (
            f"backward {index}: the frozen Linear stayed gathered after both its calls' backward: {statuses}")
        assert all(s == ZeroParamStatus.AVAILABLE for s in statuses["between calls/backward"]), (
            f"backward {index}: the frozen Linear was released while its first call's backward was ahead: "
            f"{statuses}")

    train_and_check(model, after_backward=each_call_retires, zero_options=LEAN)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_repeated_and_recursive_calls_retire_independently(use_reentrant):
    run_distributed(WORLD_SIZE, repeated_call_case, use_reentrant)


# ---------------------------------------------------------------------------- nested checkpoints
class NestedCheckpointBlock(torch.nn.Module):

    def __init__(self, dim=DIM):
        super().__init__()
        self.outer = FrozenLoraBlock(dim)
        self.inner = FrozenLoraBlock(dim)

    def forward(self, x):
        return self.outer(checkpoint(self.inner, x, use_reentrant=False))


def nested_case():
    torch.manual_seed(6)
    model = CheckpointedStack(blocks=2, use_reentrant=False, block=NestedCheckpointBlock)
    train_and_check(model, zero_options=LEAN)


def test_nested_non_reentrant_checkpoints():
    run_distributed(WORLD_SIZE, nested_case)


# ---------------------------------------------------------------------------- early stop
def early_stop_case(early_stop, input_requires_grad):
    torch.manual_seed(8)
    model = CheckpointedStack(blocks=3, use_reentrant=False)
    train_and_check(model,
                    input_requires_grad=input_requires_grad,
                    forward_context=lambda: set_checkpoint_early_stop(early_stop))


@pytest.mark.parametrize("input_requires_grad", [True, False], ids=["input_grad", "input_nograd"])
@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "no_early_stop"])
def test_checkpoint_early_stop(early_stop, input_requires_grad):
    run_distributed(WORLD_SIZE, early_stop_case, early_stop, input_requires_grad)


# ---------------------------------------------------------------------------- peak during backward
class SelfCheckpointingBlock(FrozenLoraBlock):
    """A block that checkpoints its own body (its own hooks stay outside the checkpoint)."""

    use_reentrant = False

    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=self.use_reentrant)


class PlainStack(torch.nn.Module):

    def __init__(self, blocks, use_reentrant):
        super().__init__()
        self.blocks = torch.nn.ModuleList(SelfCheckpointingBlock() for _ in range(blocks))
        for block in self.blocks:
            block.use_reentrant = use_reentrant
        self.head = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def backward_peak_case(blocks, by_parent, use_reentrant):
    import deepspeed.comm as dist
    assert_fork_state()
    torch.manual_seed(9)
    if by_parent:
        model = CheckpointedStack(blocks=blocks, use_reentrant=use_reentrant)
    else:
        model = PlainStack(blocks, use_reentrant)
    engine = make_engine(model, zero_config(3, **LEAN))
    block_bytes = sum(p.ds_numel * p.element_size() for p in engine.module.blocks[0].parameters())
    meter = GatherMeter(engine)
    rank = dist.get_rank()
    for row in micro_batches(3, dist.get_world_size(), requires_grad=True):
        engine(row[rank]).backward()
        engine.step()
        assert_partitioned(engine, "after step")
    engine.destroy()
    return meter.backward_peak_bytes / block_bytes


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("by_parent", [True, False], ids=["by_parent", "by_block"])
def test_backward_peak_is_one_block_whatever_the_depth(by_parent, use_reentrant):
    peaks = {n: run_distributed(WORLD_SIZE, backward_peak_case, n, by_parent, use_reentrant)[0] for n in (2, 6)}
    assert peaks[6] <= peaks[2] + 0.01, f"peak gathered bytes during backward grows with depth (in blocks): {peaks}"
    assert peaks[6] <= 2.0, f"more than two blocks gathered at once during backward (in blocks): {peaks}"


# ---------------------------------------------------------------------------- faults
class FaultyBlock(FrozenLoraBlock):
    """Raises in its recompute, or in its backward, when armed."""

    fault = None

    def forward(self, x):
        if self.fault == "recompute" and torch._C._current_graph_task_id() != -1:
            raise RuntimeError("injected fault in recompute")
        out = super().forward(x)
        if self.fault == "backward":
            out = RaiseInBackward.apply(out)
        return out


class RaiseInBackward(torch.autograd.Function):

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected fault in backward")


def fault_case(fault, use_reentrant):
    import deepspeed.comm as dist
    from deepspeed.runtime.zero import parameter_offload
    assert_fork_state()
    torch.manual_seed(10)
    model = CheckpointedStack(blocks=3, use_reentrant=use_reentrant, block=FaultyBlock)
    engine = make_engine(model, zero_config(3, **LEAN))
    rank = dist.get_rank()
    batches = micro_batches(3, dist.get_world_size(), requires_grad=True)
    engine(batches[0][rank]).backward()
    engine.step()
    stack_depth = len(parameter_offload.FWD_MODULE_STACK)
    engine.module.blocks[1].fault = fault
    with pytest.raises(RuntimeError, match="injected fault"):
        engine(batches[1][rank]).backward()
    engine.module.blocks[1].fault = None
    for row in batches[2:]:
        engine(row[rank]).backward()
        assert_partitioned(engine, "after the backward that follows the fault")
        engine.step()
        assert_partitioned(engine, "after the step that follows the fault")
    assert len(parameter_offload.FWD_MODULE_STACK) == stack_depth, "the module stack kept entries of the fault"
    import zero3_ac
    stats = zero3_ac.lifecycle_stats(engine)
    if stats is not None:
        assert not any(stats["bookkeeping"].values()), f"bookkeeping left after the fault: {stats['bookkeeping']}"
    engine.destroy()


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("fault", ["recompute", "backward"])
def test_next_step_runs_clean_after_a_fault(fault, use_reentrant):
    run_distributed(WORLD_SIZE, fault_case, fault, use_reentrant)


# ---------------------------------------------------------------------------- live-parameter budget
STRICT = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}


def strict_budget_case(use_reentrant):
    torch.manual_seed(11)
    train_and_check(CheckpointedStack(blocks=4, use_reentrant=use_reentrant), zero_options=STRICT)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_strict_live_budget_keeps_a_region_from_recompute_to_backward(use_reentrant):
    """With no live-parameter budget at all, a region's recompute still serves its backward."""
    run_distributed(WORLD_SIZE, strict_budget_case, use_reentrant)


# ---------------------------------------------------------------------------- HF's enable_input_require_grads
class EmbeddedStack(torch.nn.Module):
    """A frozen embedding whose output a hook makes require grad, as HF's
    ``enable_input_require_grads`` does for PEFT, then checkpointed LoRA-like blocks."""

    def __init__(self, use_reentrant, vocab=32):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, DIM)
        self.embedding.weight.requires_grad_(False)
        self.embedding.register_forward_hook(lambda module, args, output: output.requires_grad_(True))
        self.stack = CheckpointedStack(blocks=2, use_reentrant=use_reentrant)

    def forward(self, x):
        return self.stack(self.embedding((x.detach().abs() * 7).long() % 32))


def embedded_stack_case(use_reentrant):
    torch.manual_seed(12)
    train_and_check(EmbeddedStack(use_reentrant), input_requires_grad=False)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_frozen_embedding_made_to_require_grad_by_a_hook(use_reentrant):
    run_distributed(WORLD_SIZE, embedded_stack_case, use_reentrant)
