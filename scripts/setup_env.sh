#!/usr/bin/env bash
# Create (or reuse) the test venv for one DeepSpeed version and (re)install
# this project into it.
#
#   bash scripts/setup_env.sh 0.19.8        -> .venv/ds-0.19.8
#
# Order matters: torch==2.13.0 (CPU build) is installed FIRST and pinned with a
# constraint for every later pip call, so deepspeed/transformers/peft can never
# swap it for a CUDA build. Then deepspeed==$DSVER + dev requirements, then the
# project itself, non-editable (so zero3_ac.pth lands in site-packages), always
# force-reinstalled so edits are picked up.
#
# Re-runs only reinstall the project (a few seconds) unless the dependency
# stamp (DeepSpeed version, torch spec, requirements files) changed.
#
# Env knobs:
#   PYTHON                              interpreter for a new venv (default python3.11, else python3)
#   ZERO3_AC_TORCH_SPEC                 default torch==2.13.0
#   ZERO3_AC_TORCH_EXTRA_INDEX_URL      extra index for the torch install only
#                                       (CI: https://download.pytorch.org/whl/cpu)
#   ZERO3_AC_FORCE_DEPS=1               reinstall dependencies even if the stamp matches
#
# All messages go to stderr; the last stdout line is the venv path.
set -euo pipefail

