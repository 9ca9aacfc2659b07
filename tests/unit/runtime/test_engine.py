"""The engine's forward prologue and epilogue under the fork: upstream's walk of every module, cached
(``zero3_ac/runtime/engine.py``, Note [The engine's walk of every module at each root forward])."""

import contextlib
import copy

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.zero_case import DIM, LR, assert_fork_state, fork_disabled, make_engine, zero_config


class ReadsATable(torch.nn.Module):
    """Reads the weight of a child it never calls: under ZeRO-3 that weight is gathered only because the
    engine's prologue marked every module's params as being in a forward (an external param)."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.table = torch.nn.Linear(dim, dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim)
        self.late = None

    def forward(self, x):
        h = torch.tanh(self.proj(x)) @ self.table.weight
        if self.late is not None:
            h = h + self.late(h)
        return h.pow(2).mean()


class RecordsItsForwardFlag(torch.nn.Linear):
    """A module attached after ``initialize``: records whether the prologue reached it."""

    def forward(self, x):
        self.flag_seen = getattr(self._parameters, "_in_forward", None)
        return super().forward(x)


@contextlib.contextmanager
def counting_walks_of(root):
    """Counts the walks of ``root``'s tree (``named_modules``) and the modules that upstream's prologue
    loop visited (``ensure_zero_ordered_dict``, 0.19.3+)."""
    from deepspeed.runtime import engine as ds_engine
    counts = {"walks": 0, "visits": 0}
    named_modules = torch.nn.Module.named_modules
    ensure_zero_ordered_dict = ds_engine.ensure_zero_ordered_dict

    def counting(module, *args, **kwargs):
        if module is root:
            counts["walks"] += 1
        return named_modules(module, *args, **kwargs)

    def visiting(module):
        counts["visits"] += 1
        return ensure_zero_ordered_dict(module)

    torch.nn.Module.named_modules = counting
    ds_engine.ensure_zero_ordered_dict = visiting
    try:
        yield counts
    finally:
        torch.nn.Module.named_modules = named_modules
        ds_engine.ensure_zero_ordered_dict = ensure_zero_ordered_dict


def prologue_walk_case():
    assert_fork_state()
    torch.manual_seed(51)
    model = ReadsATable()
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    engine = make_engine(model, zero_config(3))
    walks = []
    for step in range(4):
        if step == 2:
            engine.module.late = RecordsItsForwardFlag(DIM, DIM)
            reference.late = copy.deepcopy(engine.module.late)
        x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(step))
        with counting_walks_of(engine.module) as counts:
            loss = engine(x)
        walks.append(counts)
        assert "modules" not in engine.module.__dict__, "the cached walk outlived the forward"
        assert all(not getattr(module._parameters, "_in_forward", False) for module in engine.module.modules())
        expected = reference(x)
        assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-7), f"step {step}: {loss} vs {expected}"
        engine.backward(loss)
        if engine.module.late is None:  # stock's step() fails on a module's plain params (test_setups)
            engine.step()
            expected.backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        else:
            assert engine.module.late.flag_seen is True, f"step {step}: the prologue did not reach the new module"
    return walks


def test_forward_prologue_reaches_every_module_from_a_cached_walk():
    """External params are found as on stock, a module attached after ``initialize`` is reached, and
    after the first forward of a tree the prologue and epilogue walk no module tree, and upstream's
    prologue loop visits no module."""
    from deepspeed.runtime.zero import parameter_offload
    if not hasattr(parameter_offload, "ensure_zero_ordered_dict"):
        pytest.skip("this DeepSpeed's own forward prologue fails on a module attached after initialize")
    steps = run_distributed(1, prologue_walk_case)[0]
    walks = [step["walks"] for step in steps]
    visits = [step["visits"] for step in steps]
    modules = (3, 4)  # the root and its two linears, then the module attached at step 2 too
    if fork_disabled():
        assert min(walks) >= 2, walks  # upstream: a walk in the prologue and one in the epilogue
        assert visits == [modules[0], modules[0], modules[1], modules[1]], visits
    else:
        # The fork's own cached walks (the model's params, a module's subtree) also run when the tree is new.
        assert walks[0] >= 1 and walks[2] >= 1 and walks[1] == walks[3] == 0, walks
        # The attached module's plain dict sends step 2 through upstream's loop, which gives it its ZeROOrderedDict.
        assert visits == [0, 0, modules[1], 0], visits
