#!/usr/bin/env bash
# Mutation testing of the invocation lifecycle and the borrow rule (docs/mutation.md): mutmut
# mutates zero3_ac/runtime/zero/invocation_lifecycle.py and borrowed_params.py and runs, for each
# mutant, the tests of its function (configuration: the [mutmut] section of setup.cfg).
#
#   bash scripts/mutation.sh                  # a full run from scratch (removes mutants/ first)
#   bash scripts/mutation.sh results          # any other mutmut command: results, show NAME, browse,
#   bash scripts/mutation.sh run NAME...      #   or a rerun of some mutants, in the last run's mutants/
#
# mutmut runs pytest in its own process, so it must import the test venv's packages. It is
# installed (requirements/requirements-mutation.txt) into a venv of its own,
# .venv/mutation-ds-$VER, whose site-packages add those of the test venv .venv/ds-$VER
# (scripts/setup_env.sh) through a .pth file: the test venv stays as CI has it, and its
# zero3_ac.pth still runs at start-up. mutmut copies the package into mutants/ and puts that
# folder first on sys.path, so the tests, and the gloo ranks they spawn (which get the parent's
# sys.path), import the mutated copy, not the installed package.
#
# The mutants of borrowed_params run in the ranks, where mutmut cannot see which tests call
# them: scripts/mutation_test_selection.py (a pytest plugin) gives them test_borrowed_params.py.
#
# Env knobs:
#   ZERO3_AC_DS_VERSION      the DeepSpeed version of the test venv (default 0.19.8)
#   MUTATION_MAX_CHILDREN    mutants tested at once (default 1: the machine has 2 cores)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
VER=${ZERO3_AC_DS_VERSION:-0.19.8}
TEST_VENV=$REPO/.venv/ds-$VER
VENV=$REPO/.venv/mutation-ds-$VER
export PIP_DISABLE_PIP_VERSION_CHECK=1

bash scripts/setup_env.sh "$VER" >/dev/null
if [[ ! -x $VENV/bin/mutmut ]]; then
    "$(readlink -f "$TEST_VENV/bin/python")" -m venv "$VENV"
    test_site=$("$TEST_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    own_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$test_site')" > "$own_site/zero3_ac_test_venv.pth"
    "$VENV/bin/python" -m pip -qq install -r requirements/requirements-mutation.txt
fi

export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
# Its own build of DeepSpeed's shm op, made here before any mutant runs under a time limit: a build
# shared with other test runs is rebuilt whenever one from another checkout has other flags, and a
# mutant whose time runs out inside a build leaves the build's lock behind, on which every later
# rank waits for ever.
export TORCH_EXTENSIONS_DIR=$REPO/.cache/torch_extensions/mutation-ds-$VER
"$VENV/bin/python" -c 'import importlib; importlib.import_module("deepspeed.comm.torch").build_shm_op()' >/dev/null
export PYTHONPATH=$REPO/scripts${PYTHONPATH:+:$PYTHONPATH}
if [[ $# -eq 0 ]]; then
    rm -rf mutants
    set -- run --max-children "${MUTATION_MAX_CHILDREN:-1}"
fi
exec "$VENV/bin/mutmut" "$@"
