#!/usr/bin/env bash
# The QLoRA peer benchmark (benchmarks/peers.py --modes qlora) on the device machine, one shape per call: stock
# ZeRO-3 and the fork, non-reentrant and reentrant checkpointing, a 4-bit NF4 base (bitsandbytes, bf16 quant
# storage), LoRA r16 on every linear layer; step time, peak memory, all-gathers. Needs the wheels of
# scripts/fetch_gpu_wheels.sh in .whl (carried; bitsandbytes among them).
#   bash benchmarks/run_qlora_gpu.sh 1.1b [OUTDIR]      then      bash benchmarks/run_qlora_gpu.sh 8b [OUTDIR]
# OUTDIR defaults to $OUT; results go to OUTDIR/qlora-<shape>. Knobs: WORLDS (default 1; 1,2 adds world size 2),
# SYSTEMS (default stock,fork; plain,fsdp2,stock,fork adds the peers), BUDGET_S (default 540: no run starts after
# BUDGET_S - 120 s, the time one 8B run may take). Every run loads the bf16 base checkpoint (2.2 GB for 1.1B,
# 16 GB for 8B, written once per call) and quantizes it on the GPU.
set -uo pipefail
SHAPE=${1:?usage: bash benchmarks/run_qlora_gpu.sh 1.1b|8b [OUTDIR]}
OUTDIR=${2:-$OUT}
WORLDS=${WORLDS:-1}
SYSTEMS=${SYSTEMS:-stock,fork}
BUDGET_S=${BUDGET_S:-540}
START=$SECONDS
source benchmarks/gpu_site.sh
mkdir -p "$OUTDIR/qlora-$SHAPE"
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import torch, transformers, peft, deepspeed, bitsandbytes, zero3_ac; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "deepspeed", deepspeed.__version__, "bitsandbytes", bitsandbytes.__version__, "fork active", zero3_ac.is_active())'
} 2>&1 | tee "$OUTDIR/qlora-$SHAPE/environment.txt"
python3 benchmarks/peers.py --device cuda --shape "$SHAPE" --world "$WORLDS" --systems "$SYSTEMS" --modes qlora \
    --ac nonreentrant,reentrant --warmup 2 --steps 4 --timeout-s 300 --rounds 3 --budget-s $((BUDGET_S - 120)) \
    --out "$OUTDIR/qlora-$SHAPE" 2>&1 | tee "$OUTDIR/qlora-$SHAPE/peers.log" | grep -v -i warn
echo "wall $((SECONDS - START)) s" | tee -a "$OUTDIR/qlora-$SHAPE/environment.txt"
