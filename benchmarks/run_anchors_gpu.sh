#!/usr/bin/env bash
# The compiled anchors on the device machine (1xH200): FSDP2 with torch.compile on every decoder layer
# (fsdp2_compile) and DeepSpeed's DeepCompile on ZeRO-3 (deepcompile, the fork installed and standing aside),
# beside FSDP2 and the fork, LoRA r16, non-reentrant checkpointing, world 1 (benchmarks/peer_worker.py).
# Needs the wheels of scripts/fetch_gpu_wheels.sh in .whl (carried).
#   PROBE=1 bash benchmarks/run_anchors_gpu.sh [OUTDIR]   one short run of each anchor, to see whether it trains
#   bash benchmarks/run_anchors_gpu.sh [OUTDIR]           paired rounds (benchmarks/paired.py) of SYSTEMS
# Settings (environment): SHAPES (default "1.1b 8b"); SYSTEMS (fsdp2,fsdp2_compile,fork; deepcompile joins where
# the probe trained it); STEPS (40) measured steps per system per round; ROUNDS (1); BLOCK (5).
set -uo pipefail
OUTDIR=${1:-$OUT}
START=$SECONDS
source benchmarks/gpu_site.sh
mkdir -p "$OUTDIR"
readme_header "Compiled anchors, 1xH200" "$OUTDIR/README.md"
run() {
    echo "    python3 benchmarks/peers.py $*" >>"$OUTDIR/README.md"
    python3 benchmarks/peers.py "$@" 2>&1 | grep -v -i warn | tee -a "$OUTDIR/anchors.log"
}
for shape in ${SHAPES:-1.1b 8b}; do
    if [[ -n ${PROBE:-} ]]; then
        run --device cuda --shape "$shape" --systems "${SYSTEMS:-fsdp2_compile,deepcompile}" --modes lora \
            --ac nonreentrant --steps "${STEPS:-5}" --warmup 3 --rounds 1 --timeout-s 400 --out "$OUTDIR/probe-$shape"
    else
        run --paired --device cuda --shape "$shape" --systems "${SYSTEMS:-fsdp2,fsdp2_compile,fork}" --aa fork \
            --modes lora --ac nonreentrant --block "${BLOCK:-1}" --warmup 3 --timeout-s 400 --steps "${STEPS:-40}" \
            --rounds "${ROUNDS:-1}" --out "$OUTDIR/$shape"
        rm -f "$OUTDIR/$shape/paired.png"
    fi
done
echo >>"$OUTDIR/README.md"
echo "Wall time $((SECONDS - START)) s." >>"$OUTDIR/README.md"
cat "$OUTDIR/README.md"
