#!/usr/bin/env bash
# Paired rounds on the device machine (1xH200), about 9 minutes: the fork against FSDP2, against plain PyTorch
# and against a second copy of itself (the A/A check), LoRA r16, non-reentrant checkpointing; the 1.1B shape,
# then the Llama-3-8B shape with the time that is left (benchmarks/peers.py --paired, benchmarks/paired.py).
# Needs the wheels of scripts/fetch_gpu_wheels.sh in .whl (carried; bitsandbytes is not used here).
#   bash benchmarks/run_paired_gpu.sh [OUTDIR]        (OUTDIR defaults to $OUT)
# Settings (environment): TOTAL_S (default 540) seconds in all; STEPS_11B (60) and STEPS_8B (40) measured steps per
# system per round; BLOCK (5) steps per turn; ROUNDS_11B (3); BUDGET_11B (230) seconds after which no 1.1B round starts;
# ROUNDS_8B (2); ROUND_8B_S (190) how long an 8B round is expected to take (none starts without that much left).
# Writes OUTDIR/README.md (machine, versions, commands, A/A verdicts, wall time), OUTDIR/paired.log, and per shape
# runs.jsonl, settings.json and README.md (8 files: what a device call brings back). The charts are left out;
# draw them here with `python benchmarks/paired_report.py OUTDIR/1.1b`.
set -uo pipefail
OUTDIR=${1:-$OUT}
START=$SECONDS
source benchmarks/gpu_site.sh
mkdir -p "$OUTDIR/1.1b" "$OUTDIR/8b"
common="--paired --device cuda --systems plain,fsdp2,fork --aa fork --modes lora --ac nonreentrant --block ${BLOCK:-5} \
--warmup 3 --timeout-s 300"
readme_header "Paired rounds, 1xH200: fork against FSDP2, plain PyTorch and itself (A/A)" "$OUTDIR/README.md"
run() {
    echo "    python3 benchmarks/peers.py $*" >>"$OUTDIR/README.md"
    python3 benchmarks/peers.py "$@" 2>&1 | grep -v -i warn | tee -a "$OUTDIR/paired.log"
}
run $common --shape 1.1b --steps "${STEPS_11B:-60}" --rounds "${ROUNDS_11B:-3}" --budget-s "${BUDGET_11B:-230}" --out "$OUTDIR/1.1b"
left=$((${TOTAL_S:-540} - (SECONDS - START)))
if ((left >= ${ROUND_8B_S:-190})); then
    run $common --shape 8b --steps "${STEPS_8B:-40}" --rounds "${ROUNDS_8B:-2}" --budget-s $((left - ${ROUND_8B_S:-190})) --out "$OUTDIR/8b"
else
    echo "8B skipped: $left s left" | tee -a "$OUTDIR/paired.log"
fi
rm -f "$OUTDIR"/*/paired.png
{
    echo
    grep -h "^- A/A" "$OUTDIR"/*/README.md
    echo
    echo "Wall time $((SECONDS - START)) s. Tables: 1.1b/README.md, 8b/README.md."
} >>"$OUTDIR/README.md"
cat "$OUTDIR/README.md"
