#!/usr/bin/env python3
"""opjit soak: N clients hammer one real opjitd for T minutes.

    /usr/bin/python3 bench/soak.py [--clients 8] [--minutes 10] [--build build]
                                   [--json out.json] [--seed 0]

Each client process loops over a weighted mix of calls with the real Python
client: register (new versions of its own op, drawn from a few sources so the
compile cache both hits and misses), compile, forward with shared-memory
tensors, forward with inline tensors, forward + backward (tape), gradcheck,
and a call with a wrong dtype (the one error the mix expects).

It reports errors by gRPC code (expected and unexpected), p50/p99 per call
type, the RSS of the daemon and of its worker processes at start, middle and
end, and the daemon's open fds and the /dev/shm objects before and after.
It exits 1 when a call failed unexpectedly, when an RSS grew past its bound
(see RSS_BOUND), or when an fd or a /dev/shm object leaked.

The worker pieces (start_daemon, client_loop, ...) are also used by
tests/integration/crash_consistency_test.py.
"""

import argparse
import collections
import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "kernels", "examples")

# Growth allowed between the middle and the end of the run, per process kind:
# max(RSS_BOUND_MB, RSS_BOUND_FRACTION * middle). By the middle every cache
# (compiled kernels: a few dozen here; executor pools; gRPC buffers; the
# clients' shm pools) is warm, and what may still grow is the registry, by
# a few KB per registered version: ~10 MB over 10 minutes at this mix's rate.
# A leak of even 1 KB per call (~1,000 calls/s here) shows as ~60 MB/min,
# far past the bound.
RSS_BOUND_MB = 64
RSS_BOUND_FRACTION = 0.25

# The daemon's config for a soak: executors idle for 2 s are stopped, so that
# the "after" fd count is taken with the pools drained. Each client registers
# a stream of versions of its op, so the per-op version quota (tested in the
# attack suite) is lifted: the soak looks for leaks, not for that refusal.
SOAK_CONFIG = """
[exec]
worker_idle_ms = 2000
[quota]
versions_per_op = 1000000
"""

# Weights of the call mix.
MIX = [("forward_shm", 30), ("forward_inline", 20), ("backward", 15), ("compile", 10),
       ("register", 6), ("gradcheck", 5), ("bad_dtype", 4)]

# Errors the mix asks for: an int32 input to an op without an int32
# dtype_format is refused before any kernel runs.
EXPECTED = {"bad_dtype": {"INVALID_ARGUMENT"}}

# Sources for register and compile; a client cycles through them, so most
# compiles hit the cache after the first round and some miss.
VARIANTS = [
    "y[i] = x[i] * 2.0f;",
    "y[i] = x[i] + 1.0f;",
    "y[i] = x[i] > 0 ? x[i] : 0.0f;",
    "y[i] = x[i] * x[i] - 1.0f;",
]
KERNEL = """#include <cstdint>
extern "C" int %(entry)s(int nparam, void** params, int* ndims, int64_t** shapes,
                         const char** dtypes, void* stream, void* extra) {
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  int64_t n = 1;
  for (int d = 0; d < ndims[0]; ++d) n *= shapes[0][d];
  for (int64_t i = 0; i < n; ++i) { %(body)s }
  return 0;
}
"""


def op_spec(name, variant):
    return {
        "name": name,
        "inputs": [{"index": 0, "name": "x"}],
        "outputs": [{"index": 0, "name": "y"}],
        "dtype_formats": [{"dtypes": ["float32", "float32"]}],
        "implementations": [{"target": "CPU", "entry": "K",
                             "source": KERNEL % {"entry": "K", "body": VARIANTS[variant]}}],
    }


def digest(spec):
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


# --- the daemon and its processes ---------------------------------------------------------

