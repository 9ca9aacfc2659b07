"""Failure classes the fuzzer found that the fork has not fixed yet, as predicates over examples.

The CI budget fuzzes the grammar without them (so that it looks past them), a test of its own
fuzzes the whole grammar and is expected to fail until they are fixed, and each has a minimal
regression test in ``test_fuzz_regressions.py``. Remove an entry when its fix lands.
"""

from tests.unit.runtime.zero.fuzz.spec import Example, SequentialSpec


def _reentrant(stage) -> bool:
    if isinstance(stage, SequentialSpec):
        return stage.use_reentrant
    return stage.checkpoint in ("reentrant", "ds_reentrant") or stage.inner == "reentrant"


def _unit_under_reentrant_checkpoint_without_input_grad(example: Example) -> bool:
    """Blocks as gather units, one of them under a reentrant checkpoint (``checkpoint``,
    ``checkpoint_sequential``) whose input needs no grad (so its region has no backward), under
    ZeRO-3's default reuse policy: the fork's end-of-backward sweep releases params that ZeRO-3 kept
    gathered after the second step's forward. No gradient is wrong and nothing is left after the
    backward; stock (no units) releases them earlier. Found by the fuzzer once blocks could be units
    (docs/fuzzing.md)."""
    return (example.engine.units and not example.engine.strict and not example.schedule.input_grad
            and example.model.stem != "trainable" and any(_reentrant(stage) for stage in example.model.stages))


KNOWN_FAILURES = {"unit_under_reentrant_checkpoint_without_input_grad": _unit_under_reentrant_checkpoint_without_input_grad}


def known_failure(example: Example):
    """The name of the first known failure class ``example`` belongs to, or None."""
    return next((name for name, applies in KNOWN_FAILURES.items() if applies(example)), None)

