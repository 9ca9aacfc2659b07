"""Minimal examples the differential fuzzer found, kept as explicit regression tests (ZeRO-3, gloo).

Each test runs one ``Example`` (``fuzz/spec.py``) under plain PyTorch, stock DeepSpeed and the
fork, and passes when the fork runs clean, whatever stock does (``fuzz/oracle.py``; on DeepSpeed
0.18.5 stock fails most of them). ``FIXED`` ones failed on the fork when the fuzzer found them;
``PENDING`` ones are fork bugs not fixed yet (strict xfail: the fix makes them XPASS, and the mark
comes off with the fix), each also a class in ``fuzz/known.py``. Found by the fuzzer: docs/fuzzing.md.
"""

import dataclasses

import pytest

from tests.unit.common import run_distributed
from tests.unit.runtime.zero.fuzz import oracle
from tests.unit.runtime.zero.fuzz.spec import BlockSpec, EngineSpec, Example, ModelSpec, ScheduleSpec, SequentialSpec
from tests.unit.runtime.zero.test_differential_fuzz import check_example
from tests.unit.runtime.zero.zero_case import fork_disabled

pytestmark = pytest.mark.skipif(fork_disabled(), reason="compares the fork with stock; --stock has no fork")

PENDING = "found by the differential fuzzer; the fork fails where stock runs clean (fix pending)"

# Fuzzer found: one engine, two forwards, one backward. Here the loss is the sum of two forwards
# of one mixed block; no checkpoint is needed. Fork: "The size of tensor a (0) must match the
# size of tensor b (8)" in the backward; stock runs clean.
TWO_FORWARDS_SUMMED = Example(schedule=ScheduleSpec(extras=("two_forwards", )))
# The same with a forward under no_grad between the forward and its backward.
NO_GRAD_FORWARD_BEFORE_BACKWARD = Example(schedule=ScheduleSpec(extras=("no_grad_between", )))
# nn.MultiheadAttention self-attention (query is key is value) in a non-reentrant checkpoint.
# Fork: CheckpointError "A different number of tensors was saved during the original forward
# and recomputation"; stock runs clean.
SELF_ATTENTION_NON_REENTRANT = Example(model=ModelSpec(stages=(BlockSpec(body="mha", checkpoint="nonreentrant"), )))
# A reentrant checkpoint inside a non-reentrant one, trainable params, early stop on. Fork: "The
# size of tensor a (0) must match the size of tensor b (8)" in the backward; stock runs clean.
REENTRANT_INSIDE_NON_REENTRANT = Example(
    model=ModelSpec(stages=(BlockSpec(params="trainable", checkpoint="nonreentrant", inner="reentrant"), )))
# Nested non-reentrant checkpoints (the block's and one around its frozen body, here a recursive
# module; a Linear given one tensor twice fails too), after another block, under a strict live
# budget. Fork: CheckpointError "Recomputed values for the following tensors have different
# metadata" (a frozen param released during the recompute); stock runs clean.
NESTED_NON_REENTRANT_STRICT = Example(
    model=ModelSpec(stages=(BlockSpec(params="trainable"),
                            BlockSpec(params="mixed", body="recursive", io="kwargs", checkpoint="nonreentrant",
                                      inner="nonreentrant"))),
    engine=EngineSpec(strict=True))

# A frozen nn.MultiheadAttention body, no checkpoint, an input that needs no grad: no backward
# reaches the block, and the fork's end-of-backward drain releases 2 params (MHA reads its
# out_proj's params as attributes, without calling out_proj). Nothing is left afterwards.
DRAIN_AFTER_SELF_ATTENTION_WITHOUT_BACKWARD = Example(
    model=ModelSpec(stages=(BlockSpec(params="frozen", body="mha"), )), schedule=ScheduleSpec(input_grad=False))

# Equal-shaped experts in a user's ZeRO-3 leaf inside a gather unit, each rank running the experts
# its data picks. Fork: the unit hid the leaf, its params were reduced one by one, and the ranks
# averaged different experts' gradients (no error); stock runs clean.
EXPERTS_LEAF_INSIDE_A_UNIT = Example(
    model=ModelSpec(stages=(BlockSpec(params="trainable", body="experts", checkpoint="nonreentrant"), )),
    engine=EngineSpec(units=True))

# The same experts, trainable, in a unit whose input needs no grad: the unit's slot waits for its
# params' gradients, and the experts this rank did not run get none. Fork: the drain at the end of
# backward released the unit's 8 params (held to the end of the backward); stock runs clean.
EXPERTS_NOT_RUN_IN_A_UNIT_WITHOUT_INPUT_GRAD = Example(
    model=ModelSpec(stages=(BlockSpec(params="trainable", body="experts"), )),
    schedule=ScheduleSpec(input_grad=False),
    engine=EngineSpec(units=True))

