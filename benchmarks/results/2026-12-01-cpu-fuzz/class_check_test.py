from hypothesis import Phase
from tests.unit.runtime.zero.test_differential_fuzz import fuzz
from tests.unit.runtime.zero.fuzz import grammar
from tests.unit.runtime.zero.fuzz.known import KNOWN_FAILURES
import collections
def test_class_clean_where_stock_clean():
    out = collections.Counter()
    for name, applies in KNOWN_FAILURES.items():
        for world in (1, 2):
            fuzz(grammar.examples(world).filter(applies), 100, phases=(Phase.generate,), outcomes=out)
    print("OUTCOMES", dict(out))
