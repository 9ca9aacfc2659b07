#!/usr/bin/env bash
# Paired rounds on the device machine (1xH200), about 8 minutes (at most about TOTAL_S, 560 s): the fork against
# FSDP2, against plain PyTorch and against a second copy of itself (fork#2, the A/A check), LoRA r16, non-reentrant
# checkpointing (benchmarks/peers.py --paired, benchmarks/paired.py). Three runs, one folder each:
#   1.1b/  the 1.1B shape, the four systems;
#   aa/    the 1.1B shape, the two forks alone, 200 steps each (40 cycles): the benchmark's resolution. Inside the
#          four-system rounds the A/A interval is too wide to pass; a round of the two forks alone passed,
#          0.992 [0.977, 1.006] (benchmarks/results/2026-12-04-1xh200-whole-shard-fetch);
#   8b/    the Llama-3-8B shape, the four systems, with the time that is left.
# Needs the wheels of scripts/fetch_gpu_wheels.sh in .whl (carried; bitsandbytes is not used here).
#   bash benchmarks/run_paired_gpu.sh [OUTDIR]        (OUTDIR defaults to $OUT)
# Settings (environment): TOTAL_S (default 560) seconds in all; BLOCK (5) steps per turn; measured steps per system
# per round STEPS_11B (60), STEPS_AA (200), STEPS_8B (40); ROUNDS_11B (3), ROUNDS_8B (2). How long a round is
# expected to take: ROUND_11B_S (130), AA_S (180), ROUND_8B_S (190); the A/A run and the 8B run start only with more
# than that left (AA_S=0 skips the A/A run). BUDGET_11B: seconds after which no 1.1B round starts; by default what
# TOTAL_S leaves for one more 1.1B round, the A/A round and an 8B round: one 1.1B round (with AA_S=0 about 225 s,
# two or three rounds).
# Writes 7 files (a device call brings back at most 8): OUTDIR/README.md (machine, versions, commands, each run's
# A/A verdict, wall time, and the log: peers.py's output, its tables included, warnings left out), and per run
# runs.jsonl and settings.json. A run's README.md and chart are there while it runs and deleted when it ends (its
# A/A line goes to OUTDIR/README.md first); write them here with `python benchmarks/paired_report.py OUTDIR/aa`.
set -uo pipefail
OUTDIR=${1:-$OUT}
START=$SECONDS
source benchmarks/gpu_site.sh
TOTAL=${TOTAL_S:-560} AA=${AA_S:-180} R8=${ROUND_8B_S:-190}
mkdir -p "$OUTDIR"
log=$(mktemp)
verdicts=""
paired="--paired --device cuda"
common="--modes lora --ac nonreentrant --block ${BLOCK:-1} --warmup 3 --timeout-s 300"
four="--systems plain,fsdp2,fork --aa fork"
readme_header "Paired rounds, 1xH200: fork against FSDP2, plain PyTorch and itself (A/A)" "$OUTDIR/README.md"
run() {
    echo "    python3 benchmarks/peers.py $*" >>"$OUTDIR/README.md"
    python3 benchmarks/peers.py "$@" 2>&1 | grep -v -i warn | tee -a "$log"
}
# verdict DIR LABEL: DIR's A/A line into the summary, then DIR's README.md and chart away. paired_report.py writes
# "- A/A SHAPE w1 lora nonreentrant fork / fork#2: ..."; the shape does not tell aa/ from 1.1b/, so LABEL goes first.
verdict() {
    if [[ -f $OUTDIR/$1/README.md ]]; then
        verdicts+=$(grep -E "^- (A/A|no A/A)" "$OUTDIR/$1/README.md" | sed "s|^- |- $1/ ($2): |")$'\n'
    else
        verdicts+="- $1/ ($2): no README.md written (see the log)"$'\n'
    fi
    rm -f "$OUTDIR/$1/README.md" "$OUTDIR/$1/paired.png"
}
skipped() {
    verdicts+="- $1/ ($2): skipped, $3"$'\n'
    echo "$1 skipped: $3" | tee -a "$log"
}
left=$((TOTAL - (SECONDS - START)))
fit=$((left - ${ROUND_11B_S:-130} - AA - R8))
run $paired $four $common --shape 1.1b --steps "${STEPS_11B:-60}" --rounds "${ROUNDS_11B:-3}" \
    --budget-s "${BUDGET_11B:-$((fit > 1 ? fit : 1))}" --out "$OUTDIR/1.1b"
verdict 1.1b "plain, fsdp2, fork, fork#2"
left=$((TOTAL - (SECONDS - START)))
if ((AA > 0 && left > AA)); then
    # --budget-s as for 8B: no round starts with AA_S s or less left (it stops no running round; --rounds 1).
    run $paired --systems fork --aa fork $common --shape 1.1b --steps "${STEPS_AA:-200}" --rounds 1 \
        --budget-s $((left - AA)) --out "$OUTDIR/aa"
    verdict aa "the A/A-only round: fork, fork#2"
else
    skipped aa "the A/A-only round" "$( ((AA > 0)) && echo "$left s left" || echo AA_S=0)"
fi
left=$((TOTAL - (SECONDS - START)))
if ((left > R8)); then
    run $paired $four $common --shape 8b --steps "${STEPS_8B:-40}" --rounds "${ROUNDS_8B:-2}" \
        --budget-s $((left - R8)) --out "$OUTDIR/8b"
    verdict 8b "plain, fsdp2, fork, fork#2"
else
    skipped 8b "plain, fsdp2, fork, fork#2" "$left s left"
fi
{
    echo
    printf %s "$verdicts"
    echo
    echo "Wall time $((SECONDS - START)) s. Raw rows: DIR/runs.jsonl, DIR/settings.json; tables: the log below;"
    echo "DIR/README.md and the chart: \`python benchmarks/paired_report.py DIR\`."
    echo
    echo "## Log (peers.py's output, warnings left out)"
    echo
    sed 's/^/    /' "$log"
} >>"$OUTDIR/README.md"
rm -f "$log"
sed '/^## Log/,$d' "$OUTDIR/README.md"
