#!/usr/bin/env bash
# The headline numbers (docs/benchmarks.md "Headline"): per shape (Qwen3-4B, Qwen3.5-2B; random bf16
# weights, batch 1, 256 new tokens) jaxspec plain and speculative (replay alpha 0.8, k 7) tok/s,
# HF eager and static cache + torch.compile tok/s in the same run, and the decode step's wall vs
# GPU-busy vs bytes-floor time; then report.py writes OUTDIR/headline.json.
#
# usage: benchmarks/headline.sh OUTDIR [TOTAL_SECONDS=560] [PARTS=profile,e2e,peers,startup]
set -u
OUT=${1:?usage: benchmarks/headline.sh OUTDIR [TOTAL_SECONDS] [PARTS]}
TOTAL=${2:-560}
PARTS=${3:-profile,e2e,peers,startup}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export JAXSPEC_CACHE_DIR=${JAXSPEC_CACHE_DIR:-/tmp/jaxspec-bench-xla}
PY=${PYTHON:-python3}
START=$(date +%s)
left() { echo $(( TOTAL - ($(date +%s) - START) - 15 )); }
has() { [[ ",$PARTS," == *",$1,"* ]]; }

# step NAME SECONDS CMD...: CMD gets --budget-s (soft) and a hard limit, both clipped to the time left.
step() {
  local name=$1 budget=$2
  shift 2
  local remain
  remain=$(left)
  (( remain < 40 )) && { echo "=== $name: skipped (no time left)"; return; }
  (( budget > remain - 10 )) && budget=$(( remain - 10 ))
  echo "=== $name: budget ${budget}s ($(left)s left)"
  timeout -k 5 $(( budget + 10 )) "$@" --budget-s "$budget" > "$OUT/$name.log" 2>&1
  echo "    exit $? after $(( $(date +%s) - START ))s"
  tail -n 25 "$OUT/$name.log"
}

if has profile; then
  # Seconds per shape: on a cold compilation cache Qwen3-4B's first row alone took 140 s on an H100
  # (2026-12-08), Qwen3.5-2B's four rows about 60 s.
  declare -A PROFILE_S=([qwen3-4b]=200 [qwen3.5-2b]=110)
  for shape in qwen3-4b qwen3.5-2b; do
    step "profile_step_$shape" "${PROFILE_S[$shape]}" "$PY" benchmarks/profile_step.py --shapes "$shape" --ks 7 --repeats 5 \
      --traced 5 --top 6 --rows 'engine round, greedy|x4 rounds|verify round' --out "$OUT/profile_step_$shape.json"
  done
fi
has e2e && step e2e 200 "$PY" benchmarks/e2e.py --shapes qwen3-4b,qwen3.5-2b --methods replay --alphas 0.8 --ks 7 \
  --new-tokens 256 --repeats 3 --out "$OUT/e2e.json"
has peers && step peers 200 "$PY" benchmarks/peers.py --shapes qwen3-4b,qwen3.5-2b --modes eager,static_compile \
  --new-tokens 256 --repeats 3 --compile-min-s 40 --out "$OUT/peers.json"
has startup && step startup 150 "$PY" benchmarks/startup.py --shapes qwen3-4b,qwen3.5-2b --runs cold,warm \
  --out "$OUT/startup.json"
"$PY" benchmarks/report.py "$OUT" > "$OUT/report.log" 2>&1
tail -n 40 "$OUT/report.log"
