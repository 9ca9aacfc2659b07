#!/usr/bin/env bash
# Run the test suite once per DeepSpeed version, each in its own venv.
#
#   bash scripts/test.sh                                   # what CI runs (see VERSIONS)
#   bash scripts/test.sh tests/unit/test_harness.py -x     # extra pytest args
#   ZERO3_AC_DS_VERSIONS=0.19.8 bash scripts/test.sh --stock
#   ZERO3_AC_DS_VERSIONS=0.19.2:leg bash scripts/test.sh   # one version, one named selection
#
# Each entry of ZERO3_AC_DS_VERSIONS is a DeepSpeed version, which runs the whole
# suite, or VERSION:SELECTION, which runs the pytest arguments of that
# selection (see `selection` below) instead. With no path among the arguments
# pytest collects `tests` (pytest.ini testpaths), i.e. a whole-suite entry runs
# `python -m pytest tests -q --durations=25 [args]` (the 25 slowest tests of each entry are printed: CI's
# time, 35 minutes at most, is spent where they are); passing a path narrows it. Exit status: 0
# only if every entry passed; "no tests collected" (pytest exit code 5) counts
# as a failure.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
# The whole suite on the newest supported release, the whole suite less the tools' tests on the oldest,
# and a short leg on 0.19.2, the last one before upstream's recompute fix, where stock crashes
# (docs/compatibility.md).
VERSIONS=${ZERO3_AC_DS_VERSIONS:-0.18.5:no-tools 0.19.8 0.19.2:leg}

# selection NAME: the pytest arguments of a named selection, in the array SELECTION.
selection() {
    case $1 in
        leg)
            # The frozen-param checkpointing matrix with ZeRO-3 at 2 ranks (non-reentrant: stock
            # 0.19.2 raises CheckpointError), aliased inputs, several forwards before a backward.
            SELECTION=(tests/unit/runtime/zero/test_frozen_param_checkpointing.py
                       tests/unit/runtime/zero/test_aliased_inputs.py
                       tests/unit/runtime/zero/test_multiple_forwards.py
                       -k "not TestZeroUserBackwardFrozenParamCheckpointing or (-3- and -2])") ;;
        no-tools)
            # The whole suite less the tests of the project's tools: the benchmark scripts' smoke tests
            # (tests/benchmarks/test_*_smoke.py, about 200 s on 2 cores) and the doctor with its self-test
            # (tests/unit/test_doctor.py, about 55 s). They check the tools and run on the newest release;
            # the counters and the other tests of tests/benchmarks/ stay.
            SELECTION=("--ignore-glob=tests/benchmarks/test_*_smoke.py" "--ignore=tests/unit/test_doctor.py") ;;
        *) return 1 ;;
    esac
}

# Every venv is set up first, all at once (downloads, installs and the comm op builds overlap; the
# project builds one version at a time), so that no setup competes with a test for the CPU.
setup_log() { echo "$REPO/.cache/setup_env-ds-$1.log"; }
mkdir -p "$REPO/.cache"
declare -A setup_pid=()
t_setup0=$SECONDS
for entry in $VERSIONS; do
    ver=${entry%%:*}
    [[ -n ${setup_pid[$ver]:-} ]] && continue
    TORCH_EXTENSIONS_DIR=$REPO/.cache/torch_extensions/ds-$ver \
        bash scripts/setup_env.sh "$ver" >"$(setup_log "$ver")" 2>&1 &
    setup_pid[$ver]=$!
done
declare -A setup_rc=()
for ver in "${!setup_pid[@]}"; do
    wait "${setup_pid[$ver]}"
    setup_rc[$ver]=$?
done
t_setup1=$SECONDS
echo "set up ${!setup_pid[*]} in $((t_setup1 - t_setup0))s (logs: .cache/setup_env-ds-VERSION.log)"

overall=0
summary=()
for entry in $VERSIONS; do
    ver=${entry%%:*}
    label="DeepSpeed $ver"
    SELECTION=()
    if [[ $entry == *:* ]]; then
        label="$label (${entry#*:})"
        if ! selection "${entry#*:}"; then
            echo "$label: no such selection"
            summary+=("$label: FAILED (no such selection)")
            overall=1
            continue
        fi
    fi
    echo "================================================================ $label"
    export TORCH_EXTENSIONS_DIR=$REPO/.cache/torch_extensions/ds-$ver
    if [[ ${setup_rc[$ver]} -ne 0 ]]; then
        echo "$label: environment setup FAILED ($(setup_log "$ver")):"
        tail -n 30 "$(setup_log "$ver")"
        summary+=("$label: SETUP FAILED")
        overall=1
        continue
    fi
    t1=$SECONDS
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 \
        "$REPO/.venv/ds-$ver/bin/python" -m pytest -q --durations=25 "${SELECTION[@]}" "$@"
    rc=$?
    t_test=$((SECONDS - t1))
    case $rc in
        0) result=PASSED ;;
        5) result="FAILED (no tests collected)" ;;
        *) result="FAILED (pytest exit code $rc)" ;;
    esac
    [[ $rc -eq 0 ]] || overall=1
    line="$label: $result -- ${t_test}s tests"
    echo "$line"
    summary+=("$line")
done

echo "================================================================ summary"
printf '%s\n' "${summary[@]}"
echo "setup (every version at once) $((t_setup1 - t_setup0))s, total $((SECONDS - t_setup0))s"
exit $overall
