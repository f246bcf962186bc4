#!/usr/bin/env python3
"""What a uid per namespace costs a daemon without root (issue 27).

    sudo /usr/bin/python3 bench/userns_bench.py OUT.json [--build build] [--rounds 12]

Starts three daemons side by side, each on its own state dir:

* "root": opjitd as root (the default): executors are process 1 of PID
  namespaces the spawn thread makes with unshare(CLONE_NEWPID), as a uid of
  [exec] uid_range;
* "nobody": opjitd as nobody without subordinate ids: each executor is
  cloned into user and PID namespaces as the daemon's own uid;
* "subuid": opjitd as nobody with subordinate ids (its own /etc/subuid and
  /etc/subgid in a mount namespace, as tests/python's SubuidDaemon): the same
  clone, with the ids mapped by newuidmap and newgidmap (two more exec's per
  executor start).

Per daemon, alternating between them in every round:
* "first_call_ms": register an op in a new namespace, then time its first
  call, which starts that namespace's executor (spawn, namespaces, mapping,
  sandbox, hello) and runs the kernel once;
* "grpc_us" and "fast_us": a warm tiny call (16 float32) over gRPC and over
  the fast channel, median of 500 per round.

Writes medians (and the ratio of each side to "root") to OUT.json, and a
Markdown table with --md. Needs root (it starts daemons as nobody); without
it, it writes {"skipped": ...} and a "skipped: <reason>" markdown section.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import emit_table  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--md")
    args = ap.parse_args()
    if os.geteuid() != 0:
        # Skipped on purpose: bench/report.py shows "skipped: <reason>" as such.
        why = "needs root (it starts daemons as nobody)"
        print("userns_bench: skipped: " + why, file=sys.stderr)
        with open(args.out, "w") as f:
            json.dump({"skipped": why}, f)
        if args.md:
            with open(args.md, "w") as f:
                f.write("skipped: %s\n" % why)
        return
    build = os.path.abspath(args.build)
    os.environ.setdefault("OPJITD", os.path.join(build, "bin", "opjitd"))
    sys.path.insert(0, os.path.join(build, "python"))
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
    import numpy as np
    import opjit
    from conftest import TempDaemon, unary_kernel, unary_spec
    from test_tenant_walls import NobodyDaemon, SubuidDaemon

    root = TempDaemon()
    root.spawn("", prefix="opjit-unb-", serving=True)
    daemons = {"root": root, "nobody": NobodyDaemon(), "subuid": SubuidDaemon()}
    results = {k: {"first_call_ms": [], "grpc_us": [], "fast_us": []} for k in daemons}
    x = np.arange(16, dtype=np.float32)
    try:
        clients = {k: (opjit.Client(d.unix_address, timeout=120, fast="off"),
                       opjit.Client(d.unix_address, timeout=120, fast="on"))
                   for k, d in daemons.items()}
        for k, (grpc_c, fast_c) in clients.items():
            grpc_c.register(unary_spec("twice", unary_kernel(), namespace="warm"))
        for r in range(args.rounds):
            for k, (grpc_c, fast_c) in clients.items():
                ns = "ns%d" % r
                grpc_c.register(unary_spec("twice", unary_kernel(), namespace=ns))
                t = time.perf_counter()
                y = grpc_c.op(ns + "/twice")(x)
                results[k]["first_call_ms"].append((time.perf_counter() - t) * 1e3)
                assert (y == 2 * x).all()
                for c, key in ((grpc_c, "grpc_us"), (fast_c, "fast_us")):
                    op = c.op("warm/twice")
                    for _ in range(50):
                        op(x)
                    times = []
                    for _ in range(500):
                        t = time.perf_counter()
                        op(x)
                        times.append((time.perf_counter() - t) * 1e6)
                    results[k][key].append(statistics.median(times))
        for grpc_c, fast_c in clients.values():
            grpc_c.close()
            fast_c.close()
    finally:
        for d in daemons.values():
            d.close()
    out = {"rounds": args.rounds, "load": os.getloadavg(), "sides": {}}
    for k, series in results.items():
        out["sides"][k] = {m: statistics.median(v) for m, v in series.items()}
    for k in daemons:
        out["sides"][k]["ratio_to_root"] = {
            m: out["sides"][k][m] / out["sides"]["root"][m] for m in results[k]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    lines = ["| daemon | first call in a new namespace (ms) | warm gRPC call (µs) | "
             "warm fast call (µs) |", "|---|---|---|---|"]
    for k, s in out["sides"].items():
        ratio = s["ratio_to_root"]
        lines.append("| %s | %.1f (%.2f×) | %.0f (%.2f×) | %.1f (%.2f×) |" % (
            k, s["first_call_ms"], ratio["first_call_ms"], s["grpc_us"], ratio["grpc_us"],
            s["fast_us"], ratio["fast_us"]))
    emit_table(lines, args.md)


if __name__ == "__main__":
    main()
