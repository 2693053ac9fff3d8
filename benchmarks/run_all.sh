#!/usr/bin/env bash
# Every benchmark the H200 run needs, in one call, inside a total time limit:
#   step_times -> e2e -> kernels -> peers -> profile_step -> demo_drafters -> startup -> plot -> report
# Each script gets a soft budget (--budget-s: it skips what would start too late and records it)
# and a hard limit (timeout) clipped to what is left of the total; results are written after every
# item, so a script that is stopped keeps what it measured. A failing script is recorded in
# OUTDIR/run_all_status.tsv and the next one runs.
#
# usage: benchmarks/run_all.sh OUTDIR [TOTAL_SECONDS=540]
# env:   PYTHON (default python3); JAXSPEC_CACHE_DIR (default /tmp/jaxspec-bench-xla, shared by
#        step_times and e2e so e2e loads what step_times compiled); BENCH_QUICK=1 (two shapes, batch 1
#        only: a shorter check); BENCH_SMOKE=1 (every script's --smoke mode: a CPU check of this file)
# fla:   wheels in .whl/ (carry it: it is git-ignored) are installed to /tmp for kernels.py only.
set -u
OUT=${1:?usage: benchmarks/run_all.sh OUTDIR [TOTAL_SECONDS]}
TOTAL=${2:-540}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export JAXSPEC_CACHE_DIR=${JAXSPEC_CACHE_DIR:-/tmp/jaxspec-bench-xla}
PY=${PYTHON:-python3}
START=$(date +%s)
STATUS="$OUT/run_all_status.tsv"
: > "$STATUS"

left() { echo $(( TOTAL - ($(date +%s) - START) )); }

# run NAME BUDGET CMD...: CMD gets --budget-s; hard limit = budget + 25 s; both clipped to the time left.
run() {
  local name=$1 budget=$2
  shift 2
  local remain=$(( $(left) - 20 ))
  if (( remain < 30 )); then
    printf '%s\tskipped\t0\tno time left\n' "$name" >> "$STATUS"
    echo "=== $name: skipped (no time left)"
    return
  fi
  (( budget > remain - 25 )) && budget=$(( remain - 25 ))
  local hard=$(( budget + 25 ))
  echo "=== $name: budget ${budget}s, hard limit ${hard}s, $(left)s of ${TOTAL}s left"
  local t0
  t0=$(date +%s)
  timeout -k 5 "$hard" "$@" --budget-s "$budget" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  local note=""
  (( rc == 124 || rc == 137 )) && note="hard time limit: partial results"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$note" >> "$STATUS"
}

echo "=== environment"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"

FLA_PATH=""
KERNEL_ARGS=()
if ls .whl/fla_core-*.whl > /dev/null 2>&1; then
  if "$PY" -m pip install --quiet --upgrade --no-deps --no-index --target /tmp/jaxspec-fla .whl/*.whl > "$OUT/fla_install.log" 2>&1; then
    FLA_PATH=/tmp/jaxspec-fla
  fi
fi
echo "fla for kernels.py: ${FLA_PATH:-not installed (kernels.py records why it skips fla)}"

if [[ "${BENCH_SMOKE:-0}" == 1 ]]; then  # the scripts' CPU smoke modes: checks this file itself
  STEP_ARGS=(--smoke) E2E_ARGS=(--smoke) PEER_ARGS=(--smoke) KERNEL_ARGS=(--smoke) PROFILE_ARGS=(--smoke)
  DEMO_ARGS=(--smoke) STARTUP_ARGS=(--smoke)
elif [[ "${BENCH_QUICK:-0}" == 1 ]]; then
  STEP_ARGS=(--shapes qwen3.5-2b,qwen3-4b --batches 1 --ks 1,3,7,15 --eager first)
  E2E_ARGS=(--shapes qwen3.5-2b --repeats 3)
  PEER_ARGS=(--shapes qwen3.5-2b --modes eager,assisted)
  PROFILE_ARGS=(--shapes qwen3.5-2b) DEMO_ARGS=(--num-prompts 8) STARTUP_ARGS=(--shapes qwen3.5-2b)
else
  STEP_ARGS=(--shapes qwen3-4b,qwen3.5-2b,qwen3.5-27b,qwen3.5-35b-a3b
             --layers qwen3.5-27b=16,qwen3.5-35b-a3b=8 --batches 1,8,4 --ks 1,3,7,15 --eager first)
  E2E_ARGS=(--shapes qwen3.5-2b,qwen3-4b --repeats 3)
  PEER_ARGS=(--shapes qwen3.5-2b,qwen3-4b)
  PROFILE_ARGS=(--shapes qwen3-4b) DEMO_ARGS=() STARTUP_ARGS=()
fi

run step_times 200 "$PY" benchmarks/step_times.py --out "$OUT/step_times.json" ${STEP_ARGS[@]+"${STEP_ARGS[@]}"}
run e2e 110 "$PY" benchmarks/e2e.py --out "$OUT/e2e.json" ${E2E_ARGS[@]+"${E2E_ARGS[@]}"}
run kernels 60 env PYTHONPATH="$FLA_PATH${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false \
  "$PY" benchmarks/kernels.py --out "$OUT/kernels.json" ${KERNEL_ARGS[@]+"${KERNEL_ARGS[@]}"}
run peers 110 "$PY" benchmarks/peers.py --out "$OUT/peers.json" ${PEER_ARGS[@]+"${PEER_ARGS[@]}"}
run profile_step 60 "$PY" benchmarks/profile_step.py --out "$OUT/profile_step.json" \
  --trace-dir "$OUT/traces" ${PROFILE_ARGS[@]+"${PROFILE_ARGS[@]}"}
run demo_drafters 60 "$PY" benchmarks/demo_drafters.py --out "$OUT/demo_drafters.json" \
  ${DEMO_ARGS[@]+"${DEMO_ARGS[@]}"}
run startup 150 "$PY" benchmarks/startup.py --out "$OUT/startup.json" ${STARTUP_ARGS[@]+"${STARTUP_ARGS[@]}"}

if [[ -f "$OUT/step_times.json" ]]; then
  "$PY" benchmarks/plot.py --input "$OUT/step_times.json" --out "$OUT/verify_curve.png" > "$OUT/plot.log" 2>&1
  printf 'plot\t%s\t0\t\n' "$?" >> "$STATUS"
fi
echo "=== summary ($(( $(date +%s) - START ))s in total)"
"$PY" benchmarks/report.py "$OUT"
