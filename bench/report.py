"""Turns benchmark JSON into bench/results.md: medians and ratios.

    report.py COMPILE.json [CALL.json]

COMPILE.json is compile_bench's Google Benchmark JSON; CALL.json, when given,
is call_bench's output (call overhead and data path)."""
import datetime
import json
import os
import platform
import sys


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def medians(path):
    with open(path) as f:
        data = json.load(f)
    out, errors = {}, {}
    for b in data["benchmarks"]:
        name = b.get("run_name", b["name"])
        # "BM_X/16384/iterations:10/repeats:3" -> "BM_X/16384"
        name = "/".join(p for p in name.split("/")
                        if not p.startswith(("iterations:", "repeats:")))
        if b.get("error_occurred"):
            errors[name] = b.get("error_message", "failed")
            continue
        if b.get("aggregate_name") == "median":
            unit = b.get("time_unit", "ns")
            scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
            out[name] = b["real_time"] * scale  # milliseconds
    return out, errors


def fmt(ms):
    if ms is None:
        return "failed"
    if ms < 1:
        return f"{ms * 1000:.1f} µs"
    return f"{ms:.1f} ms"


def main():
    med, errors = medians(sys.argv[1])

    def get(name):
        return med.get(name)

    def row(what, a, b, target):
        ra, rb = get(a), get(b)
        ratio = f"{ra / rb:.2f}×" if ra and rb else "n/a"
        return f"| {what} | {fmt(ra)} | {fmt(rb)} | {ratio} | {target} |"

    print("# opjit benchmark results\n")
    print(f"Machine: {os.cpu_count()} cores, {cpu_model()}. "
          f"Date: {datetime.date.today().isoformat()}. Medians of 3–5 repetitions.\n")
    print("## Compile (in-process KernelCompiler, sandboxed worker)\n")
    print("| what | opjit | peer | ratio | goal |")
    print("|---|---|---|---|---|")
    print(row("cold compile, `<cmath>` kernel vs `g++ -O2 -shared -fPIC` + dlopen",
              "BM_OpjitColdCompileCmath", "BM_GccSharedDlopenCmath", "≤ 0.4×"))
    print(f"| memory-cache hit | {fmt(get('BM_OpjitMemoryHit'))} | | | ≤ 50 µs |")
    print(f"| disk-cache hit, freshly created compiler | "
          f"{fmt(get('BM_OpjitDiskHitFreshCompiler'))} | | | ≤ 2 ms |")
    print("\n## NVRTC (compile only, no GPU here; sm_80 + sm_90 CUBIN and PTX)\n")
    print("| what | opjit | raw NVRTC | ratio | goal |")
    print("|---|---|---|---|---|")
    print(row("cold compile of a small kernel", "BM_OpjitNvrtcCold", "BM_NvrtcRaw", "≤ 1.1×"))
    print(f"| memory-cache hit | {fmt(get('BM_OpjitNvrtcMemoryHit'))} | | | ≤ 1 ms |")
    print("\n## Kernel quality (JIT vs `g++ -O3 -march=native`, same source)\n")
    print("| size | JIT | g++ | ratio | goal |")
    print("|---|---|---|---|---|")
    for n, label in ((16 << 10, "16K floats (in cache)"), (16 << 20, "16M floats")):
        print(row(label, f"BM_KernelJit/{n}", f"BM_KernelGccO3Native/{n}", "≤ 1.05×"))
    if errors:
        print("\n## Failures\n")
        for k, v in errors.items():
            print(f"- `{k}`: {v}")
    if len(sys.argv) > 2:
        call_report(sys.argv[2])


def num(d, key):
    """d[key] as a float, or None when the row failed or lacks it."""
    if not isinstance(d, dict) or "error" in d:
        return None
    v = d.get(key)
    return float(v) if isinstance(v, (int, float)) else None


def us(v):
    return "failed" if v is None else f"{v:.0f} µs"


def ms(v):
    if v is None:
        return "failed"
    return f"{v * 1000:.0f} µs" if v < 1 else f"{v:.1f} ms"


def gbs(v):
    return "failed" if v is None else f"{v:.2f} GB/s"


def ratio(a, b):
    return f"{a / b:.2f}×" if a is not None and b else "n/a"


