"""A pytest plugin for mutmut (scripts/mutation.sh): which tests each mutant runs, and how.

mutmut learns which tests call a function from its trampolines, in the pytest process only: the
functions of a module that runs only in the ranks that the harness spawns (``borrowed_params``,
DeepSpeed glue) look called by no test, and their mutants would be reported "no tests". For each
such module, this plugin counts every function in it as called by every test of the module's own
test file, so each of its mutants runs that file.

It also loads a Hypothesis profile that makes each mutant's run reproducible and quick to fail:
every run draws the same examples (derandomized, no example database), and a failing example is not
shrunk (a mutant only needs one).
"""

import ast
import pathlib

import pytest
from hypothesis import Phase, settings
from mutmut.mutation.trampoline import get_mutant_under_test
from mutmut.mutation.trampoline_templates import mangle_function_name
from mutmut.state import state

settings.register_profile("mutation", derandomize=True, database=None, phases=(Phase.explicit, Phase.generate))
settings.load_profile("mutation")

REPO = pathlib.Path(__file__).resolve().parent.parent
TESTS_OF_RANK_ONLY_MODULES = {
    "zero3_ac/runtime/zero/borrowed_params.py": "tests/unit/runtime/zero/test_borrowed_params.py",
}


def functions_of(path):
    """mutmut's names of the functions and methods that ``path`` defines at its top level."""
    module = path.removesuffix(".py").replace("/", ".")
    tree = ast.parse((REPO / path).read_text())  # the source, not its mutated copy
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(mangle_function_name(name=node.name, class_name=None))
        elif isinstance(node, ast.ClassDef):
            names.extend(
                mangle_function_name(name=method.name, class_name=node.name) for method in node.body
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return [f"{module}.{name}" for name in names]


@pytest.hookimpl(tryfirst=True)  # before mutmut's own teardown hook reads the calls
def pytest_runtest_teardown(item):
    if get_mutant_under_test() != "stats":
        return
    test_file = item.nodeid.removeprefix("mutants/").split("::")[0]
    for module_path, tests in TESTS_OF_RANK_ONLY_MODULES.items():
        if test_file == tests:
            state()._stats.update(functions_of(module_path))

