#!/bin/bash
# `pip install client/python`, offline, into a venv that sees Debian's
# python3-grpcio/-protobuf/-numpy (--system-site-packages), then a client
# example with the venv's python and no PYTHONPATH against the build tree's
# opjitd (ctest label "deploy").
#   1. pip builds the wheel with the in-tree backend (requires = []): nothing is
#      downloaded; this runs in a network namespace without network where
#      `unshare -n` is allowed, so a download attempt would fail the test;
#   2. the installed package has the generated opjit.v1 stubs and is the one
#      imported; the build tree's PYTHONPATH=build/python is not involved (it
#      says whether pip built opjit._fastcall, which is optional);
#   3. client/python/examples/leaky_relu.py runs and asserts its numbers.
# usage: pip_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$2" && pwd)
PY=${OPJIT_PYTHON:-/usr/bin/python3}

if ! "$PY" -c "import venv, ensurepip" 2>/dev/null; then
  echo "SKIP: $PY has no venv/ensurepip (Debian: python3-venv)"
  exit 77
fi
[ -x "$BUILD/bin/opjitd" ] || { echo "FAIL: build bin/opjitd first"; exit 1; }

WORK=$(mktemp -d /tmp/opjit-pip.XXXXXX)
. "$(dirname "$0")/lib.sh"

"$PY" -m venv --system-site-packages "$WORK/venv"
# No network: where a network namespace can be made, pip runs in one.
offline=()
if unshare -n -r true 2>/dev/null; then
  offline=(unshare -n -r)
  echo "pip runs without network (unshare -n)"
fi
t0=$(date +%s.%N)
env -u PYTHONPATH PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
  "${offline[@]}" "$WORK/venv/bin/pip" install "$SRC/client/python" >"$WORK/pip.log" 2>&1 ||
  { cat "$WORK/pip.log"; fail "pip install"; }
t1=$(date +%s.%N)
printf 'pip install client/python: %.1f s\n' "$(echo "$t1 - $t0" | bc)"
grep -E "^Successfully" "$WORK/pip.log"
! grep -qiE "Downloading|Collecting (setuptools|wheel|grpcio|protobuf|numpy)" "$WORK/pip.log" ||
  { cat "$WORK/pip.log"; fail "pip fetched something"; }

cd "$WORK"  # nothing named opjit on sys.path but the venv's
env -u PYTHONPATH "$WORK/venv/bin/python" - "$WORK/venv" <<'PYEOF' || fail "installed package"
import sys
import opjit
import opjit.v1.exec_pb2_grpc, opjit.v1.registry_pb2
assert opjit.__file__.startswith(sys.argv[1]), opjit.__file__
from importlib import metadata
print("opjit", metadata.version("opjit"), "from", opjit.__file__)
assert set(metadata.requires("opjit")) >= {"numpy"}, metadata.requires("opjit")
# The compiled fast-channel call is optional: built where pip found a C++
# compiler and Python's headers, else the pure-Python channel.
from opjit import _fast
print("fast channel calls:", "opjit._fastcall" if _fast.EXTENSION else "pure Python")
PYEOF

STATE="$WORK/state"
mkdir -p "$STATE"
SOCK="unix:$STATE/opjitd.sock"
"$BUILD/bin/opjitd" --state-dir "$STATE" --listen "$SOCK" >"$WORK/opjitd.log" 2>&1 &
DAEMON_PID=$!
for _ in $(seq 300); do
  [ -S "$STATE/opjitd.sock" ] && "$BUILD/bin/opjit" --server "$SOCK" info >/dev/null 2>&1 && break
  kill -0 "$DAEMON_PID" 2>/dev/null || fail "opjitd exited"
  sleep 0.1
done

env -u PYTHONPATH OPJIT_SERVER="$SOCK" "$WORK/venv/bin/python" \
  "$SRC/client/python/examples/leaky_relu.py" >"$WORK/example.log" 2>&1 ||
  { cat "$WORK/example.log"; fail "leaky_relu.py"; }
cat "$WORK/example.log"
grep -q "registered leaky_relu" "$WORK/example.log" || fail "the example did not register"

kill -TERM "$DAEMON_PID"
wait "$DAEMON_PID" || fail "opjitd exited with $? on SIGTERM"
DAEMON_PID=""
echo "PASS"
