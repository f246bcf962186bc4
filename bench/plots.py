#!/usr/bin/env python3
"""Latency plots from py_bench.py's and call_bench's JSON.

    /usr/bin/python3 bench/plots.py OUTDIR [py.json] [call.json]

Writes PNGs into OUTDIR and prints, one a line, a markdown image link to each
(relative to bench/, where results.md lives). What cannot be plotted (no
matplotlib, a missing file, a failed section) is skipped with a line saying
why; the exit status is 0 in those cases.

* py.json "autograd": per size, the per-call latencies of the variants
  (box plot with every sample drawn, log x-axis).
* call.json "histogram_unix_1": call_bench's log-spaced latency bins of
  opjit's Forward and the bare gRPC echo (1 client, unix socket), as steps.
"""

import json
import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))

VARIANT_LABELS = {
    "opjit_bprop": "opjit, registered bprop",
    "opjit_function": "opjit.Function",
    "opjit_bprop_grpc": "opjit, registered bprop, gRPC",
    "opjit_function_grpc": "opjit.Function, gRPC",
    "torch_function": "torch.autograd.Function",
    "numpy": "numpy (floor)",
}


def link(alt, path):
    return "![%s](%s)" % (alt, os.path.relpath(os.path.abspath(path), BENCH))


def load(path, what):
    """(data, None) or (None, reason)."""
    if not path:
        return None, "%s: no file given" % what
    if not os.path.exists(path):
        return None, "%s: %s does not exist" % (what, path)
    try:
        with open(path) as f:
            return json.load(f), None
    except (OSError, ValueError) as e:
        return None, "%s: cannot read %s: %s" % (what, path, e)


