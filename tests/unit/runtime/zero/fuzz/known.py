"""Failure classes the fuzzer found that the fork has not fixed yet, as predicates over examples.

The CI budget fuzzes the grammar without them (so that it looks past them), a test of its own
fuzzes the whole grammar and is expected to fail until they are fixed, and each has a minimal
regression test in ``test_fuzz_regressions.py``. Remove an entry when its fix lands.
"""

from tests.unit.runtime.zero.fuzz.spec import Example, SequentialSpec

NON_REENTRANT = ("nonreentrant", "selective", "ds_nonreentrant")


def _blocks_with_context(example: Example):
    """(block, whether a non-reentrant checkpoint of its parent's holds it) for every block."""
    for stage in example.model.stages:
        if isinstance(stage, SequentialSpec):
            for block in stage.blocks:
                yield block, not stage.use_reentrant
        else:
            yield stage, stage.checkpoint in NON_REENTRANT


def nested_non_reentrant_under_strict_budget(example: Example) -> bool:
    """A body with a submodule (a Linear body passes) inside nested non-reentrant checkpoints."""
    return example.engine.strict and any(block.inner == "nonreentrant" and outer and block.body in ("recursive", "pair")
                                          for block, outer in _blocks_with_context(example))


KNOWN_FAILURES = {
    "nested non-reentrant checkpoints under a strict live budget": nested_non_reentrant_under_strict_budget,
}


def known_failure(example: Example):
    """The name of the first known failure class ``example`` belongs to, or None."""
    return next((name for name, applies in KNOWN_FAILURES.items() if applies(example)), None)