class Daemon:
    """A real opjitd on a unix socket in `state_dir`."""

    def __init__(self, build, state_dir, config=SOAK_CONFIG):
        self.binary = os.path.join(build, "bin", "opjitd")
        self.state_dir = state_dir
        self.address = "unix:" + os.path.join(state_dir, "opjitd.sock")
        self.config = config
        self.proc = None

    def start(self, timeout=60.0):
        import opjit
        os.makedirs(self.state_dir, exist_ok=True)
        cfg = os.path.join(self.state_dir, "soak.toml")
        with open(cfg, "w") as f:
            f.write(self.config)
        self.log = open(os.path.join(self.state_dir, "opjitd.log"), "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--state-dir", self.state_dir, "--listen", self.address,
             "--config", cfg],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("opjitd exited with %s" % self.proc.returncode)
            try:
                with opjit.Client(self.address, timeout=5) as c:
                    c.info()
                return self
            except opjit.OpjitError:
                time.sleep(0.05)
        raise RuntimeError("opjitd did not answer within %.0f s" % timeout)

    @property
    def pid(self):
        return self.proc.pid

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def kill9(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def children(pid):
    """{pid: comm} of the processes whose parent is `pid`, less the health
    monitor's short-lived "--probe" runs of the worker programs."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                stat = f.read()
        except OSError:
            continue
        close = stat.rfind(")")
        if int(stat[close + 2:].split()[1]) != pid:
            continue
        try:
            with open("/proc/%s/cmdline" % name, "rb") as f:
                if b"--probe" in f.read():
                    continue
        except OSError:
            continue
        out[int(name)] = stat[stat.find("(") + 1:close]
    return out


def rss_mb(pid):
    try:
        with open("/proc/%d/statm" % pid) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def rss_sample(daemon_pid):
    """RSS in MiB of the daemon and of its workers, summed per kind."""
    s = {"daemon": rss_mb(daemon_pid), "exec_workers": 0.0, "compile_workers": 0.0,
         "exec_worker_count": 0, "compile_worker_count": 0}
    for pid, comm in children(daemon_pid).items():
        kind = ("exec" if comm.startswith("opjit-exec") else
                "compile" if comm.startswith("opjit-compile") else None)
        if kind:
            s[kind + "_workers"] += rss_mb(pid)
            s[kind + "_worker_count"] += 1
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in s.items()}


def fd_count(pid):
    """The daemon's open fds, less one socket per compile worker (the pool
    grows to its size on demand and recycles workers; executor pools are
    drained when this is taken)."""
    workers = sum(1 for c in children(pid).values() if c.startswith("opjit-compile"))
    return len(os.listdir("/proc/%d/fd" % pid)) - workers


def instance_prefix(state_dir):
    """The /dev/shm name prefix of the daemon on `state_dir`: its objects are
    opjit.<tag>.<hex>, where tag is the first 12 hex digits of the sha256 of
    the absolute, normalised state directory (server/main.cc)."""
    path = os.path.normpath(os.path.abspath(state_dir))
    return "opjit.%s." % hashlib.sha256(path.encode()).hexdigest()[:12]


def shm_objects(prefix):
    """This soak's daemon's objects in /dev/shm, and no one else's: another
    opjitd on the host, or another test of the same ctest run, has another
    state directory and so another prefix."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def register_base_ops(client):
    for spec in ("tanh_grad.json", "tanh.json", "leaky_relu.json"):
        client.register(os.path.join(EXAMPLES, spec))


# --- one client ---------------------------------------------------------------------------

