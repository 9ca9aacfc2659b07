"""Failure classes the fuzzer found that the fork has not fixed yet, as predicates over examples.

The CI budget fuzzes the grammar without them (so that it looks past them), a test of its own
fuzzes the whole grammar and is expected to fail until they are fixed, and each has a minimal
regression test in ``test_fuzz_regressions.py``. Remove an entry when its fix lands.
"""

from tests.unit.runtime.zero.fuzz.spec import Example

KNOWN_FAILURES = {}


def known_failure(example: Example):
    """The name of the first known failure class ``example`` belongs to, or None."""
    return next((name for name, applies in KNOWN_FAILURES.items() if applies(example)), None)
