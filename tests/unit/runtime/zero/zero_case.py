"""Shared pieces of the engine-level tests: small models, a plain-PyTorch reference, ZeRO probes.

Everything here runs inside the harness's rank processes (DS_ACCELERATOR=cpu, gloo).
"""

import contextlib
import copy
import os

import torch
from torch.utils.checkpoint import checkpoint

DIM = 16
MICRO_BATCH = 2
LR = 0.5


class FrozenLoraBlock(torch.nn.Module):
    """A frozen norm and linear with a trainable, LoRA-like linear beside the frozen one."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.frozen = torch.nn.Linear(dim, dim)
        self.lora = torch.nn.Linear(dim, dim, bias=False)
        for param in [*self.norm.parameters(), *self.frozen.parameters()]:
            param.requires_grad_(False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.frozen(h) + self.lora(h)


class CheckpointedStack(torch.nn.Module):
    """Blocks each checkpointed by the parent, a trainable head, and a squared-mean loss.

    The head keeps the loss differentiable when a reentrant checkpoint gets an input that needs
    no grad (its blocks then get no gradient, in plain PyTorch as under ZeRO).
    """

    def __init__(self, blocks=3, use_reentrant=False, dim=DIM, block=FrozenLoraBlock):
        super().__init__()
        self.blocks = torch.nn.ModuleList(block(dim) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, dim, bias=False)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x).float().pow(2).mean()


@contextlib.contextmanager
def torch_linear():
    """torch's own linear, whatever ZeRO-3 installed as ``torch.nn.functional.linear`` in this process."""
    installed = torch.nn.functional.linear
    torch.nn.functional.linear = torch._C._nn.linear
    try:
        yield
    finally:
        torch.nn.functional.linear = installed


@contextlib.contextmanager
def hpz_group_forgotten_at_exit():
    """Note: [The hpZ group outlives its engine]
        DeepSpeed keeps the hpZ process group that the first engine with ``zero_hpz_partition_size`` > 1
        creates in ``deepspeed.utils.groups`` for the rest of the process, and every later ZeRO-3 engine of
        the process partitions with it, hpZ in its config or not (``stage3.py`` passes
        ``groups._get_zero_param_intra_parallel_group()`` to the partitioning unconditionally). A test's
        rank processes run the next tests too, so an hpZ case forgets the group when it ends."""
    try:
        yield
    finally:
        from deepspeed.utils import groups
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None


@contextlib.contextmanager
def stock_deepspeed():
    """Stock DeepSpeed for the engines created inside (``zero3_ac.remove()``, then ``apply()`` again)."""
    import zero3_ac
    active = zero3_ac.is_active()
    if active:
        zero3_ac.remove()
    try:
        yield
    finally:
        if active:
            zero3_ac.apply()


def fork_disabled() -> bool:
    return os.environ.get("ZERO3_AC_DISABLE", "") not in ("", "0")


def assert_fork_state():
    """Under the fork every rank must run it; under --stock none may."""
    import zero3_ac
    assert zero3_ac.is_active() != fork_disabled(), (
        f"zero3_ac.is_active()={zero3_ac.is_active()} with ZERO3_AC_DISABLE={os.environ.get('ZERO3_AC_DISABLE')}")


def zero_config(stage, dtype=torch.float32, gas=1, persistence=0, **zero_options):
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": persistence,
            **zero_options
        },
    }
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    return config


def make_engine(model, config):
    import deepspeed
    trainable = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def micro_batches(count, world_size, dtype=torch.float32, requires_grad=False, dim=DIM, seed=0):
    """``batches[i][r]``: micro-batch i of rank r, the same on every rank process."""
    batches = []
    for i in range(count):
        generator = torch.Generator().manual_seed(seed + 1000 * i)
        row = [torch.randn(MICRO_BATCH, dim, generator=generator).to(dtype) for _ in range(world_size)]
        batches.append([x.requires_grad_(requires_grad) for x in row])
    return batches


def reference_deltas(model, batches, gas, forward=None):
    """Trainable-param updates of plain PyTorch on the data of every rank (data parallel mean).

    ``forward(model, x, index)`` computes the loss of micro-batch ``index``; default ``model(x)``.
    """
    forward = forward or (lambda model, x, index: model(x))
    model = copy.deepcopy(model).float()
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=LR)
    for index, row in enumerate(batches):
        loss = sum(forward(model, x.float().detach().requires_grad_(x.requires_grad), index) for x in row) / len(row)
        (loss / gas).backward()
        if (index + 1) % gas == 0:
            optimizer.step()
            optimizer.zero_grad()
    return {name: param.detach() - initial[name] for name, param in model.named_parameters() if param.requires_grad}


def named_values(engine):
    """Full values of the engine's params, whatever the ZeRO stage.

    One param at a time: DeepSpeed 0.19.2's coalesced gather of several params waits on the last
    gloo handle only, so on CPU the other params are sometimes read before they arrive (fixed
    upstream later). Training does not take that path; ``GatheredParameters`` of a list does.
    """
    import deepspeed
    values = {}
    for name, param in engine.module.named_parameters():
        context = deepspeed.zero.GatheredParameters([param]) if engine.zero_optimization_stage() == 3 else None
        with context or contextlib.nullcontext():
            values[name] = param.detach().float().clone()
    return values


def assert_partitioned(engine, when):
    """Every non-persistent param is partitioned and held by no invocation or module."""
    if engine.zero_optimization_stage() != 3:
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    for name, param in engine.module.named_parameters():
        if not hasattr(param, "ds_id") or param.ds_persist:  # a module attached after initialize: plain params
            continue
        assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE, (
            f"{when}: {name} is still gathered ({param.ds_status}, held by {param.ds_active_sub_modules})")
        assert not param.ds_active_sub_modules, f"{when}: {name} is held by {param.ds_active_sub_modules}"


def assert_close_deltas(actual, expected, dtype, context=""):
    rtol, atol = (1e-4, 1e-6) if dtype == torch.float32 else (5e-2, 5e-3)
    for name, want in expected.items():
        got = actual[name]
        if not torch.allclose(got, want, rtol=rtol, atol=atol):
            worst = (got - want).abs().max().item()
            raise AssertionError(f"{context}{name}: update differs from plain PyTorch by up to {worst:.3g} "
                                 f"(|update| max {want.abs().max().item():.3g}, rtol={rtol}, atol={atol})")


def assert_no_backward_regather(meter, when):
    """No frozen param was released and gathered again in one backward (``meter``: a reset GatherMeter)."""
    again = meter.frozen_regathers()
    assert not again, f"{when}: frozen params released and gathered again during one backward (ds_id: times): {again}"


def assert_nothing_drained(engine, when):
    """Under the fork: the end-of-backward drain must have found nothing to release."""
    if fork_disabled() or engine.zero_optimization_stage() != 3:
        return
    import zero3_ac
    stats = zero3_ac.lifecycle_stats(engine)
    assert stats["total_drained_params"] == 0 and stats["total_swept_params"] == 0, (
        f"{when}: the drain released params still gathered: {stats}")
