#!/usr/bin/env python3
"""Many tenants on one daemon (issue 30, goal 9).

    /usr/bin/python3 bench/tenants_bench.py OUT.json [--build build] [--md OUT.md]
        [--namespaces 1000] [--ops-per-namespace 10] [--clients 64] [--rate 50]
        [--seconds 10]

One opjitd of its own (the default config with [quota] namespaces raised to
NAMESPACES + 1; executors in sandboxed processes):

1. Registers NAMESPACES x OPS_PER_NAMESPACE tiny ops (10,000 by default; one
   kernel text, so every compile after the first is a cache hit) and times
   it; the daemon's resident memory (VmRSS, VmHWM) after that, with no
   executor started.
2. Restarts the daemon on the same state dir: the time until it answers, and
   the registry load the log reports.
3. A cached tiny call (16 float32, a prepared handle on the fast channel,
   tensors in the client's region) from one client at RATE calls/s for
   SECONDS: its p50 and p99. Then CLIENTS clients at once, each in a
   namespace of its own at RATE calls/s (open loop: each call is scheduled
   at start + i / RATE), every op of its namespace warmed first: their p50
   and p99 over all samples, the ratio to the single client's, the daemon's
   and the executors' memory under that load (executors: the sum of their
   PSS, so shared pages count once) and the cores each side used. The
   clients are threads of bench/tenants_load.cc (BUILD/bin/tenants_load),
   each a Client of its own: a C++ load costs a few µs a call, where 64
   Python processes took a whole core of the two.

Goals (issue 30): daemon memory at most 1 GiB; at CLIENTS clients on 2 cores
the p99 at most 2x the single-client p99. Idle namespaces cost no process:
executors stop after [exec] idle_ms, so after the registration no executor
runs, and under load one namespace has at most [exec] workers of them plus
one per open fast channel ([fast] channels_per_namespace).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import emit_table  # noqa: E402
from soak import children  # noqa: E402


def proc_kb(pid, field):
    """A field of /proc/PID/status in KiB (0 when gone)."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def pss_kb(pid):
    try:
        with open("/proc/%d/smaps_rollup" % pid) as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def executors_of(daemon_pid):
    """Pids of the daemon's executor processes (not its health probes)."""
    return [p for p, comm in children(daemon_pid).items() if comm.startswith("opjit-exec-work")]