def client_loop(idx, address, build, until, seed, acked=None):
    """Runs the mix until `until` (time.time()). Returns per-type latencies (ms)
    and errors by code. `acked`, when given, is a file path: every RegisterOp
    that returned OK is appended to it as a JSON line (name, version, digest)
    before the next call starts."""
    sys.path.insert(0, os.path.join(build, "python"))
    import numpy as np
    import opjit

    rng = random.Random(seed * 1000 + idx)
    kinds = [k for k, w in MIX for _ in range(w)]
    lat = collections.defaultdict(list)
    errors = collections.Counter()  # (kind, code, expected)
    samples = collections.defaultdict(list)
    shm = opjit.Client(address, timeout=30)
    inline = opjit.Client(address, timeout=30, transport="inline")
    tanh, tanh_in = shm.op("tanh"), inline.op("tanh")
    leaky = shm.op("leaky_relu")
    my_op = "soak_c%d" % idx
    variant = 0
    ack = open(acked, "a") if acked else None
    n = 0
    try:
        while time.time() < until:
            kind = rng.choice(kinds)
            size = rng.choice((16, 1024, 65536))
            x = np.linspace(-2, 2, size, dtype=np.float32)
            t0 = time.perf_counter()
            try:
                if kind == "forward_shm":
                    y = leaky(x)
                    if not (y[-1] == x[-1] and abs(y[0] - 0.01 * x[0]) < 1e-6):
                        raise AssertionError("leaky_relu gave wrong numbers")
                elif kind == "forward_inline":
                    y = tanh_in(x)
                    if abs(float(y[0]) - np.tanh(-2.0)) > 1e-5:
                        raise AssertionError("tanh gave wrong numbers")
                elif kind == "backward":
                    xt = opjit.tensor(x, requires_grad=True)
                    tanh(xt).backward()
                    want = 1 - np.tanh(x) ** 2
                    if np.max(np.abs(xt.grad - want)) > 1e-4:
                        raise AssertionError("tanh backward gave wrong numbers")
                elif kind == "compile":
                    v = rng.randrange(len(VARIANTS) + 2)
                    body = VARIANTS[v % len(VARIANTS)] + (" /* %d */" % v if v >= 4 else "")
                    shm.compile(KERNEL % {"entry": "K", "body": body}, entry="K")
                elif kind == "register":
                    variant = (variant + 1) % len(VARIANTS)
                    spec = op_spec(my_op, variant)
                    rec = shm.register(spec)
                    if ack:
                        ack.write(json.dumps({"name": my_op, "version": rec.record.version,
                                              "digest": digest(spec),
                                              "variant": variant}) + "\n")
                        ack.flush()
                        os.fsync(ack.fileno())
                elif kind == "gradcheck":
                    r = opjit.gradcheck(shm, "tanh", inputs=[x[:16].astype(np.float64)])
                    if not r.passed:
                        raise AssertionError("gradcheck failed: %r" % r)
                elif kind == "bad_dtype":
                    leaky(x.astype(np.int32))
                    raise AssertionError("an int32 input to leaky_relu was accepted")
                lat[kind].append((time.perf_counter() - t0) * 1000)
            except opjit.OpjitError as e:
                code = e.code.name if hasattr(e.code, "name") else str(e.code)
                expected = code in EXPECTED.get(kind, ())
                errors[(kind, code, expected)] += 1
                if expected:
                    lat[kind].append((time.perf_counter() - t0) * 1000)
                elif len(samples[(kind, code)]) < 3:
                    samples[(kind, code)].append(e.message[:300])
            except AssertionError as e:
                errors[(kind, "WRONG_RESULT", False)] += 1
                samples[(kind, "WRONG_RESULT")].append(str(e))
            n += 1
    finally:
        shm.close()
        inline.close()
        if ack:
            ack.close()
    return {"calls": n, "latency_ms": dict(lat),
            "errors": [[k, c, e, v] for (k, c, e), v in errors.items()],
            "samples": {"%s/%s" % k: v for k, v in samples.items()}}


def _client_proc(args):
    idx, address, build, until, seed, out, acked = args
    try:
        result = client_loop(idx, address, build, until, seed, acked)
    except Exception as e:  # a client that dies is an unexpected error, not a hang
        result = {"calls": 0, "latency_ms": {}, "errors": [["client", "CRASH", False, 1]],
                  "samples": {"client/CRASH": [repr(e)]}}
    with open(out, "w") as f:
        json.dump(result, f)


def run_clients(n, address, build, seconds, seed, workdir, acked=None, wait=True):
    """Starts n client processes; returns (processes, result paths)."""
    ctx = mp.get_context("spawn")
    until = time.time() + seconds
    procs, outs = [], []
    for i in range(n):
        out = os.path.join(workdir, "client%d.json" % i)
        ack = (acked % i) if acked else None
        p = ctx.Process(target=_client_proc,
                        args=((i, address, build, until, seed, out, ack),))
        p.start()
        procs.append(p)
        outs.append(out)
    if wait:
        for p in procs:
            p.join()
    return procs, outs


def percentile(v, q):
    if not v:
        return None
    v = sorted(v)
    return v[min(len(v) - 1, int(round(q / 100.0 * (len(v) - 1))))]