# Two trainable blocks as gather units under a reentrant checkpoint_sequential of 2 segments, an input
# that needs no grad (no backward reaches the blocks). Fork: the sweep at the end of the second
# backward released 4 params that ZeRO-3's reuse policy had kept gathered since the forward, counting
# the root's backward fetch as a reuse of each unit's subtree; stock runs clean.
UNIT_UNDER_REENTRANT_SEQUENTIAL = Example(
    model=ModelSpec(stages=(SequentialSpec(blocks=(BlockSpec(params="trainable"), BlockSpec(params="trainable")),
                                           segments=2,
                                           use_reentrant=True), )),
    schedule=ScheduleSpec(extras=("none", "none"), input_grad=False, early_stop=False),
    engine=EngineSpec(units=True))

FIXED = {
    # A slot lives as long as its call's graph (invocation_lifecycle's [Several forwards before a backward]).
    "two_forwards_summed_before_one_backward": TWO_FORWARDS_SUMMED,
    "no_grad_forward_between_forward_and_backward": NO_GRAD_FORWARD_BEFORE_BACKWARD,
    # One wrapper per distinct tensor (backward_boundaries' [What a module's forward sees]).
    "self_attention_under_non_reentrant_checkpoint": SELF_ATTENTION_NON_REENTRANT,
    # A param the getter gathers is held by the running call (coordinator's [Params the getter gathers]).
    "drain_after_self_attention_without_backward": DRAIN_AFTER_SELF_ATTENTION_WITHOUT_BACKWARD,
    # A forward inside a backward with no saved-tensors hook is no part of a replay
    # (parameter_offload's [A replay left on the stack]).
    "reentrant_checkpoint_inside_non_reentrant": REENTRANT_INSIDE_NON_REENTRANT,
    # Inside a checkpoint the recompute saves torch's view of a weight, not the param that the live
    # budget evicts (linear's [torch's own linear inside a checkpoint]); 0.18.5 ran it clean already.
    "nested_non_reentrant_checkpoints_strict_budget": NESTED_NON_REENTRANT_STRICT,
    # A user's leaf inside a unit keeps the optimizer's leaf reduction (invocation_lifecycle's [Gather units]).
    "experts_leaf_inside_a_gather_unit": EXPERTS_LEAF_INSIDE_A_UNIT,
    # A slot waits only for the gradients its backward computes (backward_boundaries'
    # [Gradients a backward will not compute]).
    "experts_not_run_in_a_unit_whose_input_needs_no_grad": EXPERTS_NOT_RUN_IN_A_UNIT_WITHOUT_INPUT_GRAD,
    # A later fetch reuses what its own gather set holds, not the released unit's subtree
    # (invocation_lifecycle's [Reuse distance]).
    "unit_under_reentrant_checkpoint_without_input_grad": UNIT_UNDER_REENTRANT_SEQUENTIAL,
}
PENDING_FAILURES = {}

PENDING_MARK = pytest.mark.xfail(strict=True, raises=AssertionError, reason=PENDING)
PENDING_MARKS = {}
CASES = {**FIXED, **PENDING_FAILURES}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=PENDING_MARKS.get(name, PENDING_MARK) if name in PENDING_FAILURES else ())
    for name in CASES
])
def test_fuzzer_found(name, world_size):
    check_example(dataclasses.replace(CASES[name], world_size=world_size), fork_clean=True)


# Fuzzer found: after a training step, a forward under no_grad leaves the params that ZeRO-3's
# trace says come back soon gathered (default reuse distance), stock and fork alike, and the
# fork's end-of-backward sweep then releases them (6 params here). That is ZeRO's reuse policy
# (releasing them at the end of every no_grad forward would make a hooked ``generate`` gather the
# model again at every token where stock keeps it), not a hold the lifecycle forgot: the drain of
# live invocations finds nothing (``oracle.py`` [Sweeps after a schedule change]).
NO_GRAD_FORWARD_AFTER_A_STEP = Example(schedule=ScheduleSpec(extras=("none", "no_grad")))


def drained_case(example):
    results = oracle.run_example(example)
    return results["fork"].error, results["fork"].drained, results["fork"].swept


def test_no_grad_forward_after_a_step_leaves_the_drain_no_holds():
    for error, drained, swept in run_distributed(2, drained_case, NO_GRAD_FORWARD_AFTER_A_STEP):
        assert error is None, error
        assert not drained, f"the drain released held params at the end of (backward index, params): {drained}"
        assert swept, "the reuse window no longer keeps params after a no_grad forward: update this test's note"
