#!/usr/bin/env bash
# Run the test suite once per DeepSpeed version, each in its own venv.
#
#   bash scripts/test.sh                                   # all tests, the versions CI tests
#   bash scripts/test.sh tests/unit/test_harness.py -x     # extra pytest args
#   ZERO3_AC_DS_VERSIONS=0.19.8 bash scripts/test.sh --stock
#
# With no path among the arguments pytest collects `tests` (pytest.ini
# testpaths), i.e. this runs `python -m pytest tests -q [args]`; passing a
# path narrows it. Exit status: 0 only if every version passed; "no tests
# collected" (pytest exit code 5) counts as a failure.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
# The oldest supported release, the last one before upstream's recompute fix, and the newest
# (docs/compatibility.md).
VERSIONS=${ZERO3_AC_DS_VERSIONS:-0.18.5 0.19.8}

overall=0
summary=()
for ver in $VERSIONS; do
    echo "================================================================ DeepSpeed $ver"
    t0=$SECONDS
    export TORCH_EXTENSIONS_DIR=$REPO/.cache/torch_extensions/ds-$ver
    if ! bash scripts/setup_env.sh "$ver" >/dev/null; then
        echo "DeepSpeed $ver: environment setup FAILED"
        summary+=("DeepSpeed $ver: SETUP FAILED after $((SECONDS - t0))s")
        overall=1
        continue
    fi
    t_setup=$((SECONDS - t0))
    t1=$SECONDS
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 \
        "$REPO/.venv/ds-$ver/bin/python" -m pytest -q "$@"
    rc=$?
    t_test=$((SECONDS - t1))
    case $rc in
        0) result=PASSED ;;
        5) result="FAILED (no tests collected)" ;;
        *) result="FAILED (pytest exit code $rc)" ;;
    esac
    [[ $rc -eq 0 ]] || overall=1
    line="DeepSpeed $ver: $result -- wall ${t_setup}s setup + ${t_test}s tests = $((SECONDS - t0))s"
    echo "$line"
    summary+=("$line")
done

echo "================================================================ summary"
printf '%s\n' "${summary[@]}"
exit $overall
