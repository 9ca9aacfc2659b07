#!/usr/bin/env bash
# Stock DeepSpeed against the fork (examples/demo.py, 2 CPU ranks) on DeepSpeed 0.19.2 and 0.19.8:
# sets up a venv per version (scripts/setup_env.sh; the first time a few minutes each), runs the
# demo in each, and ends with each version's two-line verdict.
#   bash scripts/demo.sh [demo args...]
#   ZERO3_AC_DS_VERSIONS=0.19.8 bash scripts/demo.sh --steps 6
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
export DS_ACCELERATOR=cpu
VERDICTS=$(mktemp)
trap 'rm -f "$VERDICTS"' EXIT
status=0
for DSVER in ${ZERO3_AC_DS_VERSIONS:-0.19.2 0.19.8}; do
    echo "================================================================ DeepSpeed $DSVER"
    echo "setting up .venv/ds-$DSVER (scripts/setup_env.sh; the first time a few minutes) ..."
    SETUP_LOG=$REPO/.cache/setup_env-ds-$DSVER.log
    mkdir -p "$REPO/.cache"
    if ! bash "$REPO/scripts/setup_env.sh" "$DSVER" >"$SETUP_LOG" 2>&1; then
        cat "$SETUP_LOG"
        exit 1
    fi
    OUTPUT=$(mktemp)
    TORCH_EXTENSIONS_DIR=$REPO/.cache/torch_extensions/ds-$DSVER \
        "$REPO/.venv/ds-$DSVER/bin/python" examples/demo.py "$@" | tee "$OUTPUT" || status=1
    tail -n 2 "$OUTPUT" >>"$VERDICTS"
    rm -f "$OUTPUT"
done
echo "================================================================ verdict"
cat "$VERDICTS"
exit $status
