#!/usr/bin/env python3
"""What the evaluator itself costs (issue 31): a Verify against the calls it
makes, and a Benchmark repetition against a plain call.

    /usr/bin/python3 bench/evaluate_bench.py OUT.json [--build build] [--rounds 5] [--md OUT.md]

On one opjitd of its own (kernels/verify/scale_add.json as candidate and
scale_add_ref.json as reference, float32), alternating in every round:

* "verify_ms": `opjit.verify(candidate, reference, dtypes=["float32"])`,
  the default case list (7 edge shapes x (2 seeds + 1 special) = 21 cases),
  with the default settle time (10 ms per case) and with settle_ms=1;
* "calls_ms": the work those 21 cases hold, done from Python without the
  evaluator: the same shapes, 3 calls per case (the reference once, the
  candidate twice) through `Op(...)` on the client's default transport;
* "bench_rep_us": the end-to-end median of a Benchmark repetition in the
  daemon (1 M float32) next to the kernel's own median, and a client call of
  the same op on a numpy array (the client's default transport).

The evaluator's own cost per case is (verify - calls) / 21 with settle_ms=1;
what remains is its region per case and side, the poison fills, the input
checks and the compare, on the daemon's side.
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
SHAPES = [0, 1, 7, 13, 127, 1031, 65537]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--md")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    os.environ.setdefault("OPJITD", os.path.join(build, "bin", "opjitd"))
    sys.path.insert(0, os.path.join(build, "python"))
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
    import numpy as np
    import opjit
    from conftest import TempDaemon

    d = TempDaemon()
    d.spawn("", prefix="opjit-evb-", serving=True)
    kdir = os.path.join(HERE, "..", "kernels", "verify")
    series = {k: [] for k in ("verify_default_ms", "verify_settle1_ms", "calls_ms",
                              "bench_e2e_us", "bench_kernel_us", "client_call_us")}
    try:
        with opjit.Client(d.unix_address, timeout=300) as c:
            c.register(os.path.join(kdir, "scale_add.json"))
            c.register(os.path.join(kdir, "scale_add_ref.json"))
            cand, ref = c.op("scale_add"), c.op("scale_add_ref")
            rng = np.random.default_rng(1)
            x_big = rng.uniform(-2, 2, 1 << 20).astype(np.float32)
            for _ in range(2):  # warm: compiles, executors
                opjit.verify(cand, ref, dtypes=["float32"], settle_ms=1, client=c)
            for _ in range(args.rounds):
                t = time.perf_counter()
                r = opjit.verify(cand, ref, dtypes=["float32"], client=c)
                series["verify_default_ms"].append((time.perf_counter() - t) * 1e3)
                assert r and len(r.cases) == 3 * len(SHAPES), r.table()
                t = time.perf_counter()
                r = opjit.verify(cand, ref, dtypes=["float32"], settle_ms=1, client=c)
                series["verify_settle1_ms"].append((time.perf_counter() - t) * 1e3)
                assert r
                t = time.perf_counter()
                for n in SHAPES:
                    for _ in range(3):
                        x = rng.uniform(-2, 2, n).astype(np.float32)
                        ref(x)
                        cand(x)
                        cand(x)
                series["calls_ms"].append((time.perf_counter() - t) * 1e3)
                b = opjit.bench(cand, shape=[1 << 20], min_reps=20, min_time_ms=300, client=c)
                series["bench_e2e_us"].append(b.op.median_ms * 1e3)
                series["bench_kernel_us"].append(b.op.kernel_median_ms * 1e3)
                times = []
                for _ in range(20):
                    t = time.perf_counter()
                    cand(x_big)
                    times.append((time.perf_counter() - t) * 1e6)
                series["client_call_us"].append(statistics.median(times))
    finally:
        d.close()
    med = {k: statistics.median(v) for k, v in series.items()}
    cases = 3 * len(SHAPES)
    out = {"rounds": args.rounds, "load": os.getloadavg(), "cases": cases, "medians": med,
           "samples": series,
           "per_case_overhead_ms": (med["verify_settle1_ms"] - med["calls_ms"]) / cases,
           "verify_to_calls": med["verify_settle1_ms"] / med["calls_ms"]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    lines = [
        "| what | median | ratio |", "|---|---|---|",
        "| `opjit.verify`, %d cases, settle 10 ms (default) | %.0f ms | |" % (
            cases, med["verify_default_ms"]),
        "| `opjit.verify`, %d cases, settle 1 ms | %.0f ms | %.2f× the calls |" % (
            cases, med["verify_settle1_ms"], out["verify_to_calls"]),
        "| the %d calls those cases make, from Python (`Op(x)`) | %.0f ms | 1 |" % (
            3 * cases, med["calls_ms"]),
        "| evaluator's own cost per case (settle 1 ms) | %.2f ms | |" % (
            out["per_case_overhead_ms"]),
        "| Benchmark repetition, 1 M float32: in the daemon, end to end | %.0f µs | %.2f× "
        "the kernel |" % (med["bench_e2e_us"], med["bench_e2e_us"] / med["bench_kernel_us"]),
        "| the kernel alone (executor's measure) | %.0f µs | 1 |" % med["bench_kernel_us"],
        "| the same call from Python (`Op(x)`, inline numpy) | %.0f µs | %.2f× the kernel |" % (
            med["client_call_us"], med["client_call_us"] / med["bench_kernel_us"]),
    ]
    emit_table(lines, args.md)


if __name__ == "__main__":
    main()
