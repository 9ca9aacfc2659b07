"""Hypothesis strategies for the differential fuzzer's examples (``spec.Example``).

Every choice lists its simplest option first, so that a failure shrinks towards an unchecked,
single-block, trainable model with one plain step.
"""

from importlib.metadata import version

from hypothesis import strategies as st
from packaging.version import Version

from tests.unit.runtime.zero.fuzz.spec import (BACKWARDS, BODIES, EXTRAS, INNER_CHECKPOINTS, IOS, PARAMS,
                                               BlockSpec, EngineSpec, Example, ModelSpec, ScheduleSpec,
                                               SequentialSpec)

MAX_BLOCKS = 4
MAX_MICRO_BATCHES = 6


def checkpoint_modes():
    """DeepSpeed's own checkpoints from 0.19.3 on: before, on the CPU accelerator, ``non_reentrant_checkpoint``
    opens an accelerator stream and ``checkpoint`` raises ``TypeError: 'NoneType' object is not callable``."""
    modes = ("none", "nonreentrant", "reentrant", "selective")
    if Version(version("deepspeed")) >= Version("0.19.3"):
        modes += ("ds_reentrant", "ds_nonreentrant")
    return modes


PARAMS_FIRST = ("trainable", "mixed", "frozen")
assert set(PARAMS_FIRST) == set(PARAMS)


def blocks(sequential=False):
    ios = ("tensor", ) if sequential else IOS
    modes = ("none", ) if sequential else checkpoint_modes()
    return st.builds(BlockSpec,
                     params=st.sampled_from(PARAMS_FIRST),
                     body=st.sampled_from(BODIES),
                     io=st.sampled_from(ios),
                     checkpoint=st.sampled_from(modes),
                     inner=st.sampled_from(INNER_CHECKPOINTS),
                     calls=st.just(1) if sequential else st.integers(1, 2))


def sequentials():
    return st.builds(SequentialSpec,
                     blocks=st.lists(blocks(sequential=True), min_size=2, max_size=3).map(tuple),
                     segments=st.integers(1, 2),
                     use_reentrant=st.booleans())


def stages():
    """1 to MAX_BLOCKS blocks, some of them grouped under checkpoint_sequential."""
    stage = st.one_of(blocks(), sequentials())
    size = lambda s: len(s.blocks) if isinstance(s, SequentialSpec) else 1
    return st.lists(stage, min_size=1, max_size=MAX_BLOCKS).filter(
        lambda ss: sum(size(s) for s in ss) <= MAX_BLOCKS).map(tuple)


@st.composite
def models(draw):
    stem = draw(st.sampled_from(("none", "trainable", "frozen")))
    tied = stem == "trainable" and draw(st.booleans())
    return ModelSpec(stages=draw(stages()),
                     dim=draw(st.sampled_from((8, 16))),
                     stem=stem,
                     tied=tied,
                     shared_trainable=draw(st.booleans()))


@st.composite
def schedules(draw):
    """Half the schedules are plain; in the others, half the micro-batches are."""
    gas = draw(st.integers(1, 4))
    steps = draw(st.integers(1, max(1, min(3, MAX_MICRO_BATCHES // gas))))
    count = gas * steps
    if draw(st.booleans()):
        extra = st.one_of(st.just("none"), st.sampled_from(EXTRAS))
        extras = tuple(draw(st.lists(extra, min_size=count, max_size=count)))
    else:
        extras = ("none", ) * count
    return ScheduleSpec(gas=gas,
                        extras=extras,
                        input_grad=draw(st.booleans()),
                        early_stop=draw(st.booleans()),
                        backward=draw(st.sampled_from(BACKWARDS)))


@st.composite
def engines(draw, dim):
    return EngineSpec(persistence=draw(st.sampled_from((0, dim, 10**6))),
                      strict=draw(st.booleans()),
                      one_param_buckets=draw(st.booleans()),
                      units=draw(st.booleans()))


@st.composite
def examples(draw, world_size):
    model = draw(models())
    return Example(model=model,
                   schedule=draw(schedules()),
                   engine=draw(engines(model.dim)),
                   world_size=world_size,
                   seed=draw(st.integers(0, 2**16)))