def ticks(pid):
    """utime + stime of `pid` in clock ticks (0 when gone)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def cpu_busy():
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def percentile(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] if v else 0.0


def run_clients(build, address, namespaces, ops, rate, seconds, daemon_pid):
    """One client per namespace (threads of bench/tenants_load.cc); returns
    (all samples, memory and CPU under load)."""
    start_at = time.time() + 5 + 0.05 * len(namespaces)
    load = subprocess.Popen(
        [os.path.join(build, "bin", "tenants_load"), address, str(ops), str(rate), str(seconds),
         repr(start_at)] + list(namespaces), stdout=subprocess.PIPE)
    procs = [load]
    # Memory under load: sampled in the middle of the timed window; the
    # machine's CPU use over its second quarter.
    time.sleep(max(0.0, start_at - time.time()) + seconds / 4)
    execs = executors_of(daemon_pid)
    groups = {"daemon": [daemon_pid], "executors": execs, "clients": [p.pid for p in procs]}
    before = {k: sum(ticks(p) for p in v) for k, v in groups.items()}
    b0, t0 = cpu_busy()
    time.sleep(seconds / 4)
    b1, t1 = cpu_busy()
    hz = os.sysconf("SC_CLK_TCK")
    share = {k: (sum(ticks(p) for p in v) - before[k]) / hz / (seconds / 4)
             for k, v in groups.items()}
    mem = {"daemon_rss_kb": proc_kb(daemon_pid, "VmRSS"), "executors": len(execs),
           "executors_pss_kb": sum(pss_kb(p) for p in execs),
           "cpu_busy": (b1 - b0) / max(1, t1 - t0), "cores_used": share}
    out, _ = load.communicate(timeout=seconds + 600)
    result = json.loads(out)
    if load.returncode != 0:
        raise RuntimeError("the load failed: %s" % "; ".join(result["errors"]))
    return result["samples_us"], mem


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--md")
    ap.add_argument("--namespaces", type=int, default=1000)
    ap.add_argument("--ops-per-namespace", type=int, default=10)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rate", type=float, default=50)
    ap.add_argument("--seconds", type=float, default=10)
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    os.environ.setdefault("OPJITD", os.path.join(build, "bin", "opjitd"))
    sys.path.insert(0, os.path.join(build, "python"))
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
    import opjit
    from conftest import TempDaemon, unary_kernel, unary_spec

    res = {"namespaces": args.namespaces, "ops_per_namespace": args.ops_per_namespace,
           "clients": args.clients, "rate": args.rate, "seconds": args.seconds}
    # The namespace quota (default 64) raised to hold them all.
    config = "[quota]\nnamespaces = %d\n" % (args.namespaces + 1)
    d = TempDaemon()
    d.spawn(config, prefix="opjit-tnb-", serving=True)
    try:
        src = unary_kernel()
        rule = [{"kind": "same_as", "input": 0}]
        with opjit.Client(d.unix_address, timeout=300) as c:
            t = time.perf_counter()
            for n in range(args.namespaces):
                for k in range(args.ops_per_namespace):
                    c.register(unary_spec("op%d" % k, src, namespace="t%d" % n,
                                          output_rules=rule))
            res["register_s"] = time.perf_counter() - t
        ops = args.namespaces * args.ops_per_namespace
        res["register_ms_per_op"] = res["register_s"] / ops * 1e3
        res["idle"] = {"daemon_rss_kb": proc_kb(d.proc.pid, "VmRSS"),
                       "daemon_hwm_kb": proc_kb(d.proc.pid, "VmHWM"),
                       "executors": len(executors_of(d.proc.pid))}
        # A restart on the same state: start and registry load.
        d.proc.terminate()
        d.proc.wait(60)
        d.log.close()
        t = time.perf_counter()
        d.spawn(config, dir=d.dir, serving=True)
        res["restart_s"] = time.perf_counter() - t
        m = re.search(r"(\d\d:\d\d:\d\d\.\d+) info  \[registry\] registry opened from [^\n]*",
                      d.read_log())
        res["registry_log"] = m.group(0) if m else None
        res["restart_rss_kb"] = proc_kb(d.proc.pid, "VmRSS")
        # At least 1,000 samples for the single client's p99.
        single, _ = run_clients(build, d.unix_address, ["t0"], args.ops_per_namespace,
                                args.rate, max(args.seconds, 1000 / args.rate), d.proc.pid)
        many, loaded = run_clients(build, d.unix_address,
                                   ["t%d" % (i % args.namespaces) for i in range(1, args.clients + 1)],
                                   args.ops_per_namespace, args.rate, args.seconds, d.proc.pid)
        res["loaded"] = loaded
        res["single"] = {"n": len(single), "p50_us": percentile(single, 0.5),
                         "p99_us": percentile(single, 0.99)}
        res["many"] = {"n": len(many), "p50_us": percentile(many, 0.5),
                       "p99_us": percentile(many, 0.99)}
        res["p99_ratio"] = res["many"]["p99_us"] / res["single"]["p99_us"]
    finally:
        d.close()
    res["load"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    mib = lambda kb: kb / 1024.0
    lines = [
        "| what | value | goal |", "|---|---|---|",
        "| register %d ops in %d namespaces | %.1f s (%.2f ms an op) | |" % (
            ops, args.namespaces, res["register_s"], res["register_ms_per_op"]),
        "| daemon memory after that (RSS; peak) | %.0f MiB; %.0f MiB | at most 1024 MiB |" % (
            mib(res["idle"]["daemon_rss_kb"]), mib(res["idle"]["daemon_hwm_kb"])),
        "| executors running with no calls | %d | 0 |" % res["idle"]["executors"],
        "| restart on that state, to the first answer | %.2f s | |" % res["restart_s"],
        "| 1 client at %.0f calls/s: p50 / p99 | %.0f / %.0f µs | |" % (
            args.rate, res["single"]["p50_us"], res["single"]["p99_us"]),
        "| %d clients (a namespace each) at %.0f calls/s each: p50 / p99 | %.0f / %.0f µs "
        "(p99 %.2f× one client's) | at most 2× |" % (
            args.clients, args.rate, res["many"]["p50_us"], res["many"]["p99_us"],
            res["p99_ratio"]),
        "| under that load: daemon RSS; executors (their PSS); CPU busy | %.0f MiB; %d (%.0f MiB); "
        "%.0f%% | |" % (mib(loaded["daemon_rss_kb"]), loaded["executors"],
                        mib(loaded["executors_pss_kb"]), 100 * loaded["cpu_busy"]),
        "| cores used under that load: clients; executors; daemon | %.2f; %.2f; %.2f | |" % (
            loaded["cores_used"]["clients"], loaded["cores_used"]["executors"],
            loaded["cores_used"]["daemon"]),
    ]
    emit_table(lines, args.md)


if __name__ == "__main__":
    main()
