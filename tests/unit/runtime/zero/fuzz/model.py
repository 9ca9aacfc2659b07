"""Builds the ``torch.nn.Module`` of a ``ModelSpec`` (inside a rank process).

Every block is a residual ``x + tanh(body(norm(x)))`` (plus a trainable LoRA-like Linear when its
params are "mixed"); the model ends in a trainable head and a squared-mean loss, so the loss stays
differentiable whatever is frozen or checkpointed. The same torch seed builds the same model.
"""

import functools

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,
                                    create_selective_checkpoint_contexts)

from tests.unit.runtime.zero.fuzz.spec import BlockSpec, ModelSpec, SequentialSpec, blocks_of

SEQUENCE = 3
HEADS = 2
SAVED_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class Recursive(torch.nn.Module):
    """Calls itself ``depth`` times."""

    def __init__(self, dim):
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, x, depth=2):
        if depth == 0:
            return x
        return self(torch.tanh(self.linear(x)), depth=depth - 1)


class Pair(torch.nn.Module):
    """Takes two tensors; the block passes it the same tensor twice."""

    def __init__(self, dim):
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, a, b):
        return self.linear(a) * torch.sigmoid(b)


class Borrow(torch.nn.Module):
    """Reads its child's weight in its own forward, so ZeRO-3 makes it borrow the weight."""

    def __init__(self, dim):
        super().__init__()
        self.child = torch.nn.Linear(dim, dim)

    def forward(self, h):
        before = h @ self.child.weight  # saves the param itself (a linear saves a view of it)
        out = self.child(torch.tanh(before))
        return out + torch.nn.functional.linear(torch.tanh(out), self.child.weight)


class Experts(torch.nn.Module):
    """Equal-shaped experts; a call runs the two that its input's largest element picks, so the
    choice follows the data (each rank's) and is the same in a checkpoint's recompute."""

    def __init__(self, dim, count=3):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(count))

    def forward(self, h):
        first = int(h.detach().flatten().argmax()) % len(self.experts)
        return sum(self.experts[index % len(self.experts)](h) for index in (first, first + 1))


def _body(spec, dim, shared):
    if spec.body == "shared":
        return shared
    if spec.body == "recursive":
        return Recursive(dim)
    if spec.body == "pair":
        return Pair(dim)
    if spec.body == "mha":
        return torch.nn.MultiheadAttention(dim, HEADS, batch_first=True)
    if spec.body == "borrow":
        return Borrow(dim)
    if spec.body == "experts":
        from deepspeed.utils import set_z3_leaf_module
        experts = Experts(dim)
        set_z3_leaf_module(experts, True)
        return experts
    return torch.nn.Linear(dim, dim)


class Block(torch.nn.Module):

    def __init__(self, spec: BlockSpec, dim, shared):
        super().__init__()
        self.spec = spec
        self.norm = torch.nn.LayerNorm(dim)
        self.body = _body(spec, dim, shared)
        self.lora = torch.nn.Linear(dim, dim, bias=False) if spec.params == "mixed" else None
        own = [*self.norm.parameters(), *(self.body.parameters() if spec.body != "shared" else [])]
        for param in own:
            param.requires_grad_(spec.params == "trainable")

    def _core(self, h):
        body = self.spec.body
        if body == "repeat":
            return self.body(torch.tanh(self.body(h)))
        if body == "recursive":
            return self.body(h, depth=2)
        if body == "pair":
            return self.body(h, h)
        if body == "mha":
            return self.body(h, h, h, need_weights=False)[0]
        return self.body(h)

    def forward(self, x, other=None, *, scale=1.0, gate=None):
        h = self.norm(x)
        inner = self.spec.inner
        if inner == "none":
            core = self._core(h)
        else:
            core = checkpoint(self._core, h, use_reentrant=inner == "reentrant")
        out = torch.tanh(core) * scale
        if self.lora is not None:
            out = out + self.lora(h)
        for g in (other, gate):
            if g is not None:
                out = out * torch.sigmoid(g)
        out = x + out
        io = self.spec.io
        if io == "dict":
            return {"hidden": out, "count": 3, "note": None}
        if io == "model_output":
            from transformers.modeling_outputs import BaseModelOutput
            return BaseModelOutput(last_hidden_state=out, hidden_states=(h, ))
        if io == "non_tensor":
            return out, "tag", 3, None
        return out


def hidden(output):
    """The hidden state of a block's output, whatever its kind."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "hidden" in output:
        return output["hidden"]
    if hasattr(output, "last_hidden_state"):
        return output.last_hidden_state
    return output[0]


KWARG_MODES = ("none", "nonreentrant", "selective")  # the checkpoint functions that take kwargs


def call_block(block: Block, x):
    spec = block.spec
    args, kwargs = (x, ), {}
    if spec.io == "same_tensor":
        args = (x, x)
    elif spec.io == "kwargs":
        kwargs = {"scale": 0.5, "gate": x} if spec.checkpoint in KWARG_MODES else {"scale": 0.5}
    mode = spec.checkpoint
    if mode == "none":
        return hidden(block(*args, **kwargs))
    if mode in ("nonreentrant", "selective"):
        context = {} if mode == "nonreentrant" else {
            "context_fn": functools.partial(create_selective_checkpoint_contexts, save_matmuls)
        }
        return hidden(checkpoint(block, *args, use_reentrant=False, **context, **kwargs))

    def run(*tensors):  # reentrant checkpoints take positional tensors and return tensors
        return hidden(block(*tensors, **kwargs))

    if mode == "reentrant":
        return checkpoint(run, *args, use_reentrant=True)
    import deepspeed
    if mode == "ds_reentrant":
        return deepspeed.checkpointing.checkpoint(run, *args)
    return deepspeed.checkpointing.non_reentrant_checkpoint(run, *args)


class FuzzModel(torch.nn.Module):

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        dim = spec.dim
        self.stem = torch.nn.Linear(dim, dim) if spec.stem != "none" else None
        if self.stem is not None:
            self.stem.requires_grad_(spec.stem == "trainable")
        self.shared = None
        if any(block.body == "shared" for block in blocks_of(spec)):
            self.shared = torch.nn.Linear(dim, dim)
            self.shared.requires_grad_(spec.shared_trainable)
        self.stages = torch.nn.ModuleList()
        for stage in spec.stages:
            if isinstance(stage, SequentialSpec):
                self.stages.append(torch.nn.Sequential(*(Block(b, dim, self.shared) for b in stage.blocks)))
            else:
                self.stages.append(Block(stage, dim, self.shared))
        self.head = torch.nn.Linear(dim, dim, bias=False)
        if spec.tied:
            self.head.weight = self.stem.weight

    def forward(self, x):
        if self.stem is not None:
            x = self.stem(x)
        for stage, spec in zip(self.stages, self.spec.stages):
            if isinstance(spec, SequentialSpec):
                x = checkpoint_sequential(stage, spec.segments, x, use_reentrant=spec.use_reentrant)
            else:
                for _ in range(spec.calls):
                    x = call_block(stage, x)
        return self.head(x).pow(2).mean()


def build(spec: ModelSpec, seed: int) -> FuzzModel:
    torch.manual_seed(seed)
    return FuzzModel(spec)


def input_shape(spec: ModelSpec, micro_batch):
    return (micro_batch, SEQUENCE, spec.dim)
