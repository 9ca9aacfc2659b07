#!/usr/bin/env bash
# Set up a venv per DeepSpeed version (scripts/setup_env.sh) and run examples/demo.py on CPU in each:
# stock DeepSpeed vs the fork, side by side.
#   bash scripts/demo.sh [demo args...]
#   ZERO3_AC_DS_VERSIONS=0.19.8 bash scripts/demo.sh --steps 6
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
export DS_ACCELERATOR=cpu
for DSVER in ${ZERO3_AC_DS_VERSIONS:-0.19.2 0.19.8}; do
    echo "================================================================ DeepSpeed $DSVER"
    bash "$REPO/scripts/setup_env.sh" "$DSVER" >/dev/null
    TORCH_EXTENSIONS_DIR=$REPO/.cache/torch_extensions/ds-$DSVER \
        "$REPO/.venv/ds-$DSVER/bin/python" examples/demo.py "$@"
done
