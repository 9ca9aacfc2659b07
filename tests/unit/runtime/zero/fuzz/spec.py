"""The differential fuzzer's example: plain, picklable data (frozen dataclasses of strings and ints).

An ``Example`` is a model (``ModelSpec``), a training schedule (``ScheduleSpec``), the ZeRO-3
settings (``EngineSpec``) and a world size. ``grammar.py`` draws them, ``model.py`` builds and runs
them, ``oracle.py`` compares plain PyTorch, stock DeepSpeed and the fork on them. A regression test
writes one out by hand.
"""

from dataclasses import dataclass, field
from typing import Tuple, Union

PARAMS = ("frozen", "trainable", "mixed")
# linear: one Linear; repeat: one Linear called twice; recursive: a module that calls itself;
# shared: a Linear shared with other blocks; pair: a module given the same tensor twice;
# mha: nn.MultiheadAttention self-attention (query is key is value); borrow: a module that reads its
# child's weight (ZeRO-3 makes it borrow the weight) and uses it in ops before and after the child's call;
# experts: a ZeRO-3 leaf (``set_z3_leaf_module``, as MoE models are run under ZeRO-3) of equal-shaped
# experts, of which each call runs the two its input picks: ranks given other data run other experts.
BODIES = ("linear", "repeat", "recursive", "shared", "pair", "mha", "borrow", "experts")
# tensor: block(x) -> tensor; kwargs: block(x, scale=..., gate=x) -> tensor; same_tensor: block(x, x);
# dict / model_output / non_tensor: the output is a dict, a transformers ModelOutput, a tuple with
# non-tensor members, of which the caller takes the hidden state.
IOS = ("tensor", "kwargs", "same_tensor", "dict", "model_output", "non_tensor")
# none; torch's checkpoint reentrant / non-reentrant; selective (create_selective_checkpoint_contexts);
# DeepSpeed's own deepspeed.checkpointing.checkpoint (reentrant) and non_reentrant_checkpoint.
CHECKPOINTS = ("none", "reentrant", "nonreentrant", "selective", "ds_reentrant", "ds_nonreentrant")
# A checkpoint inside the block, around its body (nested when the block is checkpointed too).
INNER_CHECKPOINTS = ("none", "reentrant", "nonreentrant")
# Before the micro-batch's forward: a forward under no_grad, in eval(), with grad but no backward;
# or the micro-batch's loss is the sum of two forwards; or a no_grad forward runs between the
# forward and its backward.
EXTRAS = ("none", "no_grad", "eval", "no_backward", "two_forwards", "no_grad_between")
BACKWARDS = ("engine", "tensor")


@dataclass(frozen=True)
class BlockSpec:
    params: str = "mixed"
    body: str = "linear"
    io: str = "tensor"
    checkpoint: str = "none"
    inner: str = "none"
    calls: int = 1  # the parent calls the block this many times in a row


@dataclass(frozen=True)
class SequentialSpec:
    """Plain blocks run by ``torch.utils.checkpoint.checkpoint_sequential``."""
    blocks: Tuple[BlockSpec, ...] = (BlockSpec(), BlockSpec())
    segments: int = 1
    use_reentrant: bool = False


Stage = Union[BlockSpec, SequentialSpec]


@dataclass(frozen=True)
class ModelSpec:
    stages: Tuple[Stage, ...] = (BlockSpec(), )
    dim: int = 8
    stem: str = "none"  # none | frozen | trainable: a Linear before the stages
    tied: bool = False  # the head's weight is the (trainable) stem's weight
    shared_trainable: bool = True  # the Linear that "shared" bodies use


@dataclass(frozen=True)
class ScheduleSpec:
    gas: int = 1
    extras: Tuple[str, ...] = ("none", )  # one per micro-batch; len = steps * gas
    input_grad: bool = True
    early_stop: bool = True
    backward: str = "engine"


@dataclass(frozen=True)
class EngineSpec:
    persistence: int = 0  # stage3_param_persistence_threshold
    strict: bool = False  # max live parameters, reuse distance and prefetch bucket all 0
    # 1: every gradient is reduced on arrival, so a param may be reduced twice in one backward
    # (with DeepSpeed's default bucket, stage 3 asserts that a bucket holds each param once).
    one_param_buckets: bool = False
    # The fork gathers each block as one gather unit (``zero3_ac.set_gather_units(model, ["Block"])``);
    # stock ignores the setting.
    units: bool = False


@dataclass(frozen=True)
class Example:
    model: ModelSpec = field(default_factory=ModelSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    world_size: int = 2
    seed: int = 0


def blocks_of(model: ModelSpec):
    for stage in model.stages:
        if isinstance(stage, SequentialSpec):
            yield from stage.blocks
        else:
            yield stage
