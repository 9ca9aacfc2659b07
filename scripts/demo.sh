#!/usr/bin/env bash
# Set up the DeepSpeed 0.19.8 venv (scripts/setup_env.sh) and run examples/demo.py on CPU.
#   bash scripts/demo.sh [demo args...]
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DSVER=0.19.8
bash "$REPO/scripts/setup_env.sh" "$DSVER" >/dev/null
cd "$REPO"
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR=$REPO/.cache/torch_extensions/ds-$DSVER
exec "$REPO/.venv/ds-$DSVER/bin/python" examples/demo.py "$@"
