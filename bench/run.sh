#!/usr/bin/env bash
# Runs every opjit benchmark side by side and writes bench/results.md (medians
# and ratios) with its latency plots in bench/plots/. 3–4 minutes here.
#
#   make bench          installs the benchmark extras (deploy/install-deps.sh
#                       --bench: PyTorch, matplotlib), builds, runs this
#   bash bench/run.sh   with an existing build in $BUILD (default build/)
#
# A benchmark that fails does not stop the others: its failure (exit status,
# error text) is what the report shows in its place. Raw results stay in
# bench/out/ (JSON), so `python3 bench/report.py` can be re-run on them.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
OUT=bench/out
PLOTS=bench/plots
PY=/usr/bin/python3  # Debian's interpreter: grpcio, numpy, torch, matplotlib
mkdir -p "$OUT" "$PLOTS"
# Never report a previous run's numbers.
rm -f "$OUT"/*.json "$OUT"/*.failed "$OUT"/*.md "$PLOTS"/*.png
start=$(date +%s)

# run NAME COMMAND...: runs one benchmark; records a non-zero exit.
run() {
  local name=$1
  shift
  echo "== $name: $*" >&2
  "$@"
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "$name exited with status $rc" | tee "$OUT/$name.failed" >&2
  fi
}

# In-process parts (Google Benchmark). Random interleaving alternates the
# repetitions of every benchmark, so each pair sees the same machine state.
run compile "$BUILD/bin/compile_bench" --benchmark_enable_random_interleaving=true \
  --benchmark_out="$OUT/compile.json" --benchmark_out_format=json
run fairness "$BUILD/bin/fairness_bench" "$OUT/fairness.json" 2
run exec "$BUILD/bin/exec_bench" --benchmark_out="$OUT/exec.json" --benchmark_out_format=json
# Whole-system runs: each starts its own opjitd from $BUILD/bin.
run call "$BUILD/bin/call_bench" "$OUT/call.json"
# The fast path: JSON for the report, and its own markdown table.
run fast "$BUILD/bin/fast_bench" "$OUT/fast.json" >"$OUT/fast.md"
run py "$PY" bench/py_bench.py "$OUT/py.json" --build "$BUILD"
run plots "$PY" bench/plots.py "$PLOTS" "$OUT/py.json" "$OUT/call.json" >"$OUT/plots.md"
# Inline tensors over TCP against a gRPC echo of the same bytes (remote clients).
run inline "$PY" bench/inline_bench.py "$OUT/inline.json" --build "$BUILD" --md "$OUT/inline.md"
# What identity costs per call (principals, tokens, TLS) against the open default.
run auth "$BUILD/bin/auth_bench" "$OUT/auth.json" >"$OUT/auth.md"
# What zero-filling outputs costs, against a daemon that leaves them as found.
run zero "$BUILD/bin/zero_bench" "$OUT/zero.json" >"$OUT/zero.md"
# What the executors' namespaces cost (executor start, tiny calls), against a
# daemon without them (needs root; otherwise it says so and measures nothing).
run isolation "$BUILD/bin/isolation_bench" "$OUT/isolation.json" >"$OUT/isolation.md"
# What a non-root daemon's user and PID namespaces (and subordinate ids) cost
# against a root daemon's (needs root: it starts daemons as nobody).
run userns "$PY" bench/userns_bench.py "$OUT/userns.json" --build "$BUILD" --md "$OUT/userns.md"

"$PY" bench/report.py --out "$OUT" --seconds $(($(date +%s) - start)) >bench/results.md
# Its own table, after the report's sections.
cat "$OUT/inline.md" >>bench/results.md 2>/dev/null
if [ -s "$OUT/auth.md" ]; then
  printf '\n## Identity per call (tiny op, gRPC)\n\n' >>bench/results.md
  cat "$OUT/auth.md" >>bench/results.md
fi
if [ -s "$OUT/zero.md" ]; then
  printf '\n## Zero-filled outputs (shm, 1 MiB and 256 MiB)\n\n' >>bench/results.md
  cat "$OUT/zero.md" >>bench/results.md
fi
if [ -s "$OUT/isolation.md" ]; then
  printf '\n## Executor namespaces (executor start and tiny calls)\n\n' >>bench/results.md
  cat "$OUT/isolation.md" >>bench/results.md
fi
if [ -s "$OUT/userns.md" ]; then
  printf '\n## A non-root daemon: user namespaces and subordinate ids\n\n' >>bench/results.md
  cat "$OUT/userns.md" >>bench/results.md
fi
cat bench/results.md
