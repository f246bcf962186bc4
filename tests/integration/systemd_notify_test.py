#!/usr/bin/env python3
"""opjitd speaks systemd's notify protocol (Type=notify, WatchdogSec=).

    /usr/bin/python3 tests/integration/systemd_notify_test.py BUILD_DIR

The test plays systemd: it binds a unix datagram socket, starts the real
opjitd with NOTIFY_SOCKET, WATCHDOG_USEC=2000000 and WATCHDOG_PID=<its pid>,
and reads what arrives (with the sender's credentials, as systemd does for
NotifyAccess=main). It checks that
  - READY=1 arrives once, from the daemon's own pid, and at that moment the
    daemon already answers grpc.health.v1 Check with SERVING;
  - WATCHDOG=1 pings arrive every ~1 s (half of WATCHDOG_USEC);
  - when a health probe fails (its compile worker disappears) the pings stop,
    STATUS= says why, and they resume once it is back;
  - SIGTERM gives STOPPING=1 and a clean exit.
The daemon is a hard link of <build>/bin/opjitd in a temp dir with its
helpers linked beside it, so one helper can be taken away without touching
the build tree.
Exits 0 when everything holds, 1 with the reason otherwise.
"""

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

import grpc

WATCHDOG_USEC = 2000000
HEALTH_INTERVAL_MS = 200


