"""Turns Google Benchmark JSON into bench/results.md: medians and ratios."""
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
    print("\n## Kernel quality (JIT vs `g++ -O3 -march=native`, same source)\n")
    print("| size | JIT | g++ | ratio | goal |")
    print("|---|---|---|---|---|")
    for n, label in ((16 << 10, "16K floats (in cache)"), (16 << 20, "16M floats")):
        print(row(label, f"BM_KernelJit/{n}", f"BM_KernelGccO3Native/{n}", "≤ 1.05×"))
    if errors:
        print("\n## Failures\n")
        for k, v in errors.items():
            print(f"- `{k}`: {v}")


if __name__ == "__main__":
    main()
