# Shared by the deploy tests: sourced after WORK (a temp dir) is set.
# cleanup stops the daemon started as $DAEMON_PID and removes $WORK;
# fail prints the reason and the daemon's log tail, then exits 1.
DAEMON_PID=""
cleanup() {
  if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill -TERM "$DAEMON_PID" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$DAEMON_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; [ -f "$WORK/opjitd.log" ] && tail -40 "$WORK/opjitd.log"; exit 1; }
