#!/bin/bash
# What a CI job runs to check a kernel: a throwaway opjitd (its own state dir
# and socket, nothing else touched), the reference and the candidate
# registered from their specs, `opjit verify` (report as JSON, a summary on
# stdout) and `opjit bench` against the reference.
#
#   deploy/ci/verify-kernels.sh CANDIDATE.json REFERENCE.json [opjit verify flags...]
#
# Environment: OPJITD, OPJIT (default: from PATH), REPORT (the JSON report;
# default verify-report.json), BENCH (0 skips the benchmark), BENCH_FLAGS.
# Exit status: 0 every case passed, 3 a case failed (the summary says which
# and how to reproduce it), 1 anything else (the daemon's log is printed).
set -uo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 CANDIDATE.json REFERENCE.json [opjit verify flags...]" >&2
  exit 2
fi
cand_spec=$1 ref_spec=$2
shift 2
OPJITD=${OPJITD:-opjitd}
OPJIT=${OPJIT:-opjit}
REPORT=${REPORT:-verify-report.json}
PY=/usr/bin/python3

dir=$(mktemp -d /tmp/opjit-ci-XXXXXX)
"$OPJITD" --state-dir "$dir/state" --listen "unix:$dir/s.sock" >"$dir/opjitd.log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$dir"' EXIT
export OPJIT_SERVER="unix:$dir/s.sock"

fail() {
  echo "verify-kernels: $1" >&2
  tail -n 40 "$dir/opjitd.log" >&2
  exit 1
}
for _ in $(seq 300); do
  "$OPJIT" health >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || fail "opjitd exited"
  sleep 0.1
done
"$OPJIT" health >/dev/null 2>&1 || fail "opjitd did not answer within 30 s"

name() { "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["name"])' "$1"; }
ref=$(name "$ref_spec") || fail "cannot read $ref_spec"
cand=$(name "$cand_spec") || fail "cannot read $cand_spec"
"$OPJIT" register "$ref_spec" >/dev/null || fail "registering $ref_spec failed"
"$OPJIT" register "$cand_spec" >/dev/null || fail "registering $cand_spec failed"

"$OPJIT" verify "$cand" --against "$ref" --json "$@" >"$REPORT"
rc=$?
[ "$rc" -eq 0 ] || [ "$rc" -eq 3 ] || fail "opjit verify failed (exit $rc)"
"$PY" - "$REPORT" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
cases = r.get("cases", [])
bad = [c for c in cases if not c.get("passed") and not c.get("skipped")]
print("verify: %s: %d case(s), %d failed, %s; seed %s" % (
    "PASS" if r.get("passed") else "FAIL", len(cases), len(bad),
    "deterministic" if r.get("deterministic") else "NOT deterministic", r.get("seed")))
for c in bad[:10]:
    print("  case %s %s %s: %s" % (c.get("index", 0), c.get("kind"), c.get("shapes"), c.get("message")))
print("reproduce: " + r.get("reproduce", ""))
PYEOF
if [ "$rc" -eq 0 ] && [ "${BENCH:-1}" != 0 ]; then
  # shellcheck disable=SC2086
  "$OPJIT" bench "$cand" --against "$ref" ${BENCH_FLAGS:-} || fail "opjit bench failed"
fi
exit "$rc"
