"""A module's forward that reads a child's param: ZeRO-3 makes the module borrow it (2 gloo ranks).

Reading ``self.child.weight`` inside a module's forward while the param is partitioned makes
ZeRO-3's parameter getter gather it and register it as an external param of that module: from then
on the module's own invocations hold it, in forward and in backward, because the module's code may
use it in an op of its own, also after the child's backward is done. Where every read of a frozen
borrowed param is inside torch non-reentrant checkpoint regions, the borrow ends once those regions
have been recomputed and nothing references the param (borrowed_params' [Borrows inside a
checkpointed region]): upstream's two xfail prompt-release tests read the param that way.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.test_checkpoint_lifecycle import LEAN, train_and_check
from tests.unit.runtime.zero.zero_case import (DIM, assert_close_deltas, make_engine, micro_batches, named_values,
                                               reference_deltas, zero_config)

WORLD_SIZE = 2


def _status(param):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return getattr(param, "ds_status", ZeroParamStatus.AVAILABLE)


class _AfterBackward(torch.autograd.Function):
    """Identity; logs when its backward runs (the backward of what comes after it is done), with
    the status of ``param`` if one is given."""

    @staticmethod
    def forward(ctx, tensor, log, tag, param=None):
        ctx.log, ctx.tag, ctx.param = log, tag, param
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append((ctx.tag, None if ctx.param is None else _status(ctx.param)))
        return grad, None, None, None


class FrozenChildBlock(torch.nn.Module):
    """A frozen child whose weight the block reads, a trainable adapter and a trainable head."""

    def __init__(self, log=None, dim=DIM):
        super().__init__()
        self.log = log
        self.child = torch.nn.Linear(dim, dim)
        self.child.requires_grad_(False)
        self.lora = torch.nn.Linear(dim, dim, bias=False)
        self.head = torch.nn.Linear(dim, dim, bias=False)


class BorrowingBlock(FrozenChildBlock):
    """Uses its frozen child's weight in one checkpointed region, and calls the child in a later one."""

    def forward(self, x):
        weight = self.child.weight  # borrowed, read outside any region: the borrow lasts to the block's end

        def borrower_region(h):
            if torch._C._current_graph_task_id() != -1:
                self.log.append(("borrower recompute", _status(weight)))
            return torch.tanh(torch.nn.functional.linear(h, weight)) + self.lora(h)

        def owner_region(h):
            return torch.tanh(self.child(_AfterBackward.apply(h, self.log, "child backward done")))

        h = checkpoint(borrower_region, x, use_reentrant=False)
        h = checkpoint(owner_region, h, use_reentrant=False)
        return self.head(h).float().pow(2).mean()


def borrowed_case():
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    torch.manual_seed(60)
    log = []
    train_and_check(BorrowingBlock(log), zero_options=LEAN, check_regather=False)
    steps = [log[i:i + 2] for i in range(0, len(log), 2)]
    assert steps and all(step == [("child backward done", None), ("borrower recompute", ZeroParamStatus.AVAILABLE)]
                         for step in steps), f"the borrowed param was not read, gathered, after its owner's backward: {log}"


def test_borrowed_frozen_param_used_after_its_owners_backward():
    run_distributed(WORLD_SIZE, borrowed_case)


# ---------------------------------------------------------------- borrows read only inside a region
class RegionReaderBlock(FrozenChildBlock):
    """Reads its frozen child's weight inside a checkpointed function (not a module), right before
    calling the child there; the probe's backward runs right after the child's backward."""

    def _region(self, h):
        probed = _AfterBackward.apply(h, self.log, "child backward done", self.child.weight)
        return torch.tanh(self.child(probed)) + self.lora(h)

    def forward(self, x):
        return self.head(checkpoint(self._region, x, use_reentrant=False)).float().pow(2).mean()


class NoConsumerReaderBlock(torch.nn.Module):
    """A frozen embedding with no backward consumer, read again after its call inside a region."""

    def __init__(self, log, dim=DIM, vocab=11):
        super().__init__()
        self.log, self.vocab = log, vocab
        self.embedding = torch.nn.Embedding(vocab, dim)
        self.embedding.requires_grad_(False)
        self.projection = torch.nn.Linear(dim, dim)

    def _region(self, x):
        indices = (x[..., 0].detach().abs() * 7).long() % self.vocab
        value = self.embedding(indices) + x
        return self.projection(_AfterBackward.apply(value, self.log, "projection backward done", self.embedding.weight))

    def forward(self, x):
        return torch.tanh(checkpoint(self._region, x, use_reentrant=False)).float().pow(2).mean()


class OwnerAlsoOutsideReaderBlock(RegionReaderBlock):
    """A RegionReaderBlock that calls its child once more, after the region and outside it: the child's
    reads of its own weight there are no borrower's reads, so the borrow still ends in the region."""

    # The child's bias is released after the outer call's backward and gathered again for the recompute.
    regathers_in_backward = True

    def forward(self, x):
        h = checkpoint(self._region, x, use_reentrant=False)
        return self.head(h + self.child(h)).float().pow(2).mean()