def size_label(n):
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return "%dm" % (n // 1_000_000), "%d M" % (n // 1_000_000)
    if n >= 1000 and n % 1000 == 0:
        return "%dk" % (n // 1000), "%d k" % (n // 1000)
    return str(n), str(n)


def fmt_us(v):
    if v >= 1000:
        return "%.1f ms" % (v / 1000)
    return "%.1f µs" % v


def plot_autograd(plt, data, outdir, src):
    lines = []
    ag = data.get("autograd")
    if not isinstance(ag, dict):
        return ["skipped autograd plots: %s has no \"autograd\" section" % src]
    if "error" in ag:
        return ["skipped autograd plots: the autograd section failed: %s" % ag["error"][:200]]
    sizes = ag.get("sizes") or sorted(int(k[2:]) for k in ag if k.startswith("n_"))
    threads = ag.get("torch_num_threads")
    for n in sizes:
        sec = ag.get("n_%d" % n)
        if not isinstance(sec, dict):
            lines.append("skipped autograd plot n=%d: no data" % n)
            continue
        names, samples, skipped = [], [], []
        for name, v in sec.items():
            if isinstance(v, dict) and v.get("samples_us"):
                names.append(name)
                samples.append(v["samples_us"])
            else:
                why = v.get("error", "no samples") if isinstance(v, dict) else "no samples"
                skipped.append("%s (%s)" % (name, why[:120]))
        if not names:
            lines.append("skipped autograd plot n=%d: no variant has samples: %s"
                         % (n, "; ".join(skipped)))
            continue
        short, long_ = size_label(n)
        fig, ax = plt.subplots(figsize=(8, 1.2 + 0.75 * len(names)))
        pos = list(range(len(names), 0, -1))  # first variant on top
        ax.boxplot(samples, positions=pos, vert=False, whis=(1, 99), showfliers=False,
                   widths=0.5, medianprops={"color": "black", "linewidth": 1.5})
        for p, s in zip(pos, samples):
            # every sample as a dot, spread vertically so dense regions show
            offsets = [((i * 0.618034) % 1.0 - 0.5) * 0.35 for i in range(len(s))]
            ax.scatter(s, [p + o for o in offsets], s=6, alpha=0.35, linewidths=0)
            med = sorted(s)[len(s) // 2] if len(s) % 2 else \
                0.5 * (sorted(s)[len(s) // 2 - 1] + sorted(s)[len(s) // 2])
            ax.annotate("p50 %s" % fmt_us(med), (med, p + 0.3), fontsize=8, ha="center",
                        va="bottom")
        ax.set_yticks(pos)
        ax.set_yticklabels(["%s\n(%d calls)" % (VARIANT_LABELS.get(nm, nm), len(s))
                            for nm, s in zip(names, samples)], fontsize=8)
        ax.set_xscale("log")
        ax.set_ylim(0.4, len(names) + 0.8)
        ax.set_xlabel("forward + backward per call, µs (log scale; box: p25-p75, "
                      "whiskers: p1-p99)")
        title = "tanh forward+backward, %s float32 elements" % long_
        if threads is not None:
            title += " (torch threads: %s)" % threads
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", which="both", alpha=0.3)
        fig.tight_layout()
        out = os.path.join(outdir, "autograd_%s.png" % short)
        fig.savefig(out, dpi=100)
        plt.close(fig)
        lines.append(link("autograd latency, %s elements" % long_.replace(" ", ""), out))
        if skipped:
            lines.append("skipped in the n=%d autograd plot: %s" % (n, "; ".join(skipped)))
    return lines


def plot_call_histogram(plt, data, outdir, src):
    h = data.get("histogram_unix_1")
    if not isinstance(h, dict):
        return ["skipped call latency histogram: %s has no histogram_unix_1 (a side of the "
                "1-client unix run failed, or call_bench is older)" % src]
    edges = h.get("edges_us") or []
    series = [(k, h.get(k)) for k in ("opjit", "echo")]
    series = [(k, v) for k, v in series if v and len(v) == len(edges) - 1]
    if len(edges) < 2 or not series or not any(sum(v) for _, v in series):
        return ["skipped call latency histogram: histogram_unix_1 in %s has no counts" % src]
    labels = {"opjit": "opjit Forward (1 client)", "echo": "bare gRPC echo (1 client)"}
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for k, v in series:
        ax.stairs(v, edges, label="%s, %d calls" % (labels.get(k, k), sum(v)), linewidth=1.5)
    # p50 markers from the summary rows when they are there
    for row in data.get("call_overhead", []) if isinstance(data.get("call_overhead"), list) \
            else []:
        if row.get("transport") == "unix" and row.get("clients") == 1:
            for k, color in (("opjit", "C0"), ("echo", "C1")):
                p50 = row.get(k, {}).get("p50_us") if isinstance(row.get(k), dict) else None
                if p50:
                    ax.axvline(p50, color=color, linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("latency per call, µs (log-spaced bins; unix socket; dotted: p50)")
    ax.set_ylabel("calls per bin")
    ax.set_title("call_bench: opjit Forward vs bare gRPC echo, 1 client, unix socket",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both", axis="x")
    fig.tight_layout()
    out = os.path.join(outdir, "call_latency_unix_1.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [link("call latency histogram, 1 client, unix socket", out)]


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    outdir = argv[1]
    py_path = argv[2] if len(argv) > 2 else None
    call_path = argv[3] if len(argv) > 3 else None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        # The whole section skipped on purpose: bench/report.py says so.
        print("skipped: no plots: matplotlib is not importable for %s (%s)"
              % (sys.executable, e))
        return 0
    os.makedirs(outdir, exist_ok=True)
    lines = []
    py, why = load(py_path, "py_bench JSON")
    if py is None:
        lines.append("skipped autograd plots: " + why)
    else:
        lines += plot_autograd(plt, py, outdir, py_path)
    call, why = load(call_path, "call_bench JSON")
    if call is None:
        lines.append("skipped call latency histogram: " + why)
    else:
        lines += plot_call_histogram(plt, call, outdir, call_path)
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
