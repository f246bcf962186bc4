#!/usr/bin/env python3
"""Crash consistency: kill -9 opjitd under the soak's load, restart, five times.

    /usr/bin/python3 tests/integration/crash_consistency_test.py BUILD_DIR

Each round runs the soak's client mix (bench/soak.py) against the daemon,
kills it with SIGKILL at a random moment, and restarts it on the same state
directory. Then:
  - every RegisterOp a client saw acknowledged is there, whole: the version
    exists and its source is exactly what was sent;
  - every op in the registry is well-formed (no torn record);
  - the disk cache verifies (opjitd --verify-cache);
  - no /dev/shm object of the killed daemon is left once it restarted;
  - no child of the killed daemon (pool executors, a fast-channel executor,
    compile workers) outlives it by more than a few seconds;
  - the restarted daemon answers calls correctly, on an op registered before
    the crash.
At the end, a restart ends a helper its killed predecessor left behind (one
planted with this state dir's tag and parent pid 1), and not one tagged for
another state dir.
Exits 0 when every round passes, 1 with the reasons otherwise.
"""

import glob
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench"))

ROUNDS = 5
CLIENTS = 4


def count_acks(pattern):
    """Registrations acknowledged so far: whole lines in the clients' files."""
    n = 0
    for path in glob.glob(pattern.replace("%d", "*")):
        with open(path) as f:
            n += sum(1 for line in f if line.endswith("\n"))
    return n


HELPERS = ("opjit-exec-work", "opjit-compile-w", "opjit-gpu-sandb")


