#!/usr/bin/env bash
# Fill .whl with what the device machine's image (python 3.12, torch 2.11, transformers 5.17, peft 0.21) lacks
# for DeepSpeed 0.19.8: DeepSpeed itself, hjson, pydantic and pydantic's own needs; and for QLoRA
# (benchmarks/run_qlora_gpu.sh) bitsandbytes 0.50.2, whose manylinux x86_64 wheel (41 MiB: CPU, CUDA 11.8-13.2,
# ROCm and XPU builds in one) needs only torch, numpy and packaging, all in the image; and pyinstrument 5.1.3 for
# `benchmarks/profile_step.py --sampler pyinstrument` (no dependencies, 0.1 MiB). The GPU scripts install
# them with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl` (benchmarks/run_peers_gpu.sh).
# All of .whl travels with every call (46 MiB of the 64 MiB a call may carry, the working tree included).
#   bash scripts/fetch_gpu_wheels.sh [DEST]        (DEST defaults to .whl in the repository root)
# Already in the image (KINDS.md), so not fetched: einops, msgpack, ninja, numpy, packaging, psutil, py-cpuinfo,
# tqdm. DeepSpeed is published as a source archive only: its pure-Python wheel is built here with DS_BUILD_OPS=0
# (ops build just in time where used), by a python that has torch (DeepSpeed's setup.py imports it):
# ZERO3_AC_WHEEL_PYTHON, else .venv/ds-0.19.8/bin/python.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$ROOT/.whl}
BUILD_PYTHON=${ZERO3_AC_WHEEL_PYTHON:-$ROOT/.venv/ds-0.19.8/bin/python}
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" \
    hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0 bitsandbytes==0.50.2 pyinstrument==5.1.3
SDIST=$(mktemp -d)
trap 'rm -rf "$SDIST"' EXIT
python3 -m pip download -q --no-deps --no-binary=:all: -d "$SDIST" deepspeed==0.19.8
DS_BUILD_OPS=0 "$BUILD_PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$SDIST"/deepspeed-0.19.8.tar.gz
ls -l "$DEST"
du -ch "$DEST"/*.whl | tail -1
