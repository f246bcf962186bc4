#!/usr/bin/python3
"""Two builds of opjit side by side: is a change free of cost?

    /usr/bin/python3 bench/ab.py --base BASE_BUILD [--new build] [--rounds 3]
                                 [--out bench/out/ab] [--md FILE]

For a refactor that must leave behaviour and speed as they were: builds the
two trees yourself (say `git worktree add /tmp/base <commit>` and a build
there), then this runs, for `--rounds` rounds, in alternating order (base,
new, then new, base, ...) so both see the same machine:

  - call_bench of the new build against each build's opjitd (the gRPC call
    path and the data path; the client side is the same binary),
  - fast_bench likewise (the same-host fast channel),
  - exec_bench of each build (the in-process executor, Google Benchmark).

Every median and mean that a run reports is read back from its JSON, the
median across rounds is taken per number, and a markdown table prints each
with new/base. Times are lower-is-better; `ratio` > 1 means the new build is
slower. A part that fails is reported as failed; no number is made up.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys


def flatten(node, prefix, out):
    """{dotted path: number} of every median and in-run ratio."""
    if isinstance(node, dict):
        label = node.get("name") or node.get("label")
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, (dict, list)):
                flatten(v, key, out)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                # Medians and the run's own ratios (each against a peer
                # measured in the same run: the least noisy numbers).
                if any(t in k for t in ("median", "p50", "ratio", "_over_")):
                    out[f"{prefix}[{label}].{k}" if label else key] = float(v)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            name = v.get("name") or v.get("label") if isinstance(v, dict) else None
            flatten(v, f"{prefix}[{name if name else i}]", out)


def gbench(path):
    """{benchmark: median real time} of a Google Benchmark JSON."""
    with open(path) as f:
        data = json.load(f)
    out = {}
    for b in data.get("benchmarks", []):
        if b.get("aggregate_name") == "median":
            out[b["run_name"]] = float(b["real_time"])
    return out


def run(cmd, env=None):
    print("==", " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, env=dict(os.environ, **(env or {})), stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        return p.stderr.strip().splitlines()[-1:] or [f"exit {p.returncode}"]
    return None


def one_round(side, build, new, out, r):
    """{part: {number: value}} of one round of one side; failures as strings."""
    res = {}
    opjitd = os.path.join(build, "bin", "opjitd")
    for part, exe in (("call", "call_bench"), ("fast", "fast_bench")):
        path = os.path.join(out, f"{part}.{side}.{r}.json")
        err = run([os.path.join(new, "bin", exe), path, opjitd])
        if err:
            res[part] = f"failed: {err[0]}"
            continue
        with open(path) as f:
            flat = {}
            flatten(json.load(f), "", flat)
            res[part] = flat
    path = os.path.join(out, f"exec.{side}.{r}.json")
    err = run([os.path.join(build, "bin", "exec_bench"), "--benchmark_repetitions=5",
               "--benchmark_report_aggregates_only=true", f"--benchmark_out={path}",
               "--benchmark_out_format=json"])
    res["exec"] = f"failed: {err[0]}" if err else gbench(path)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the build directory of the reference tree")
    ap.add_argument("--new", default="build", help="the build directory of the changed tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/out/ab")
    ap.add_argument("--md", help="also write the table here")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rounds = {"base": [], "new": []}
    for r in range(a.rounds):
        order = ("base", "new") if r % 2 == 0 else ("new", "base")
        for side in order:
            rounds[side].append(one_round(side, a.base if side == "base" else a.new, a.new,
                                          a.out, r))

    lines = [f"A/B of `{a.base}` (base) and `{a.new}` (new), {a.rounds} rounds in alternating "
             "order; medians across rounds. ratio = new / base (> 1: new is slower).", "",
             "| part | number | base | new | ratio |", "|---|---|---|---|---|"]
    ratios = []
    for part in ("call", "fast", "exec"):
        fails = [r[part] for s in rounds.values() for r in s if isinstance(r[part], str)]
        if fails:
            lines.append(f"| {part} | {fails[0]} | | | |")
            continue
        keys = set.intersection(*(set(r[part]) for s in rounds.values() for r in s))
        for k in sorted(keys):
            b = statistics.median(r[part][k] for r in rounds["base"])
            n = statistics.median(r[part][k] for r in rounds["new"])
            ratio = n / b if b > 0 else float("nan")
            if b > 0:
                ratios.append(ratio)
            lines.append(f"| {part} | {k} | {b:.4g} | {n:.4g} | {ratio:.2f} |")
    if ratios:
        lines += ["", f"{len(ratios)} numbers: ratio median {statistics.median(ratios):.3f}, "
                      f"min {min(ratios):.2f}, max {max(ratios):.2f}."]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