def train_probing_the_borrow(block, gathered, problem, check_regather=True):
    """Train ``block(log)`` 3 steps; after each backward, every status its probe logged must be gathered
    (``gathered``) or not, else ``problem`` is the assertion's message."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    log = []
    want = ZeroParamStatus.AVAILABLE if gathered else ZeroParamStatus.NOT_AVAILABLE

    def probe(engine, index):
        seen = list(log)
        log.clear()
        assert seen, "the probe's backward never ran"
        assert all(status == want for _, status in seen), f"step {index}: {problem}: {seen}"

    train_and_check(block(log), steps=3, zero_options=LEAN, after_backward=probe, check_regather=check_regather)


def region_reader_case(block):
    torch.manual_seed(61)
    train_probing_the_borrow(block, False, "the borrowed frozen param stayed gathered after its last consumer",
                             check_regather=not getattr(block, "regathers_in_backward", False))


@pytest.mark.parametrize("block", [RegionReaderBlock, NoConsumerReaderBlock, OwnerAlsoOutsideReaderBlock],
                         ids=["consumer", "no_consumer", "owner_called_outside_too"])
def test_borrow_read_only_inside_a_region_ends_at_the_last_consumer(block):
    """Upstream's two prompt-release tests, in every step (the later ones read the param gathered)."""
    run_distributed(WORLD_SIZE, region_reader_case, block)


class RegionUserBlock(FrozenChildBlock):
    """Reads its frozen child's weight inside checkpointed functions and uses it in ops there: before
    and after the child's call in the same region, and (``user_region``) in a region before the one
    that calls the child."""

    def __init__(self, user_region, dim=DIM):
        super().__init__(dim=dim)
        self.user_region = user_region

    def _user_region(self, h):
        return torch.tanh(torch.nn.functional.linear(h, self.child.weight)) + self.lora(h)

    def _owner_region(self, h):
        before = h @ self.child.weight  # saves the param itself (a linear saves a view of it)
        out = torch.tanh(self.child(torch.tanh(before)))
        return out + torch.nn.functional.linear(out, self.child.weight)

    def forward(self, x):
        h = checkpoint(self._user_region, x, use_reentrant=False) if self.user_region else x
        h = checkpoint(self._owner_region, h, use_reentrant=False)
        return self.head(h).float().pow(2).mean()


def region_user_case(user_region, zero_options):
    torch.manual_seed(62)
    train_and_check(RegionUserBlock(user_region), steps=3, zero_options=zero_options, check_regather=False)


@pytest.mark.parametrize("zero_options", [LEAN, {}], ids=["lean", "default_prefetch"])
@pytest.mark.parametrize("user_region", [False, True], ids=["one_region", "two_regions"])
def test_borrow_used_in_ops_inside_regions_lasts_until_their_backward(user_region, zero_options):
    run_distributed(WORLD_SIZE, region_user_case, user_region, zero_options)


class RegionViewUserBlock(FrozenChildBlock):
    """Uses its frozen child's weight in a linear inside a checkpointed function, before calling the
    child there: the linear saves a view of the param (its transpose), which nothing but the param's
    use count shows after the child's backward; the probe's backward runs right before the linear's."""

    def _region(self, h):
        used = _AfterBackward.apply(torch.nn.functional.linear(h, self.child.weight), self.log, "linear backward next",
                                    self.child.weight)
        return torch.tanh(self.child(torch.tanh(used))) + self.lora(h)

    def forward(self, x):
        return self.head(checkpoint(self._region, x, use_reentrant=False)).float().pow(2).mean()


def region_view_case():
    torch.manual_seed(63)
    train_probing_the_borrow(RegionViewUserBlock, True, "the borrow ended while a saved view of the param awaited its "
                             "backward", check_regather=False)


def test_borrow_whose_view_a_region_saved_lasts_until_the_views_backward():
    run_distributed(WORLD_SIZE, region_view_case)


class RegisteredBorrowBlock(FrozenChildBlock):
    """Registers its frozen child's weight as its own external param with ZeRO-3's public
    ``register_external_parameter`` and uses it: the block's fetch gathers it, so no read has gathered
    it when the first step's call ends."""

    def __init__(self, dim=DIM):
        super().__init__(dim=dim)
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter
        register_external_parameter(self, self.child.weight)

    def forward(self, x):
        h = torch.tanh(torch.nn.functional.linear(x, self.child.weight)) + self.lora(x)
        return self.head(torch.tanh(self.child(h))).float().pow(2).mean()


def registered_borrow_case():
    torch.manual_seed(64)
    train_and_check(RegisteredBorrowBlock(), steps=3, zero_options=LEAN, check_regather=False)


def test_frozen_param_registered_as_external_is_held_like_a_borrow():
    run_distributed(WORLD_SIZE, registered_borrow_case)


class OutsideReaderBlock(FrozenChildBlock):
    """Uses its frozen child's weight, never calling the child."""

    def forward(self, x):
        return self.head(torch.tanh(torch.nn.functional.linear(x, self.child.weight)) + self.lora(x)).float().pow(2).mean()


def stock_engine_borrow_case():
    import deepspeed.comm as dist
    import zero3_ac
    torch.manual_seed(65)
    model = OutsideReaderBlock()
    batches = micro_batches(2, dist.get_world_size(), requires_grad=True)
    expected = reference_deltas(model, batches, gas=1)
    config = zero_config(3)
    config["compile"] = {"deepcompile": True}  # left to stock; on CPU it trains before engine.compile()
    engine = make_engine(model, config)
    assert zero3_ac.lifecycle_stats(engine) is None, "the engine is not left to stock"
    initial = named_values(engine)
    for row in batches:
        engine.backward(engine(row[dist.get_rank()]))
        engine.step()
    final = named_values(engine)
    assert_close_deltas({name: final[name] - initial[name] for name in expected}, expected, torch.float32)
    engine.destroy()


def test_borrow_on_an_engine_left_to_stock_records_nothing():
    """The fork's getter hook serves every engine: for one left to stock (engine.py's [Engines left to
    stock]) the borrowing module has no read record, and ZeRO-3 borrows as stock does."""
    run_distributed(WORLD_SIZE, stock_engine_borrow_case)
