#!/usr/bin/env bash
# Versions of the fork side by side on the device machine: one peer configuration (benchmarks/peers.py,
# system "fork"; default the 1.1B shape, LoRA, non-reentrant) for each version in turn, ROUNDS times,
# each run in fresh processes, the order reversed every other round. Needs the carried wheels (.whl).
#   bash benchmarks/run_fork_ab_gpu.sh NAME=DIR [NAME=DIR ...]
# DIR holds a zero3_ac package (carried, e.g. `git archive REV zero3_ac | tar -x -C .cache/fork-REV`;
# "." is this checkout). SHAPE, MODE, AC, ROUNDS (default 3) and OUTDIR (default $OUT) are settings.
# Prints, per version, the step time of each round and their median (summary.txt).
set -uo pipefail
OUTDIR=${OUTDIR:-$OUT}
source benchmarks/gpu_site.sh
variants=("$@")
for round in $(seq 1 "${ROUNDS:-3}"); do
    order=("${variants[@]}")
    if (( round % 2 == 0 )); then
        order=(); for (( i=${#variants[@]}-1; i>=0; i-- )); do order+=("${variants[i]}"); done
    fi
    for variant in "${order[@]}"; do
        name=${variant%%=*}
        dir=$(cd "${variant#*=}" && pwd)
        PYTHONPATH=/tmp/site:$dir:$PWD python3 benchmarks/peers.py --device cuda --systems fork \
            --shape "${SHAPE:-1.1b}" --modes "${MODE:-lora}" --ac "${AC:-nonreentrant}" --rounds 1 \
            --warmup 2 --steps 4 --timeout-s 150 --out "$OUTDIR/$name/round$round" 2>&1 | grep -v -i warn | tail -2
    done
done
python3 - "$OUTDIR" "${ROUNDS:-3}" "${variants[@]}" <<'PY' | tee "$OUTDIR/summary.txt"
import json, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for variant in sys.argv[3:]:
    name = variant.split("=", 1)[0]
    # Only this call's rounds: an earlier call into the same OUTDIR may have left more.
    paths = [os.path.join(out, name, f"round{r}", "results.json") for r in range(1, rounds + 1)]
    runs = [json.load(open(path))["runs"][0] for path in paths if os.path.exists(path)]
    steps = [run["step_s_median"] for run in runs if not run["error"]]
    host = [run["host_us_per_module_call"] for run in runs if not run["error"]]
    print(f"{name}: step s median {statistics.median(steps):.4f} rounds {[round(s, 4) for s in steps]} "
          f"host us/module call {statistics.median(host):.0f}" if steps else f"{name}: no run without error")
PY
