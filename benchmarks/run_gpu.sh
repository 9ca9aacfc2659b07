#!/usr/bin/env bash
# Run benchmarks/bench.py on the device machine (2×H200): install the carried wheels, then the benchmark.
#   bash benchmarks/run_gpu.sh OUTDIR [bench args...]
set -uo pipefail
OUTDIR=$1; shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p "$OUTDIR"
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import torch, transformers, peft, deepspeed; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "deepspeed", deepspeed.__version__)'
    echo "command: python3 benchmarks/bench.py --device cuda $*"
} 2>&1 | tee "$OUTDIR/environment.txt"
python3 benchmarks/bench.py --device cuda --out "$OUTDIR/bench.jsonl" "$@" 2>&1 | tee "$OUTDIR/bench.log" | grep -v -i warn