if [[ $# -ne 1 || -z "$1" ]]; then
    echo "usage: $0 DEEPSPEED_VERSION   (e.g. 0.19.8)" >&2
    exit 2
fi
DSVER=$1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$REPO/.venv/ds-$DSVER
VPY=$VENV/bin/python
TORCH_SPEC=${ZERO3_AC_TORCH_SPEC:-torch==2.13.0}
export TORCH_EXTENSIONS_DIR=$REPO/.cache/torch_extensions/ds-$DSVER
export PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$TORCH_EXTENSIONS_DIR"

# Serialize concurrent runs for one venv; runs for different versions go on side by side (scripts/test.sh
# sets up all of its versions at once) and wait for each other only to build the project (below).
have_flock=0
if command -v flock >/dev/null 2>&1; then
    have_flock=1
    mkdir -p "$REPO/.cache"
    exec 9>"$REPO/.cache/setup_env-ds-$DSVER.lock"
    flock 9
fi

log() { echo "[setup_env ds-$DSVER] $*" >&2; }
# -qq: errors only (plain -q still prints environment warnings on every call).
pip_() { "$VPY" -m pip -qq "$@"; }

t0=$SECONDS

# ---------------------------------------------------------------- venv
if [[ ! -x $VPY ]]; then
    if [[ -n ${PYTHON:-} ]]; then
        BASEPY=$PYTHON
    elif command -v python3.11 >/dev/null 2>&1; then
        BASEPY=python3.11
    else
        BASEPY=python3
    fi
    log "creating venv $VENV with $("$BASEPY" --version 2>&1)"
    rm -rf "$VENV"
    mkdir -p "$REPO/.venv"
    "$BASEPY" -m venv "$VENV"
fi

# ---------------------------------------------------------------- dependencies
STAMP=$VENV/.zero3_ac-deps-stamp
want_stamp=$(
    {
        echo "deepspeed==$DSVER"
        echo "$TORCH_SPEC"
        cat "$REPO/requirements/requirements.txt" "$REPO/requirements/requirements-dev.txt"
    } | sha256sum | cut -d' ' -f1
)

deps_ok() {
    [[ -f $STAMP && $(cat "$STAMP") == "$want_stamp" && ${ZERO3_AC_FORCE_DEPS:-0} != 1 ]] || return 1
    # cheap sanity check that the venv still has what the stamp claims
    "$VPY" - "$DSVER" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
assert version("deepspeed") == sys.argv[1], version("deepspeed")
version("torch"); version("pytest"); version("wheel"); version("setuptools")
EOF
}

if deps_ok; then
    log "dependencies up to date (deepspeed $DSVER)"
else
    rm -f "$STAMP"
    CONSTRAINTS=$VENV/.zero3_ac-constraints.txt
    echo "$TORCH_SPEC" >"$CONSTRAINTS"
    torch_idx=()
    if [[ -n ${ZERO3_AC_TORCH_EXTRA_INDEX_URL:-} ]]; then
        torch_idx=(--extra-index-url "$ZERO3_AC_TORCH_EXTRA_INDEX_URL")
    fi

    log "installing build tools"
    pip_ install --upgrade setuptools wheel

    if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
        # Refuse to download a CUDA build of torch (it would pull nvidia-* wheels).
        report=$(mktemp)
        pip_ install --dry-run --ignore-installed --report "$report" "${torch_idx[@]}" "$TORCH_SPEC"
        if "$VPY" - "$report" <<'EOF'
import json, sys
rep = json.load(open(sys.argv[1]))
names = [i["metadata"]["name"].lower() for i in rep["install"]]
bad = [n for n in names if n.startswith("nvidia-") or n in ("triton", "pytorch-triton")]
if bad:
    print("refusing CUDA torch build; it would pull: " + ", ".join(bad), file=sys.stderr)
    sys.exit(1)
EOF
        then rm -f "$report"
        else
            rm -f "$report"
            log "ERROR: '$TORCH_SPEC' resolves to a CUDA build. Set ZERO3_AC_TORCH_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
            exit 1
        fi
    fi
    log "installing $TORCH_SPEC"
    pip_ install "${torch_idx[@]}" "$TORCH_SPEC"

    log "installing deepspeed==$DSVER and dev requirements"
    pip_ install -c "$CONSTRAINTS" \
        "deepspeed==$DSVER" \
        -r "$REPO/requirements/requirements.txt" \
        -r "$REPO/requirements/requirements-dev.txt"

    "$VPY" - "$DSVER" <<'EOF'
import sys
import torch
from importlib.metadata import version
if torch.version.cuda is not None:
    sys.exit(f"torch {torch.__version__} is a CUDA build (cuda {torch.version.cuda}); expected a CPU build")
if version("deepspeed") != sys.argv[1]:
    sys.exit(f"deepspeed {version('deepspeed')} installed, wanted {sys.argv[1]}")
EOF
    echo "$want_stamp" >"$STAMP"
    log "dependencies installed in $((SECONDS - t0))s"
fi

# ---------------------------------------------------------------- project
# Always a fresh, non-editable build: a stale build/lib would smuggle deleted
# modules into the wheel, and an editable install would not install zero3_ac.pth.
t1=$SECONDS
if [[ $have_flock == 1 ]]; then
    exec 8>"$REPO/.cache/setup_env-build.lock"  # every version builds in the repo's build/ directory
    flock 8
fi
rm -rf "$REPO/build"
(cd "$REPO" && pip_ install --no-deps --force-reinstall --no-build-isolation .)
rm -rf "$REPO/build"
if [[ $have_flock == 1 ]]; then
    exec 8>&-
fi
log "project installed in $((SECONDS - t1))s"

# ---------------------------------------------------------------- comm op
# Build DeepSpeed's CPU shm comm op once per DeepSpeed version, here rather
# than inside the first test's timeout.
if ! compgen -G "$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm/*.so" >/dev/null; then
    t2=$SECONDS
    log "building DeepSpeed CPU comm op into $TORCH_EXTENSIONS_DIR"
    if ! DS_ACCELERATOR=cpu ZERO3_AC_DISABLE=1 "$VPY" - >"$TORCH_EXTENSIONS_DIR/build.log" 2>&1 <<'EOF'
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None and builder.is_compatible():
    builder.load()
EOF
    then
        log "WARNING: comm op build failed (see $TORCH_EXTENSIONS_DIR/build.log); the first test will retry"
    else
        log "comm op built in $((SECONDS - t2))s"
    fi
fi
log "ready: $VENV (total $((SECONDS - t0))s)"
echo "$VENV"