def call_report(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        print(f"\n## Call path\n\ncall_bench produced no readable JSON ({e}).")
        return
    failures = []
    if "error" in data:
        failures.append(("call_bench", data["error"]))
    if "config_error" in data:
        failures.append(("opjitd with max_message_mb", data["config_error"]))
    cfg = data.get("config", {})
    machine = data.get("machine", {})

    rows = data.get("call_overhead", [])
    print("\n## Call overhead (cached tiny op vs bare gRPC echo)\n")
    print(f"`leaky_relu` on {cfg.get('tiny_floats', 16)} float32, inline in and out "
          f"({cfg.get('request_bytes', '?')}-byte request), through the C++ client's "
          f"synchronous `Forward`, against a callback-API generic gRPC echo of a "
          f"{cfg.get('echo_payload_bytes', '?')}-byte payload "
          f"(echo server: {cfg.get('echo_server', 'in-process')}). The sides alternate in batches "
          f"on the same machine state; each client has its own channel and "
          f"connection. Per-call latency; calls/s over all clients. "
          f"\"opjitd no-op\" is `ListRegions` on an empty namespace (the daemon's "
          f"own RPC floor); `server_ms` is the time inside the executor, as the "
          f"response reports it.\n")
    print("| transport | clients | opjit p50 | opjit p99 | opjit calls/s | echo p50 "
          "| echo p99 | echo calls/s | ratio p50 | goal | opjitd no-op p50 "
          "| server_ms p50 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        o, e, n = r.get("opjit", {}), r.get("echo", {}), r.get("opjit_noop", {})
        for side, d in (("opjit", o), ("echo", e), ("opjitd no-op", n)):
            if isinstance(d, dict) and "error" in d:
                failures.append((f"{side}, {r.get('transport')}, {r.get('clients')} clients",
                                 d["error"]))
        goal = "≤ 1.2×" if r.get("transport") == "unix" and r.get("clients") == 1 else ""
        cps = lambda d: "failed" if num(d, "calls_per_s") is None else f"{num(d, 'calls_per_s'):,.0f}"
        server = num(o, "server_ms_p50")
        print(f"| {r.get('transport')} | {r.get('clients')} | {us(num(o, 'p50_us'))} "
              f"| {us(num(o, 'p99_us'))} | {cps(o)} | {us(num(e, 'p50_us'))} "
              f"| {us(num(e, 'p99_us'))} | {cps(e)} "
              f"| {ratio(num(o, 'p50_us'), num(e, 'p50_us'))} | {goal} "
              f"| {us(num(n, 'p50_us'))} "
              f"| {'failed' if server is None else f'{server * 1000:.0f} µs'} |")

    print("\n## Data path (`leaky_relu`, float32)\n")
    print("Shared memory: input and output in one daemon-created region, output "
          "placed at a fixed offset; call time against the kernel's own time "
          "(`kernel_ms`). Inline: the same bytes in the request and the response "
          f"(daemon and client at max_message_mb = {cfg.get('max_message_mb', '?')}), "
          "next to a bare gRPC echo of a message of the same size. memcpy: "
          "in-process, pre-faulted buffers, the physical floor. GB/s is input bytes "
          "per second (each moves that many in and out). Medians of "
          f"{rows_reps(data)} calls after one untimed call.\n")
    print("| size | shm call | kernel | call / kernel | goal | shm GB/s | inline call "
          "| inline GB/s | gRPC echo, same bytes | memcpy | memcpy GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in data.get("data_path", []):
        size = r.get("size_mib")
        shm, inl, mc = r.get("shm", {}), r.get("inline"), r.get("memcpy", {})
        for what, d in (("shm", shm), ("inline", inl), ("memcpy", mc)):
            if isinstance(d, dict) and "error" in d:
                failures.append((f"{what}, {size} MiB", d["error"]))
        if inl is None:
            inline_cells = "not run (over 64 MiB) | | "
        else:
            echo = inl.get("echo", {}) if isinstance(inl, dict) else {}
            if isinstance(echo, dict) and "error" in echo:
                failures.append((f"inline echo, {size} MiB", echo["error"]))
            inline_cells = (f"{ms(num(inl, 'call_ms'))} | {gbs(num(inl, 'gb_per_s'))} "
                            f"| {ms(num(echo, 'call_ms'))}")
        goal = "≤ 1.1×" if size == 256 else ""
        print(f"| {size} MiB | {ms(num(shm, 'call_ms'))} | {ms(num(shm, 'kernel_ms'))} "
              f"| {ratio(num(shm, 'call_ms'), num(shm, 'kernel_ms'))} | {goal} "
              f"| {gbs(num(shm, 'gb_per_s'))} | {inline_cells} "
              f"| {ms(num(mc, 'ms'))} | {gbs(num(mc, 'gb_per_s'))} |")

    print()
    print(histogram(data.get("histogram_unix_1"), path))
    load = (machine.get("loadavg_start"), machine.get("loadavg_end"))
    print(f"\ncall_bench ran {data.get('total_s', 0):.0f} s; 1-minute load average "
          f"{load[0]} at its start, {load[1]} at its end (other work on these "
          f"{machine.get('cores', '?')} cores shows up in every number).")
    if failures:
        print("\n### Call path failures\n")
        for what, err in failures:
            print(f"- {what}: {err}")


def rows_reps(data):
    for r in data.get("data_path", []):
        n = num(r.get("shm", {}), "reps")
        if n:
            return int(n)
    return "?"


def histogram(h, json_path):
    """Writes bench/call_latency.png when matplotlib is there; says so either way."""
    if not h:
        return "Latency histogram: no data (a side of the 1-client unix run failed)."
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("Latency histogram: skipped (matplotlib is not installed for "
                "/usr/bin/python3); the bins are in the JSON as `histogram_unix_1`.")
    edges = h["edges_us"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name in ("opjit", "echo"):
        ax.stairs(h[name], edges, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("latency per call, µs (1 client, unix socket)")
    ax.set_ylabel("calls")
    ax.legend()
    fig.tight_layout()
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "call_latency.png")
    fig.savefig(out, dpi=100)
    return "![latency histogram, 1 client, unix](call_latency.png)"


if __name__ == "__main__":
    main()
