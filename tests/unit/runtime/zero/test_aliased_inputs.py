"""One tensor passed as several arguments, under activation checkpointing (ZeRO-3, 2 gloo ranks).

torch's ``nn.MultiheadAttention`` takes another code path when ``query is key is value`` (self-
attention, as in ``nn.TransformerEncoderLayer``, torchvision's ViT and open_clip towers). If a
module's forward saw distinct tensors in the forward and the same tensor in the recompute, a non-
reentrant checkpoint would save a different number of tensors in each and raise ``CheckpointError``.
Each case trains against plain PyTorch, frozen towers and trainable ones, and checks that nothing is
left gathered; ``IdentityProbe`` cases also check that the module sees the same aliasing as
plain PyTorch does, in the forward and in the recompute.
"""

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.test_checkpoint_lifecycle import train_and_check
from tests.unit.runtime.zero.zero_case import DIM

WORLD_SIZE = 2
SEQ = 3


class EncoderTower(torch.nn.Module):
    """``nn.TransformerEncoderLayer`` blocks over (batch, SEQ, DIM // SEQ...) rows, checkpointed by the parent."""

    def __init__(self, frozen, use_reentrant=False, layers=2, dim=DIM):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=2 * dim, dropout=0.0, batch_first=True)
            for _ in range(layers))
        self.layers.requires_grad_(not frozen)
        self.head = torch.nn.Linear(dim, dim)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = x.unsqueeze(1).expand(-1, SEQ, -1) * torch.arange(1, SEQ + 1, dtype=x.dtype).view(1, SEQ, 1)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=self.use_reentrant)
        return self.head(h).float().pow(2).mean()


class SelfAttention(torch.nn.Module):
    """``nn.MultiheadAttention`` called as ``attention(x, x, x)``, the same tensor three times."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(dim, num_heads=2, batch_first=True)
        self.attention.requires_grad_(False)
        self.lora = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        out, _ = self.attention(x, x, x, need_weights=False)
        return x + out + self.lora(x)


class IdentityProbe(torch.nn.Module):
    """Records how its arguments alias: ``b is a`` and ``c`` a view of ``a``'s storage."""

    def __init__(self, log, dim=DIM):
        super().__init__()
        self.log = log
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, a, b, c=None, scale=None):
        phase = "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
        self.log.append((phase, a is b, a is c, c is not None and c.data_ptr() == a.data_ptr(), scale))
        return self.linear(a) + b + (c if c is not None else 0)


class AliasedArgsModel(torch.nn.Module):
    """Calls a checkpointed probe with one tensor in several positional and keyword arguments."""

    def __init__(self, log, use_reentrant=False, dim=DIM):
        super().__init__()
        self.attention = SelfAttention(dim)
        self.probe = IdentityProbe(log, dim)
        self.head = torch.nn.Linear(dim, dim, bias=False)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = checkpoint(self.attention, x.unsqueeze(1).expand(-1, SEQ, -1).contiguous(), use_reentrant=self.use_reentrant)
        if self.use_reentrant:  # the reentrant checkpoint takes no keyword arguments
            h = checkpoint(self.probe, h, h, h.view_as(h), 2.0, use_reentrant=True)
        else:
            h = checkpoint(self.probe, h, h, c=h.view_as(h), scale=2.0, use_reentrant=False)
        return self.head(h).float().pow(2).mean()


def encoder_case(frozen, use_reentrant):
    torch.manual_seed(50)
    train_and_check(EncoderTower(frozen, use_reentrant))


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
def test_transformer_encoder_tower(frozen, use_reentrant):
    run_distributed(WORLD_SIZE, encoder_case, frozen, use_reentrant)


def _aliasing_seen_by_plain_pytorch(model, x):
    plain = copy.deepcopy(model)
    plain.probe.log = log = []
    plain(x).backward()
    return set(log)


def aliased_args_case(use_reentrant):
    torch.manual_seed(51)
    log = []
    model = AliasedArgsModel(log, use_reentrant)
    expected = _aliasing_seen_by_plain_pytorch(model, torch.randn(2, DIM, requires_grad=True))
    train_and_check(model)
    observed = set(log)
    assert observed == expected, f"the probe saw other aliasing than plain PyTorch ({expected}): {log}"


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_one_tensor_in_several_arguments(use_reentrant):
    run_distributed(WORLD_SIZE, aliased_args_case, use_reentrant)