def ended(pid):
    """Gone, or a zombie its new parent has not reaped: it runs no more."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2] in "ZX"


def wait_ended(pids, seconds):
    """Polls until every pid ended or `seconds` passed; returns (the pids
    still running, the seconds it took)."""
    start = time.monotonic()
    alive = set(pids)
    while alive and time.monotonic() - start < seconds:
        alive = {p for p in alive if not ended(p)}
        if alive:
            time.sleep(0.01)
    return alive, time.monotonic() - start


def plant_leftover(tag, hold):
    """A stand-in for a helper a killed daemon left: a shell whose command
    line is an executor's with "--instance <tag>", re-parented away from this
    process (started in the background by a bash that then exits), blocked
    reading `hold`. Returns its pid. No os.fork() here: this process runs
    gRPC threads, and gRPC's fork handler waits for them to idle, which under
    a loaded sanitizer build it did forever."""
    script = ('(exec -a /leftover/opjit-exec-worker /bin/sh -c "read x" --instance "$1") '
              '<&%d >/dev/null 2>&1 & echo $!' % hold)
    out = subprocess.run(["/bin/bash", "-c", script, "plant", tag], pass_fds=(hold,),
                         stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, check=True,
                         timeout=30)
    return int(out.stdout.decode().strip())


def restart_sweep(build, state, check):
    """A restart on `state` ends the helper its predecessor left, and never
    one of another state dir."""
    import soak
    tag = soak.instance_prefix(state).split(".")[1]
    other = hashlib.sha256((state + "-elsewhere").encode()).hexdigest()[:12]
    hold_r, hold_w = os.pipe()
    mine = plant_leftover(tag, hold_r)
    theirs = plant_leftover(other, hold_r)
    os.close(hold_r)
    try:
        # Both run as the fake helper before the daemon starts.
        give_up = time.monotonic() + 10
        def planted(pid):
            try:
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    return b"--instance" in f.read()
            except OSError:
                return False
        while not (planted(mine) and planted(theirs)) and time.monotonic() < give_up:
            time.sleep(0.01)
        check(planted(mine) and planted(theirs), "sweep: the planted leftovers did not start")
        daemon = soak.Daemon(build, state).start()
        alive, took = wait_ended([mine], 5)
        check(not alive, "sweep: the restart left its predecessor's helper %d running" % mine)
        check(not ended(theirs), "sweep: the restart killed another state dir's helper")
        with open(os.path.join(state, "opjitd.log"), errors="replace") as f:
            check("ended 1 helper process" in f.read(), "sweep: the restart did not log it")
        daemon.stop()
        print("sweep: the restart ended its predecessor's leftover in %.2f s and left another "
              "state dir's alone" % took, flush=True)
    finally:
        os.close(hold_w)  # what is left reads EOF and exits
        for pid in (mine, theirs):
            if not ended(pid):
                os.kill(pid, signal.SIGKILL)


def main():
    build = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build"))
    sys.path.insert(0, os.path.join(build, "python"))
    import numpy as np
    import opjit
    import soak

    rng = random.Random(int(os.environ.get("OPJIT_CRASH_SEED", "1")))
    work = tempfile.mkdtemp(prefix="opjit-crash-")
    state = os.path.join(work, "state")
    acked = os.path.join(work, "acked%d.jsonl")
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)
            print("  FAIL:", what, flush=True)
        return cond

    daemon = soak.Daemon(build, state).start()
    with opjit.Client(daemon.address, timeout=60) as c:
        soak.register_base_ops(c)
    tag = None
    acks_before = 0
    for rnd in range(1, ROUNDS + 1):
        procs, _ = soak.run_clients(CLIENTS, daemon.address, build, 30, rnd, work, acked=acked,
                                    wait=False)
        # The kill lands at a random moment once the load is real: after the
        # first registration of this round was acknowledged (on a loaded CI
        # machine the client processes can take seconds to start), then
        # 0.5-4 s more.
        give_up = time.monotonic() + 60
        while count_acks(acked) <= acks_before and time.monotonic() < give_up:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.5, 4.0))
        with open(os.path.join(state, "opjitd.log"), errors="replace") as f:
            log = f.read()
        for line in log.splitlines():
            if "region manager for instance" in line:
                tag = line.split("instance ")[1].split(":")[0]
        # Only this daemon's objects count (another opjitd or test may run
        # beside this one); its prefix follows from its state directory, and
        # the daemon's own log must agree, or the check below proves nothing.
        prefix = soak.instance_prefix(state)
        check(tag is not None and prefix == "opjit.%s." % tag,
              "round %d: the log names instance %r, the state dir gives %r" % (rnd, tag, prefix))
        live_shm = soak.shm_objects(prefix)
        # A fast-channel executor for sure (the soak's clients may use
        # one too), then every child the daemon has now.
        fast = opjit.Client(daemon.address, timeout=60, fast="on")
        x = np.linspace(-1, 1, 257, dtype=np.float32)
        fast.op("tanh")(x)
        kids = {pid: comm for pid, comm in soak.children(daemon.pid).items()
                if comm in HELPERS}
        daemon.kill9()
        alive, took = wait_ended(kids, 5)
        check(kids, "round %d: the daemon had no helper children to watch" % rnd)
        check(not alive, "round %d: children of the killed daemon outlived it: %s of %s"
              % (rnd, sorted(kids[p] + " " + str(p) for p in alive), len(kids)))
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
        print("round %d: %d children of the killed daemon (%d executors, %d compile workers) "
              "gone after %.2f s" % (rnd, len(kids), sum(c == HELPERS[0] for c in kids.values()),
                                     sum(c == HELPERS[1] for c in kids.values()), took),
              flush=True)
        fast.close()
        for p in procs:
            p.terminate()
        for p in procs:
            p.join()
        print("round %d: killed opjitd under load (%d of its shm objects were live)"
              % (rnd, len(live_shm)), flush=True)

        # The cache at rest, before anything touches it again.
        v = subprocess.run([os.path.join(build, "bin", "opjitd"), "--verify-cache",
                            "--state-dir", state], capture_output=True, text=True)
        check(v.returncode == 0, "round %d: the disk cache does not verify: %s"
              % (rnd, v.stdout.strip()[-500:]))

        daemon = soak.Daemon(build, state).start()
        left = soak.shm_objects(prefix)
        check(not left, "round %d: shm objects of the killed daemon left: %s" % (rnd, left[:5]))

        with opjit.Client(daemon.address, timeout=60) as c:
            # Every acknowledged registration, whole.
            acks = []
            for path in glob.glob(os.path.join(work, "acked*.jsonl")):
                with open(path) as f:
                    for line in f:
                        if line.endswith("\n"):  # a line cut by terminate() was never acked
                            acks.append(json.loads(line))
            missing = 0
            for a in acks:
                want = soak.KERNEL % {"entry": "K", "body": soak.VARIANTS[a["variant"]]}
                try:
                    rec = c.describe(a["name"], version=a["version"])
                except opjit.NotFound:
                    missing += 1
                    continue
                check(rec.op.implementations[0].source == want,
                      "round %d: %s v%d has a different source than was acknowledged"
                      % (rnd, a["name"], a["version"]))
            check(missing == 0, "round %d: %d of %d acknowledged registrations lost"
                  % (rnd, missing, len(acks)))
            # The load was real: registrations were acknowledged before the kill.
            check(len(acks) > acks_before, "round %d: no registration was acknowledged under load"
                  % rnd)
            acks_before = len(acks)
            # No torn record anywhere.
            sources = {soak.KERNEL % {"entry": "K", "body": b} for b in soak.VARIANTS}
            ops = c.ops(all_versions=True, with_sources=True)
            for rec in ops:
                if rec.op.name.startswith("soak_c"):
                    check(rec.op.implementations and rec.op.implementations[0].source in sources,
                          "round %d: %s v%d is torn" % (rnd, rec.op.name, rec.version))
            # The restarted daemon computes, on an op from before the crash.
            x = np.linspace(-1, 1, 257, dtype=np.float32)
            y = c.op("tanh")(x)
            check(np.allclose(y, np.tanh(x), atol=1e-6), "round %d: tanh is wrong after restart"
                  % rnd)
            print("round %d: restarted; %d acknowledged registrations all present, %d op "
                  "versions well-formed, cache verified" % (rnd, len(acks) - missing, len(ops)),
                  flush=True)

    daemon.stop()
    restart_sweep(build, state, check)
    if failures:
        print("FAILED (state kept in %s):\n  %s" % (work, "\n  ".join(failures)))
        return 1
    subprocess.run(["rm", "-rf", work])
    print("PASSED: %d rounds" % ROUNDS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
