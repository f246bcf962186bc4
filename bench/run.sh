#!/usr/bin/env bash
# Runs opjit's benchmarks and writes bench/results.md (medians and ratios,
# every pair measured side by side in the same run).
#   bash bench/run.sh            (or: make bench)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
OUT=bench/out
mkdir -p "$OUT"
"$BUILD/bin/compile_bench" --benchmark_format=console \
  --benchmark_out="$OUT/compile.json" --benchmark_out_format=json
/usr/bin/python3 bench/report.py "$OUT/compile.json" > bench/results.md
cat bench/results.md
