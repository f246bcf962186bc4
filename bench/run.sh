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
# bench/out/ (JSON and markdown), so `python3 bench/report.py` can be re-run
# on them.
#
# bench/report.py's SECTIONS lists every section of results.md, in order, and
# the bench and files each comes from (`python3 bench/report.py --list`). A
# bench that skips its section on purpose (root only, say) writes
# "skipped: <reason>" as its markdown, and the report says so. When a
# section's output is missing or empty, or a file here is no section's,
# report.py still writes results.md but exits 1 naming the section and its
# bench, and so does this script (and `make bench`).
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
# The fast path: JSON, and the markdown table that is the report's Fast path
# section (with py_bench's Python rows).
run fast "$BUILD/bin/fast_bench" "$OUT/fast.json" >"$OUT/fast.md"
run py "$PY" bench/py_bench.py "$OUT/py.json" --build "$BUILD"
run plots "$PY" bench/plots.py "$PLOTS" "$OUT/py.json" "$OUT/call.json" >"$OUT/plots.md"
# Inline tensors over TCP against a gRPC echo of the same bytes (remote clients).
run inline "$PY" bench/inline_bench.py "$OUT/inline.json" --build "$BUILD" --md "$OUT/inline.md"
# What identity costs per call (principals, tokens, TLS) against the open default.
run auth "$BUILD/bin/auth_bench" "$OUT/auth.json" >"$OUT/auth.md"
# What zero-filling outputs costs, against a daemon that leaves them as found.
run zero "$BUILD/bin/zero_bench" "$OUT/zero.json" >"$OUT/zero.md"
# What guard pages around workspaces cost per call, against the heap
# workspace of before (in this process; no daemon).
run guard "$BUILD/bin/guard_bench" "$OUT/guard.json" >"$OUT/guard.md"
# What the executors' namespaces cost (executor start, tiny calls), against a
# daemon without them (needs root; otherwise it measures nothing and writes a
# "skipped: needs root" section).
run isolation "$BUILD/bin/isolation_bench" "$OUT/isolation.json" >"$OUT/isolation.md"
# What a non-root daemon's user and PID namespaces (and subordinate ids) cost
# against a root daemon's (needs root: it starts daemons as nobody; otherwise
# a "skipped" section).
run userns "$PY" bench/userns_bench.py "$OUT/userns.json" --build "$BUILD" --md "$OUT/userns.md"
# What Verify and Benchmark cost beyond the calls they make (issue 31).
# Many tenants on one daemon (issue 30 goal 9): 10,000 ops in 1,000
# namespaces, memory, restart, and 64 clients' p99 against one client's.
run tenants "$PY" bench/tenants_bench.py "$OUT/tenants.json" --build "$BUILD" --md "$OUT/tenants.md"
run evaluate "$PY" bench/evaluate_bench.py "$OUT/evaluate.json" --build "$BUILD" --md "$OUT/evaluate.md"

"$PY" bench/report.py --out "$OUT" --seconds $(($(date +%s) - start)) >bench/results.md
report_rc=$?
cat bench/results.md
if [ "$report_rc" -ne 0 ]; then
  echo "bench/run.sh: bench/results.md is incomplete (report.py exited $report_rc):" \
    "see the missing sections above" >&2
  exit "$report_rc"
fi