class Notifications:
    """The datagrams opjitd sends, with arrival time and sender pid."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.seen = []  # (time, pid, {key: value})

    def next(self, timeout):
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except socket.timeout:
            return None
        pid = None
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("iII", payload[:12])[0]
        fields = dict(line.split("=", 1) for line in data.decode().split("\n") if "=" in line)
        msg = (time.monotonic(), pid, fields)
        self.seen.append(msg)
        return msg

    def wait_for(self, key, value, timeout, on_other=None):
        deadline = time.monotonic() + timeout
        while True:
            msg = self.next(deadline - time.monotonic())
            if msg is None:
                return None
            if msg[2].get(key) == value:
                return msg
            if on_other:
                on_other(msg)


def health_serving(address):
    """grpc.health.v1.Health/Check for the whole server: True when SERVING."""
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
        reply = check(b"", timeout=5)
    return reply == b"\x08\x01"  # status: SERVING (1)


def fail(why, daemon_log=None):
    print("FAIL: " + why)
    if daemon_log and os.path.exists(daemon_log):
        with open(daemon_log, errors="replace") as f:
            print(f.read()[-3000:])
    sys.exit(1)


def main():
    build = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build")
    bindir = os.path.join(build, "bin")
    with tempfile.TemporaryDirectory(prefix="opjit-notify-") as tmp:
        mybin = os.path.join(tmp, "bin")
        os.mkdir(mybin)
        # A hard link (a copy across file systems), not a symlink: /proc/self/exe,
        # and so the helpers' place, must be mybin.
        try:
            os.link(os.path.join(bindir, "opjitd"), os.path.join(mybin, "opjitd"))
        except OSError:
            shutil.copy2(os.path.join(bindir, "opjitd"), os.path.join(mybin, "opjitd"))
        for helper in ("opjit-compile-worker", "opjit-exec-worker", "opjit-gpu-sandbox"):
            os.symlink(os.path.join(bindir, helper), os.path.join(mybin, helper))
        worker = os.path.join(mybin, "opjit-compile-worker")
        state = os.path.join(tmp, "state")
        os.mkdir(state)
        config = os.path.join(tmp, "opjitd.toml")
        with open(config, "w") as f:
            f.write("[health]\ninterval_ms = %d\n" % HEALTH_INTERVAL_MS)
        address = "unix:" + os.path.join(state, "opjitd.sock")
        notify = Notifications(os.path.join(tmp, "notify.sock"))
        log_path = os.path.join(tmp, "opjitd.log")

        env = dict(os.environ, NOTIFY_SOCKET=os.path.join(tmp, "notify.sock"),
                   WATCHDOG_USEC=str(WATCHDOG_USEC))
        env.pop("WATCHDOG_PID", None)
        # WATCHDOG_PID must be the daemon's pid: the shell's, which exec keeps.
        cmd = ['WATCHDOG_PID=$$ exec "$0" "$@"', os.path.join(mybin, "opjitd"),
               "--config", config, "--state-dir", state, "--listen", address]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(["/bin/sh", "-c"] + cmd, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            run(proc, notify, address, worker, bindir, log_path)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run(proc, notify, address, worker, bindir, log_path):
    t0 = time.monotonic()
    ready = notify.wait_for("READY", "1", timeout=60)
    if ready is None:
        fail("no READY=1 within 60 s", log_path)
    # At READY=1 the daemon must already serve and say SERVING.
    if not health_serving(address):
        fail("READY=1 sent but grpc.health does not say SERVING", log_path)
    if ready[1] != proc.pid:
        fail("READY=1 came from pid %s, not the daemon's %d" % (ready[1], proc.pid))
    print("READY=1 after %.2f s from pid %d; health: SERVING" % (ready[0] - t0, ready[1]))
    statuses = [m[2]["STATUS"] for m in notify.seen if "STATUS" in m[2]]
    if "serving" not in statuses:
        fail("no STATUS=serving before READY=1 (got %s)" % statuses)

    # Watchdog pings at WATCHDOG_USEC / 2.
    pings = []
    deadline = time.monotonic() + 5.5
    while time.monotonic() < deadline:
        msg = notify.next(deadline - time.monotonic())
        if msg and msg[2].get("WATCHDOG") == "1":
            if msg[1] != proc.pid:
                fail("WATCHDOG=1 from pid %s, not the daemon's" % msg[1])
            pings.append(msg[0])
        if msg and msg[2].get("READY"):
            fail("READY=1 sent twice")
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    print("watchdog pings in 5.5 s: %d, gaps %s s" % (len(pings), ["%.2f" % g for g in gaps]))
    if len(pings) < 4 or any(not 0.7 <= g <= 1.4 for g in gaps):
        fail("expected a WATCHDOG=1 about every 1.0 s")

    # Unhealthy: the compile worker disappears; pings must stop.
    os.unlink(worker)
    deadline = time.monotonic() + 10
    not_serving_at = None
    while time.monotonic() < deadline and not_serving_at is None:
        msg = notify.next(deadline - time.monotonic())
        if msg and msg[2].get("STATUS", "").startswith("not serving"):
            not_serving_at = msg[0]
            print("STATUS=%s" % msg[2]["STATUS"])
    if not_serving_at is None:
        fail("no STATUS=not serving within 10 s of removing the compile worker", log_path)
    late = []
    quiet_until = time.monotonic() + 3.0
    while time.monotonic() < quiet_until:
        msg = notify.next(quiet_until - time.monotonic())
        # One ping may already be on its way when the status flips.
        if msg and msg[2].get("WATCHDOG") == "1" and msg[0] - not_serving_at > 1.2:
            late.append(msg[0] - not_serving_at)
    if late:
        fail("WATCHDOG=1 kept coming while not serving (%s s after)" % late)
    print("no watchdog pings for 3 s while not serving")

    # Healthy again: pings resume.
    os.symlink(os.path.join(bindir, "opjit-compile-worker"), worker)
    t_fix = time.monotonic()
    back = notify.wait_for("WATCHDOG", "1", timeout=10)
    if back is None:
        fail("no WATCHDOG=1 within 10 s of the worker coming back", log_path)
    print("pings resumed %.2f s after the worker came back" % (back[0] - t_fix))

    proc.send_signal(signal.SIGTERM)
    stopping = notify.wait_for("STOPPING", "1", timeout=20)
    if stopping is None:
        fail("no STOPPING=1 after SIGTERM", log_path)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        fail("opjitd did not exit within 30 s of SIGTERM", log_path)
    if code != 0:
        fail("opjitd exited with %d" % code, log_path)
    print("STOPPING=1, exit 0")
    print("PASS")


if __name__ == "__main__":
    main()