# --- the soak -----------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    sys.path.insert(0, os.path.join(build, "python"))
    import opjit

    seconds = args.minutes * 60
    work = tempfile.mkdtemp(prefix="opjit-soak-")
    state_dir = os.path.join(work, "state")
    shm_prefix = instance_prefix(state_dir)
    shm_before = shm_objects(shm_prefix)
    daemon = Daemon(build, state_dir).start()
    failures = []
    try:
        with opjit.Client(daemon.address, timeout=60) as c:
            register_base_ops(c)
        time.sleep(0.5)
        fds_before = fd_count(daemon.pid)
        rss = {"start": rss_sample(daemon.pid)}
        t0 = time.monotonic()
        procs, outs = run_clients(args.clients, daemon.address, build, seconds, args.seed, work,
                                  wait=False)
        time.sleep(seconds / 2)
        rss["middle"] = rss_sample(daemon.pid)
        for p in procs:
            p.join()
        rss["end"] = rss_sample(daemon.pid)
        took = time.monotonic() - t0
        # Leases are released by the clients' close(); executors stop after 2 s
        # idle. Wait for that (10 s at most, on a loaded machine).
        settle = time.monotonic() + 10
        fds_after = fd_count(daemon.pid)
        while fds_after > fds_before and time.monotonic() < settle:
            time.sleep(0.5)
            fds_after = fd_count(daemon.pid)
        shm_running = shm_objects(shm_prefix)
        alive = daemon.proc.poll() is None
    finally:
        daemon.stop()
    shm_after = shm_objects(shm_prefix)

    lat = collections.defaultdict(list)
    errors = collections.Counter()
    samples = {}
    calls = 0
    for out in outs:
        with open(out) as f:
            r = json.load(f)
        calls += r["calls"]
        for k, v in r["latency_ms"].items():
            lat[k].extend(v)
        for k, c, e, v in r["errors"]:
            errors[(k, c, e)] += v
        samples.update(r["samples"])

    unexpected = {"%s/%s" % (k, c): v for (k, c, e), v in errors.items() if not e}
    expected = {"%s/%s" % (k, c): v for (k, c, e), v in errors.items() if e}
    if not alive:
        failures.append("the daemon died during the soak")
    if unexpected:
        failures.append("unexpected errors: %s" % unexpected)
    for kind in ("daemon", "exec_workers"):
        mid, end = rss["middle"][kind], rss["end"][kind]
        bound = max(RSS_BOUND_MB, RSS_BOUND_FRACTION * mid)
        if end - mid > bound:
            failures.append("%s RSS grew %.0f MiB from the middle to the end (bound %.0f MiB)"
                            % (kind, end - mid, bound))
    if fds_after > fds_before:
        failures.append("daemon fds: %d before, %d after" % (fds_before, fds_after))
    leaked = sorted(set(shm_running) - set(shm_before))
    if leaked:
        failures.append("/dev/shm objects left with no client: %s" % leaked[:5])
    leaked_stop = sorted(set(shm_after) - set(shm_before))
    if leaked_stop:
        failures.append("/dev/shm objects left after the daemon stopped: %s" % leaked_stop[:5])

    report = {
        "clients": args.clients, "seconds": round(took, 1), "calls": calls,
        "calls_per_s": round(calls / took, 1),
        "latency_ms": {k: {"n": len(v), "p50": round(percentile(v, 50), 2),
                           "p99": round(percentile(v, 99), 2)} for k, v in sorted(lat.items())},
        "errors_expected": expected, "errors_unexpected": unexpected, "error_samples": samples,
        "rss_mb": rss, "rss_bound_mb": RSS_BOUND_MB, "rss_bound_fraction": RSS_BOUND_FRACTION,
        "daemon_fds": {"before": fds_before, "after": fds_after},
        "dev_shm": {"before": len(shm_before), "after_clients": len(shm_running),
                    "after_stop": len(shm_after)},
        "failures": failures,
    }
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if not failures:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    else:
        print("state and logs kept in", work)
    return 1 if failures else 0


def print_report(r):
    print("opjit soak: %d clients, %.0f s, %d calls (%.0f/s)"
          % (r["clients"], r["seconds"], r["calls"], r["calls_per_s"]))
    print("\n%-16s %8s %10s %10s" % ("call", "n", "p50 ms", "p99 ms"))
    for k, v in r["latency_ms"].items():
        print("%-16s %8d %10.2f %10.2f" % (k, v["n"], v["p50"], v["p99"]))
    print("\nerrors, expected:   %s" % (r["errors_expected"] or "none"))
    print("errors, unexpected: %s" % (r["errors_unexpected"] or "none"))
    for k, v in r["error_samples"].items():
        print("  %s: %s" % (k, v[0]))
    print("\nRSS MiB     %10s %10s %10s" % ("start", "middle", "end"))
    for kind in ("daemon", "exec_workers", "compile_workers"):
        print("%-11s %10.1f %10.1f %10.1f" % (kind, r["rss_mb"]["start"][kind],
                                             r["rss_mb"]["middle"][kind],
                                             r["rss_mb"]["end"][kind]))
    print("\ndaemon fds (less compile worker sockets): %(before)d before, %(after)d after"
          % r["daemon_fds"])
    print("/dev/shm opjit objects: %(before)d before, %(after_clients)d after the clients, "
          "%(after_stop)d after the daemon stopped" % r["dev_shm"])
    print("\n" + ("FAILED:\n  " + "\n  ".join(r["failures"]) if r["failures"] else "PASSED"))


if __name__ == "__main__":
    sys.exit(main())
