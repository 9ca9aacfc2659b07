#!/usr/bin/env bash
# HF Trainer + PEFT LoRA at the TinyLlama-1.1B shape on the device machine, stock vs fork.
#   [NUM_GPUS=2] bash benchmarks/run_hf_trainer_gpu.sh OUTDIR [STEPS]
# Launched by the deepspeed launcher exactly as docs/clients.md shows, non-reentrant checkpointing,
# HF's "auto" ZeRO-3 settings (examples/ds_config_zero3_auto.json); stock = ZERO3_AC_DISABLE=1.
set -uo pipefail
OUTDIR=$1
STEPS=${2:-30}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# The installed package's zero3_ac.pth applies the fork in every process; PYTHONPATH entries do not
# read .pth files, so a sitecustomize does the same here.
echo "import _zero3_ac_autoload" >/tmp/site/sitecustomize.py
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
mkdir -p "$OUTDIR"
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import torch, transformers, peft, deepspeed; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "deepspeed", deepspeed.__version__)'
} 2>&1 | tee "$OUTDIR/environment.txt"
for impl in stock fork; do
    disable=0; [[ $impl == stock ]] && disable=1
    command="deepspeed --num_gpus ${NUM_GPUS:-2} examples/hf_trainer_lora.py --deepspeed examples/ds_config_zero3_auto.json --bf16 --shape tinyllama --lora-rank 16 --seq-len 2048 --batch-size 2 --lr 1e-4 --steps $STEPS --summary $OUTDIR/$impl"
    echo "ZERO3_AC_DISABLE=$disable $command" | tee -a "$OUTDIR/environment.txt"
    ZERO3_AC_DISABLE=$disable $command >"$OUTDIR/$impl.log" 2>&1
    echo "$impl exit code $?" | tee -a "$OUTDIR/environment.txt"
done
python3 benchmarks/hf_trainer_report.py "$OUTDIR" | tee "$OUTDIR/table.md"
