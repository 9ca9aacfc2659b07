#!/usr/bin/env bash
# The peer benchmark (benchmarks/peers.py) on the device machine: plain PyTorch, FSDP2, stock ZeRO-3 and the fork,
# about 9 minutes in all. Needs the wheels of scripts/fetch_gpu_wheels.sh in .whl (carried).
#   bash benchmarks/run_peers_gpu.sh [OUTDIR]      (OUTDIR defaults to $OUT; WORLDS=1,2 adds world size 2;
#   BUDGET_11B=seconds for the 1.1B part, default 270; ROUNDS, default 3; TOTAL_S=seconds in all, default 500)
# 1.1B shape: LoRA non-reentrant and reentrant, full fine-tune non-reentrant, all four systems, rounds until
# about 4.5 minutes have passed; then the Llama-3-8B shape, LoRA non-reentrant, all four, until the rest is spent.
set -uo pipefail
OUTDIR=${1:-$OUT}
WORLDS=${WORLDS:-1}
START=$SECONDS
source benchmarks/gpu_site.sh
mkdir -p "$OUTDIR/1.1b" "$OUTDIR/8b"
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import torch, transformers, peft, deepspeed, zero3_ac; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "deepspeed", deepspeed.__version__, "fork active", zero3_ac.is_active(), "from", zero3_ac.__file__)'
} 2>&1 | tee "$OUTDIR/environment.txt"
common="--device cuda --world $WORLDS --systems plain,fsdp2,stock,fork --warmup 2 --steps 4 --timeout-s 150"
python3 benchmarks/peers.py $common --shape 1.1b --modes lora,full --ac nonreentrant,reentrant \
    --lora-only-ac reentrant --rounds ${ROUNDS:-3} --budget-s ${BUDGET_11B:-270} --out "$OUTDIR/1.1b" 2>&1 | tee "$OUTDIR/peers.log" | grep -v -i warn
left=$((${TOTAL_S:-500} - (SECONDS - START)))
python3 benchmarks/peers.py $common --shape 8b --modes lora --ac nonreentrant --rounds 3 --budget-s $((left > 60 ? left - 60 : 0)) \
    --out "$OUTDIR/8b" 2>&1 | tee -a "$OUTDIR/peers.log" | grep -v -i warn
echo "wall $((SECONDS - START)) s" | tee -a "$OUTDIR/environment.txt"
