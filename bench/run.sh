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
# Call overhead and data path: starts its own opjitd from "$BUILD/bin".
# A failure is recorded in its JSON, which the report shows.
rm -f "$OUT/call.json"  # never report a previous run's numbers
"$BUILD/bin/call_bench" "$OUT/call.json" || echo "call_bench exited $?" >&2
/usr/bin/python3 bench/report.py "$OUT/compile.json" "$OUT/call.json" > bench/results.md
cat bench/results.md
