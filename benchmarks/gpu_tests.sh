#!/usr/bin/env bash
# Run the GPU-only test classes (skipped on CPU) on a GPU machine and record how many ran and passed.
#
# usage: benchmarks/gpu_tests.sh OUTDIR [TIMEOUT_SECONDS=300] [PYTEST_ARGS...]
# Writes OUTDIR/gpu_tests.log (pytest -rA output) and OUTDIR/gpu_tests.xml (JUnit). The selection is
# every test class or test whose name says GPU, plus any extra pytest arguments given.
set -u
OUT=${1:?usage: benchmarks/gpu_tests.sh OUTDIR [TIMEOUT_SECONDS] [PYTEST_ARGS...]}
LIMIT=${2:-300}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
timeout -k 5 "$LIMIT" ${PYTHON:-python3} -m pytest tests -q -rfEs -p no:cacheprovider -k "GPU or gpu" \
  --junitxml="$OUT/gpu_tests.xml" "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
echo "pytest exit: ${PIPESTATUS[0]}"
