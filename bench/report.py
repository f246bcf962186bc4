"""Turns the benchmark results of one bench/run.sh run into bench/results.md.

    /usr/bin/python3 bench/report.py --out bench/out [--seconds N] > bench/results.md
    /usr/bin/python3 bench/report.py --list      # SECTIONS as JSON

SECTIONS below is the one list of what results.md holds, in order: each
"## " section, the bench that writes its files into the --out directory (the
NAME of `run NAME ...` in bench/run.sh), the files it needs and those it only
reads. Every section is always printed:

* its files present: the section, built from them (JSON) or copied (markdown);
* skipped on purpose on this machine (a bench's markdown whose first line is
  "skipped: <reason>", or a JSON file holding {"skipped": "<reason>"}): the
  section says "Skipped on this machine: <reason>", and so does the end of
  the report; the exit status stays 0;
* a needed file missing, empty or unreadable: the section says what is
  missing and which bench should have written it (with its NAME.failed text,
  if it exited non-zero), and report.py exits 1 after printing everything,
  naming each missing section on stderr.

A .json or .md file in --out that no section reads also makes it exit 1 (a
bench whose output would never reach results.md). A bench that ran but
failed in part is listed under Failures with its error; no number is ever
filled in for it.
"""
import argparse
import datetime
import json
import os
import platform
import sys

# Files in --out that are not a section's: `make soak` writes soak.json there.
NOT_SECTIONS = {"soak.json"}
SKIPPED = "skipped:"


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


class Results:
    """The files of one run, and the failures met while reading them."""

    def __init__(self, out):
        self.out = out
        self.failures = []  # (what, why)
        self.skipped = []  # (section title, bench, reason)
        self.missing = []  # (section title, message)
        self._json = {}
        self.failed_runs = {}  # run.sh NAME -> its NAME.failed text
        for name in sorted(os.listdir(out)) if os.path.isdir(out) else []:
            if name.endswith(".failed"):
                with open(os.path.join(out, name)) as f:
                    why = f.read().strip()
                self.failed_runs[name[:-len(".failed")]] = why
                self.failures.append((name[:-len(".failed")], why))

    def path(self, name):
        return os.path.join(self.out, name)

    def json(self, name):
        """The parsed file (read once), or None, recorded as a failure."""
        if name not in self._json:
            try:
                with open(self.path(name)) as f:
                    self._json[name] = json.load(f)
            except (OSError, ValueError) as e:
                self.failures.append((name, f"no readable results ({e})"))
                self._json[name] = None
        return self._json[name]

    def text(self, name):
        try:
            with open(self.path(name)) as f:
                return f.read()
        except OSError:
            return ""

    def absent(self, name):
        """Why a needed file cannot make its section, or None when it can."""
        path = self.path(name)
        if not os.path.isfile(path):
            return "was not written"
        if os.path.getsize(path) == 0 or not self.text(name).strip():
            return "is empty"
        if name.endswith(".json"):
            try:
                with open(path) as f:
                    json.load(f)
            except (OSError, ValueError) as e:
                return f"is not readable JSON ({e})"
        return None

    def skip_reason(self, name):
        """The reason a bench gave for skipping its section on purpose, or None."""
        if name.endswith(".json"):
            d = self.json(name)
            return str(d["skipped"]) if isinstance(d, dict) and d.get("skipped") else None
        first = next((line.strip() for line in self.text(name).splitlines() if line.strip()),
                     "")
        if first.lower().startswith(SKIPPED):
            return first[len(SKIPPED):].strip() or "no reason given"
        return None

    def fail(self, what, why):
        self.failures.append((what, why))


def gbench_medians(data, res, source):
    """{benchmark name: median real time in ms} of a Google Benchmark JSON."""
    out = {}
    if data is None:
        return out
    for b in data.get("benchmarks", []):
        name = b.get("run_name", b["name"])
        # "BM_X/arg/iterations:10/repeats:3" -> "BM_X/arg"
        name = "/".join(p for p in name.split("/")
                        if not p.startswith(("iterations:", "repeats:")))
        if b.get("error_occurred"):
            res.fail(f"{source}: {name}", b.get("error_message", "failed"))
            continue
        if b.get("aggregate_name") == "median":
            scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
            out[name] = b["real_time"] * scale
    return out


def num(d, *keys):
    """d[k1][k2]... as a float, or None when a level failed or lacks it."""
    for k in keys:
        if not isinstance(d, dict) or "error" in d:
            return None
        d = d.get(k)
    return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def error_of(d):
    return d.get("error") if isinstance(d, dict) else None


def t_ms(v):
    """A time given in ms, in a readable unit."""
    if v is None:
        return "failed"
    if v < 1:
        return f"{v * 1000:.1f} µs"
    if v >= 1000:
        return f"{v / 1000:.1f} s"
    return f"{v:.1f} ms"


def t_us(v):
    if v is None:
        return "failed"
    if v >= 1000:
        return f"{v / 1000:.1f} ms"
    return f"{v:.0f} µs" if v >= 100 else f"{v:.1f} µs"


def gbs(v):
    return "failed" if v is None else f"{v:.2f} GB/s"


def ratio(a, b):
    if a is None or not b:
        return "n/a"
    r = a / b
    return f"{r:.2f}×" if r >= 0.1 else f"{r:.2g}× (1/{b / a:,.0f})"


def compile_section(med, py, res):
    def row(what, a, b, goal):
        ra, rb = med.get(a), med.get(b)
        return f"| {what} | {t_ms(ra)} | {t_ms(rb)} | {ratio(ra, rb)} | {goal} |"

    print("opjit's `KernelCompiler` in-process (the sandboxed clang worker, as the "
          "daemon runs it), against `g++` and `dlopen` as a subprocess, on a small kernel "
          "that includes `<cmath>`.\n")
    print("| what | opjit | peer | ratio | goal |")
    print("|---|---|---|---|---|")
    print(row("cold compile vs `g++ -O2 -shared -fPIC` + dlopen",
              "BM_OpjitColdCompileCmath", "BM_GccSharedDlopenCmath", "≤ 0.4×"))
    print(f"| memory-cache hit | {t_ms(med.get('BM_OpjitMemoryHit'))} | | | ≤ 50 µs |")
    print(row("first ATen kernel (builds its preamble's PCH) vs `g++ -O3 -shared -fPIC`",
              "BM_OpjitAtenFirstKernel", "BM_GccSharedAten", "≤ 1×"))
    print(row("second, different ATen kernel with the same includes vs `g++`",
              "BM_OpjitAtenSecondKernel", "BM_GccSharedAten", "≤ 1 s"))
    print(f"| disk-cache hit, freshly created compiler | "
          f"{t_ms(med.get('BM_OpjitDiskHitFreshCompiler'))} | | | ≤ 2 ms |")

    print("\nThe same kind of op through the whole system: `Compile` RPCs from the Python "
          "client to a running opjitd, against PyTorch's "
          "`torch.utils.cpp_extension.load_inline` of an equivalent op (softplus over a "
          "float32 tensor, `<cmath>`; Debian's python3-torch, ninja, "
          "`-O3 -march=native` like opjit's default).\n")
    tc = py.get("torch_compile") if isinstance(py, dict) else None
    if not isinstance(tc, dict) or "error" in tc:
        why = error_of(tc) or "py_bench produced no torch_compile section"
        res.fail("torch_compile", why)
        print(f"Not run: {why}\n")
        return
    torch_cold = num(tc, "cold_s", "median")
    torch_second = num(tc, "second_process_s", "median")
    ms = lambda k: num(tc, k, "median")  # noqa: E731
    print("| what | opjit (daemon, Python client) | torch load_inline | ratio |")
    print("|---|---|---|---|")
    cold = ms("opjit_daemon_cold_ms")
    print(f"| cold compile | {t_ms(cold)} | "
          f"{t_ms(None if torch_cold is None else torch_cold * 1e3)} | "
          f"{ratio(cold, None if torch_cold is None else torch_cold * 1e3)} |")
    restart = ms("opjit_daemon_disk_hit_after_restart_ms")
    print(f"| again in a second process (opjit: a restarted daemon, disk cache) | "
          f"{t_ms(restart)} | {t_ms(None if torch_second is None else torch_second * 1e3)} | "
          f"{ratio(restart, None if torch_second is None else torch_second * 1e3)} |")
    print(f"| again in the same process (memory cache) | {t_ms(ms('opjit_daemon_hit_ms'))} "
          f"| | |")
    imp = num(tc, "import_torch_s", "median")
    print(f"\n`import torch` itself takes {t_ms(None if imp is None else imp * 1e3)} and is "
          "not counted. opjit's daemon times include the RPC.")
    if tc.get("note"):
        print(f" {tc['note']}")
    for k in ("opjit_daemon_cold_ms", "opjit_daemon_hit_ms",
              "opjit_daemon_disk_hit_after_restart_ms", "cold_s", "second_process_s"):
        if error_of(tc.get(k)):
            res.fail(f"torch_compile.{k}", error_of(tc.get(k)))
    print()


def fairness_section(fair, res):
    if not isinstance(fair, dict) or error_of(fair):
        why = error_of(fair) or "fairness_bench wrote no object"
        res.fail("fairness", why)
        print(f"Not run: {why}\n")
        return
    limit = num(fair, "timeout_ms")
    print("Two compiles that would run for minutes (constant evaluation) hold both compile "
          f"workers until the {'?' if limit is None else f'{limit / 1000:.0f}'} s compile "
          "limit stops them; "
          "meanwhile small, distinct kernels compile one after another. Without the long lane "
          "a small compile waits for a bomb to be killed (at the default 30 s limit: ~30 s); "
          "with it, a compile still running after 1 s gives its worker slot back and goes on "
          "at a lower CPU priority.\n")
    idle = num(fair, "idle_median_ms")
    print("| | small compiles | median | worst | median vs idle |")
    print("|---|---|---|---|---|")
    print(f"| idle (no bombs) | | {t_ms(idle)} | | 1.00× |")
    for m in fair.get("modes", []):
        print(f"| during 2 bombs, {m.get('name')} | {m.get('samples', '')} "
              f"| {t_ms(num(m, 'median_ms'))} | {t_ms(num(m, 'worst_ms'))} "
              f"| {ratio(num(m, 'median_ms'), idle)} |")
    print()


def nvrtc_section(med):
    print("opjit: a cache miss through the pool of sandboxed NVRTC workers (warm; sm_80 and "
          "sm_90 on two of them at once; their PCHs of the prelude). Raw NVRTC: in the bench's "
          "process, no sandbox, no PCH, initialised by a first compile, one arch after the "
          "other.\n")
    print("| what | opjit | raw NVRTC | ratio | goal |")
    print("|---|---|---|---|---|")
    for what, a, b, goal in (
            ("cold compile of a small kernel", "BM_OpjitNvrtcCold", "BM_NvrtcRaw", "≤ 1.1×"),
            ("the same after a prelude (`cuda_fp16.h`, `cuda_bf16.h`, `cuda_fp8.h`)",
             "BM_OpjitNvrtcColdPrelude", "BM_NvrtcRawPrelude", "≤ 0.5×")):
        a, b = med.get(a), med.get(b)
        print(f"| {what} | {t_ms(a)} | {t_ms(b)} | {ratio(a, b)} | {goal} |")
    print(f"| memory-cache hit | {t_ms(med.get('BM_OpjitNvrtcMemoryHit'))} | | | ≤ 1 ms |\n")


def quality_section(med):
    print("| kernel | size | JIT | g++ | ratio | goal |")
    print("|---|---|---|---|---|---|")
    rows = (("elementwise", "Elementwise", 16 << 10, "16K floats (in cache)"),
            ("elementwise", "Elementwise", 16 << 20, "16M floats"),
            ("row reduction", "Reduction", 16 << 10, "16K floats"),
            ("row reduction", "Reduction", 16 << 20, "16M floats"),
            ("matmul", "Matmul", 64, "64×64"),
            ("matmul", "Matmul", 256, "256×256"))
    for what, kind, n, size in rows:
        a = med.get(f"BM_KernelJit/{kind}/{n}")
        b = med.get(f"BM_KernelGccO3Native/{kind}/{n}")
        print(f"| {what} | {size} | {t_ms(a)} | {t_ms(b)} | {ratio(a, b)} | ≤ 1.05× |")
    print()


def call_section(call, exec_med, res):
    if "error" in call:
        res.fail("call_bench", call["error"])
    if "config_error" in call:
        res.fail("opjitd with max_message_mb", call["config_error"])
    cfg = call.get("config", {})
    in_process = exec_med.get("BM_ExecutorForwardTiny")
    print(f"`leaky_relu` on 16 float32, inline in and out ({cfg.get('request_bytes', '?')}-byte "
          "request), through the C++ client's synchronous `Forward`, against a bare "
          f"callback-API gRPC echo of a {cfg.get('echo_payload_bytes', '?')}-byte payload "
          f"(echo server: {cfg.get('echo_server', '?')}). The sides alternate in short batches "
          "so they see the same machine state; each client has its own channel and "
          "connection. Per-call latency; calls/s over all clients. `opjit` runs the kernel in "
          "its sandboxed executor process (`[exec] isolation = \"process\"`, the default); "
          "`in-daemon` is a second opjitd with `isolation = \"in-daemon\"` (the kernel on the "
          "gRPC thread, unconfined), measured in the same alternation. \"no-op\" is opjitd's "
          "`ListRegions` on an empty namespace (the daemon's own RPC floor); `server` is the "
          "time inside the executor as the response reports it. The same call in-process "
          f"through `Executor::ForwardAsync`, no RPC at all (exec_bench): "
          f"**{t_ms(in_process)}** median.\n")
    print("| transport | clients | opjit p50 | opjit p99 | opjit calls/s | in-daemon p50 "
          "| process / in-daemon | goal | echo p50 | echo p99 | echo calls/s | opjit / echo "
          "| in-daemon / echo | goal | no-op p50 | server p50 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in call.get("call_overhead", []):
        o, e, n = r.get("opjit", {}), r.get("echo", {}), r.get("opjit_noop", {})
        i = r.get("opjit_in_daemon", {})
        for side, d in (("opjit", o), ("in-daemon", i), ("echo", e), ("no-op", n)):
            if error_of(d):
                res.fail(f"call overhead, {side}, {r.get('transport')}, {r.get('clients')} "
                         "clients", error_of(d))
        first = r.get("transport") == "unix" and r.get("clients") == 1
        goal = "≤ 1.1×" if first else ""
        cps = lambda d: "failed" if num(d, "calls_per_s") is None else f"{num(d, 'calls_per_s'):,.0f}"  # noqa: E731,E501
        server = num(o, "server_ms_p50")
        print(f"| {r.get('transport')} | {r.get('clients')} | {t_us(num(o, 'p50_us'))} "
              f"| {t_us(num(o, 'p99_us'))} | {cps(o)} | {t_us(num(i, 'p50_us'))} "
              f"| {ratio(num(o, 'p50_us'), num(i, 'p50_us'))} | {goal} "
              f"| {t_us(num(e, 'p50_us'))} "
              f"| {t_us(num(e, 'p99_us'))} | {cps(e)} "
              f"| {ratio(num(o, 'p50_us'), num(e, 'p50_us'))} "
              f"| {ratio(num(i, 'p50_us'), num(e, 'p50_us'))} | {goal} "
              f"| {t_us(num(n, 'p50_us'))} | {t_ms(server)} |")
    print("\nCPU used while each row ran (all four sides alternate, so a side runs a quarter "
          "of the wall time): the process-mode daemon, its executor processes, and the "
          "in-daemon daemon.\n")
    print("| transport | clients | wall | process daemon | its executors | in-daemon daemon |")
    print("|---|---|---|---|---|---|")
    for r in call.get("call_overhead", []):
        c = r.get("cpu", {})
        print(f"| {r.get('transport')} | {r.get('clients')} | {num(c, 'wall_s') or 0:.1f} s "
              f"| {num(c, 'process_daemon_s') or 0:.2f} s | {num(c, 'process_workers_s') or 0:.2f} s "
              f"| {num(c, 'in_daemon_s') or 0:.2f} s |")
    print()


def crash_section(call, res):
    cr = call.get("crash_recovery")
    if cr is None:
        res.fail("crash recovery", "call_bench recorded none")
        print("Not run: call_bench recorded no crash recovery (see Failures).\n")
        return
    if error_of(cr):
        res.fail("crash recovery", error_of(cr))
    print("A kernel segfaults its executor process (the caller gets ABORTED); then the "
          "same op is called again: a new executor starts, locks itself in, loads the "
          f"kernel and runs Init. Median of {int(num(cr, 'samples') or 0)} crashes: "
          f"**{t_ms(num(cr, 'median_ms'))}**, worst {t_ms(num(cr, 'max_ms'))}.\n")


def data_path_section(call, res):
    cfg = call.get("config", {})
    reps = next((int(num(r.get("shm"), "reps")) for r in call.get("data_path", [])
                 if num(r.get("shm"), "reps")), "?")
    print("Shared memory: input and output in one daemon-created region, output placed at a "
          "fixed offset; the call against the kernel's own time (`kernel_ms`). Inline: the "
          "same bytes in the request and the response (daemon and client at "
          f"max_message_mb = {cfg.get('max_message_mb', '?')}), next to a bare gRPC echo of a "
          "message of the same size. memcpy: in-process, pre-faulted buffers, the physical "
          "floor. GB/s is input bytes per second (each call moves that many in and out). "
          f"Medians of {reps} calls after one untimed call (3 for 256 MiB inline).\n")
    print("| size | shm call | kernel | call / kernel | goal | shm GB/s | inline call "
          "| inline GB/s | gRPC echo, same bytes | inline, in-daemon | memcpy | memcpy GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in call.get("data_path", []):
        size = r.get("size_mib")
        shm, inl, mc = r.get("shm", {}), r.get("inline"), r.get("memcpy", {})
        for what, d in (("shm", shm), ("inline", inl), ("memcpy", mc)):
            if error_of(d):
                res.fail(f"data path, {what}, {size} MiB", error_of(d))
        if inl is None:
            inline_cells = "not run (over 64 MiB) | | | "
        else:
            echo = inl.get("echo", {}) if isinstance(inl, dict) else {}
            if error_of(echo):
                res.fail(f"data path, inline echo, {size} MiB", error_of(echo))
            ind = r.get("inline_in_daemon")
            if error_of(ind):
                res.fail(f"data path, inline in-daemon, {size} MiB", error_of(ind))
            inline_cells = (f"{t_ms(num(inl, 'call_ms'))} | {gbs(num(inl, 'gb_per_s'))} "
                            f"| {t_ms(num(echo, 'call_ms'))} "
                            f"| {t_ms(num(ind, 'call_ms')) if ind else 'not run'}")
        goal = "≤ 1.1×" if size == 256 else ""
        print(f"| {size} MiB | {t_ms(num(shm, 'call_ms'))} | {t_ms(num(shm, 'kernel_ms'))} "
              f"| {ratio(num(shm, 'call_ms'), num(shm, 'kernel_ms'))} | {goal} "
              f"| {gbs(num(shm, 'gb_per_s'))} | {inline_cells} "
              f"| {t_ms(num(mc, 'ms'))} | {gbs(num(mc, 'gb_per_s'))} |")
    m = call.get("machine", {})
    print(f"\ncall_bench ran {call.get('total_s', 0):.0f} s; 1-minute load average "
          f"{m.get('loadavg_start')} at its start, {m.get('loadavg_end')} at its end.\n")


def autograd_section(py, res):
    ag = py.get("autograd") if isinstance(py, dict) else None
    if not isinstance(ag, dict) or "error" in ag:
        why = error_of(ag) or "py_bench produced no autograd section"
        res.fail("autograd", why)
        print(f"Not run: {why}\n")
        return
    print("Through the Python client (`/usr/bin/python3`, tensors in shared memory): "
          "**registered bprop** is `y = tanh(x); y.backward(g)` with the op's registered "
          "bprop `tanh_grad`: on the fast channel the client keeps the saved tensors and "
          "backward is `tanh_grad`'s call (two channel calls, no Backward RPC), over gRPC "
          "(fast=\"off\") the daemon keeps a context (one Forward and one Backward RPC); "
          "**opjit.Function** is a "
          "Paddle-PyLayer-style Function whose forward and backward each call a daemon op. "
          "Against a `torch.autograd.Function` with the same math (torch "
          f"{py.get('machine', {}).get('torch_version')}, {ag.get('torch_num_threads')} "
          "thread(s)) and plain numpy, the floor. Every variant's gradient is checked "
          "against numpy. The variants alternate in batches.\n")
    names = (("opjit_bprop", "opjit, registered bprop"), ("opjit_function", "opjit.Function"),
             ("opjit_bprop_grpc", "opjit, registered bprop, gRPC"),
             ("opjit_function_grpc", "opjit.Function, gRPC"),
             ("torch_function", "torch.autograd.Function"), ("numpy", "numpy"))
    optional = ("opjit_bprop_grpc", "opjit_function_grpc")  # absent from older runs
    print("| elements | variant | p50 | p99 | calls | p50 vs torch |")
    print("|---|---|---|---|---|---|")
    for n in ag.get("sizes", []):
        group = ag.get(f"n_{n}", {})
        torch_p50 = num(group.get("torch_function"), "p50_us")
        for key, label in names:
            d = group.get(key)
            if d is None and key in optional:
                continue
            if error_of(d):
                res.fail(f"autograd, {key}, n={n}", error_of(d))
            p50 = num(d, "p50_us")
            print(f"| {n:,} | {label} | {t_us(p50)} | {t_us(num(d, 'p99_us'))} "
                  f"| {d.get('n_calls', '') if isinstance(d, dict) else ''} "
                  f"| {ratio(p50, torch_p50)} |")
    print()



def markdown_body(text):
    """A bench's markdown without its own leading "## " heading (report.py titles it)."""
    lines = text.strip("\n").splitlines()
    while lines and not lines[0].strip():
        lines.pop(0)
    if lines and lines[0].startswith("## "):
        lines.pop(0)
    while lines and not lines[0].strip():
        lines.pop(0)
    return "\n".join(lines)


def fast_python_rows(py, res):
    """py_bench.py's "fast_path": the Python client on the fast channel and over gRPC."""
    fp = py.get("fast_path") if isinstance(py, dict) else None
    print("### Fast path (Python client)\n")
    if not isinstance(fp, dict) or error_of(fp):
        why = error_of(fp) or "py_bench produced no fast_path section"
        res.fail("fast_path (Python)", why)
        print(f"Not run: {why}\n")
        return
    print("`bench/py_bench.py` (`/usr/bin/python3`, numpy): the same client with the fast "
          "channel on and off, alternating in batches; the tiny call against a socketpair "
          "ping-pong between two Python processes, shm calls against the kernel's own "
          "`kernel_ms`.\n")
    print("| Python client | fast p50 | fast p99 | gRPC p50 | reference | fast / reference |")
    print("|---|---|---|---|---|---|")
    tiny = fp.get("tiny", {})
    f, g, sp = tiny.get("opjit_fast"), tiny.get("opjit_grpc"), tiny.get("socketpair_pingpong")
    print(f"| tiny call (16 float32, `leaky_relu`) | {t_us(num(f, 'p50_us'))} "
          f"| {t_us(num(f, 'p99_us'))} | {t_us(num(g, 'p50_us'))} "
          f"| socketpair ping-pong {t_us(num(sp, 'p50_us'))} "
          f"| {ratio(num(f, 'p50_us'), num(sp, 'p50_us'))} |")
    for label in ("1MiB", "64MiB"):
        e = fp.get("shm", {}).get(label)
        if not isinstance(e, dict):
            res.fail(f"fast_path (Python), shm {label}", "not in py.json")
            continue
        f, g = e.get("fast"), e.get("grpc")
        print(f"| {label[:-3]} MiB shm call (`tanh`) | {t_us(num(f, 'p50_us'))} "
              f"| {t_us(num(f, 'p99_us'))} | {t_us(num(g, 'p50_us'))} "
              f"| its kernel_ms {t_us(num(f, 'kernel_p50_us'))} "
              f"| {ratio(num(f, 'p50_us'), num(f, 'kernel_p50_us'))} |")
    print()
    prepared_python_rows(fp, res)


def prepared_python_rows(fp, res):
    """py_bench.py's "prepared" (absent from runs before it): the tiny call
    through opjit._fastcall and in pure Python, against torch's own calls."""
    pr = fp.get("prepared")
    if pr is None:
        return
    if error_of(pr):
        res.fail("fast_path (Python), prepared", error_of(pr))
        print(f"Prepared calls: not run: {error_of(pr)}\n")
        return
    tiny = fp.get("tiny", {})
    lib, fn = pr.get("torch_library_op"), pr.get("torch_autograd_function")
    print("The same `leaky_relu` on 16 float32 through the compiled extension "
          "(`opjit._fastcall`) and through the pure-Python channel, side by side with torch's "
          "in-process calls of the same op: a `torch.library` \"DEF\" op whose Python impl "
          "calls `F.leaky_relu`, and a `torch.autograd.Function`'s `apply`.\n")
    print("| Python tiny call | extension p50 | pure Python p50 | torch.library op p50 "
          "| autograd.Function p50 | extension / torch.library | goal |")
    print("|---|---|---|---|---|---|---|")
    for label, ext, pure, goal in (
            ("`Op.prepare`'d call, input in shm", pr.get("opjit_prepared"),
             pr.get("opjit_prepared_pure"), "≤ 1×"),
            ("`opjit.Op` call, input in shm", pr.get("opjit_op_shm"),
             pr.get("opjit_op_shm_pure"), ""),
            ("`opjit.Op` call, fresh ndarray", tiny.get("opjit_fast"),
             tiny.get("opjit_fast_pure"), "")):
        for d, what in ((ext, "extension"), (pure, "pure Python")):
            if error_of(d):
                res.fail(f"fast_path (Python), {label}, {what}", error_of(d))
        print(f"| {label} | {t_us(num(ext, 'p50_us'))} | {t_us(num(pure, 'p50_us'))} "
              f"| {t_us(num(lib, 'p50_us'))} | {t_us(num(fn, 'p50_us'))} "
              f"| {ratio(num(ext, 'p50_us'), num(lib, 'p50_us'))} | {goal} |")
    print()


def fast_section(res):
    print("`bench/fast_bench.cc` (C++ client) and `bench/py_bench.py` (Python client): "
          "prepared calls on the same-host fast channel against gRPC and against floors of "
          "our own (two processes ping-ponging a byte over a socketpair, and two handing a "
          "slot back and forth in shared memory), the sides alternating in one run.\n")
    print(markdown_body(res.text("fast.md")))
    print()
    fast_python_rows(res.json("py.json") if os.path.exists(res.path("py.json")) else None, res)


class Section:
    """One "## " section of results.md.

    bench: the program that writes its files; run: its NAME in bench/run.sh
    (`run NAME ...`, whose failure is NAME.failed); needs: files in --out
    without which the section is missing; reads: files it uses when present.
    render(res) prints the body (markdown sections: None, the file is copied).
    """

    def __init__(self, key, title, bench, run, needs, reads=(), render=None):
        self.key, self.title, self.bench, self.run = key, title, bench, run
        self.needs, self.reads, self.render = list(needs), list(reads), render

    def as_dict(self):
        return {"key": self.key, "title": self.title, "bench": self.bench, "run": self.run,
                "needs": self.needs, "reads": self.reads}


def _gbench(res, name, source):
    return gbench_medians(res.json(name) if os.path.exists(res.path(name)) else None,
                          res, source)


def _py(res):
    return (res.json("py.json") if os.path.exists(res.path("py.json")) else None) or {}


def _exec_med(res):
    if not os.path.exists(res.path("exec.json")):
        res.fail("exec.json", "exec_bench wrote nothing: the in-process number is missing")
        return {}
    return _gbench(res, "exec.json", "exec_bench")


# What bench/results.md holds, in this order. A bench added to bench/run.sh
# gets its section here, or its output never reaches results.md (report.py
# then exits 1 naming the stray file, and tests/python/check_bench_report.py
# fails).
SECTIONS = [
    Section("compile", "Compile", "compile_bench", "compile", ["compile.json"], ["py.json"],
            lambda r: compile_section(_gbench(r, "compile.json", "compile_bench"), _py(r), r)),
    Section("fairness", "A small compile during two template bombs", "fairness_bench",
            "fairness", ["fairness.json"],
            render=lambda r: fairness_section(r.json("fairness.json"), r)),
    Section("nvrtc", "NVRTC (compile only: no GPU here; sm_80 + sm_90 CUBIN and PTX)",
            "compile_bench", "compile", ["compile.json"],
            render=lambda r: nvrtc_section(_gbench(r, "compile.json", "compile_bench"))),
    Section("quality", "Kernel quality (JIT vs `g++ -O3 -march=native`, same source)",
            "compile_bench", "compile", ["compile.json"],
            render=lambda r: quality_section(_gbench(r, "compile.json", "compile_bench"))),
    Section("call", "Call overhead (cached tiny op)", "call_bench", "call", ["call.json"],
            ["exec.json"], lambda r: call_section(r.json("call.json"), _exec_med(r), r)),
    Section("crash", "A crashed executor, to the next good call", "call_bench", "call",
            ["call.json"], render=lambda r: crash_section(r.json("call.json"), r)),
    Section("data_path", "Data path (`leaky_relu`, float32)", "call_bench", "call",
            ["call.json"], render=lambda r: data_path_section(r.json("call.json"), r)),
    Section("fast", "Fast path (prepared calls on a shared-memory channel)", "fast_bench",
            "fast", ["fast.md"], ["fast.json", "py.json"], fast_section),
    Section("autograd", "Autograd (tanh forward + backward, float32, per call)",
            "bench/py_bench.py", "py", ["py.json"],
            render=lambda r: autograd_section(r.json("py.json"), r)),
    Section("plots", "Plots", "bench/plots.py", "plots", ["plots.md"]),
    Section("inline", "Inline tensors over TCP (remote clients)", "bench/inline_bench.py",
            "inline", ["inline.md"], ["inline.json"]),
    Section("auth", "Identity per call (tiny op, gRPC)", "auth_bench", "auth", ["auth.md"],
            ["auth.json"]),
    Section("zero", "Zero-filled outputs (shm, 1 MiB and 256 MiB)", "zero_bench", "zero",
            ["zero.md"], ["zero.json"]),
    Section("guard", "Guarded workspaces (per call: heap, kept guarded, fresh guarded)",
            "guard_bench", "guard", ["guard.md"], ["guard.json"]),
    Section("isolation", "Executor namespaces (executor start and tiny calls)",
            "isolation_bench", "isolation", ["isolation.md"], ["isolation.json"]),
    Section("userns", "A non-root daemon: user namespaces and subordinate ids",
            "bench/userns_bench.py", "userns", ["userns.md"], ["userns.json"]),
    Section("tenants", "Many tenants on one daemon", "bench/tenants_bench.py", "tenants",
            ["tenants.md"], ["tenants.json"]),
    Section("evaluate", "The evaluator's own cost (Verify, Benchmark)",
            "bench/evaluate_bench.py", "evaluate", ["evaluate.md"], ["evaluate.json"]),
]


def print_section(sec, res):
    print(f"## {sec.title}\n")
    absent = [(name, why) for name in sec.needs if (why := res.absent(name))]
    if absent:
        files = "; ".join(f"{os.path.join(res.out, n)} {why}" for n, why in absent)
        msg = (f"{files}: {sec.bench} (`run {sec.run}` in bench/run.sh) should have "
               "written it")
        if sec.run in res.failed_runs:
            msg += f" ({res.failed_runs[sec.run]})"
        res.missing.append((sec.title, msg))
        print(f"**Missing.** {msg}.\n")
        return
    reason = next((r for name in sec.needs if (r := res.skip_reason(name))), None)
    if reason is not None:
        res.skipped.append((sec.title, sec.bench, reason))
        print(f"Skipped on this machine: {reason}\n")
        return
    if sec.render is None:
        print(markdown_body(res.text(sec.needs[0])))
        print()
    else:
        sec.render(res)


def stray_files(res):
    """Outputs in --out that no section reads: they would never reach results.md."""
    known = {n for sec in SECTIONS for n in sec.needs + sec.reads} | NOT_SECTIONS
    names = sorted(os.listdir(res.out)) if os.path.isdir(res.out) else []
    return [n for n in names if n.endswith((".json", ".md")) and n not in known]


def print_failures(res):
    print("## Failures\n")
    if res.failures:
        for what, why in res.failures:
            print(f"- **{what}**: {why}")
    elif res.missing:
        print("Every benchmark that wrote its results ran; see Missing below.")
    elif res.skipped:
        print("None: every benchmark that runs on this machine ran; see Skipped below.")
    else:
        print("None: every benchmark ran.")
    if res.missing:
        print("\nMissing, so report.py exited 1:\n")
        for title, msg in res.missing:
            print(f"- **{title}**: {msg}")
    if res.skipped:
        print("\nSkipped on this machine, on purpose:\n")
        for title, bench, reason in res.skipped:
            print(f"- **{title}** ({bench}): {reason}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--seconds", type=int, default=None)
    ap.add_argument("--list", action="store_true", help="print SECTIONS as JSON and exit")
    args = ap.parse_args()
    if args.list:
        print(json.dumps([s.as_dict() for s in SECTIONS], indent=1))
        return 0
    res = Results(args.out)
    print("# opjit benchmark results\n")
    took = f" The run took {args.seconds / 60:.1f} minutes." if args.seconds else ""
    print(f"Machine: {os.cpu_count()} cores, {cpu_model()}. Date: "
          f"{datetime.date.today().isoformat()}. Reproduce with `make bench` (or "
          f"`bash bench/run.sh` on a build).{took} Medians; every ratio compares two "
          "sides measured in the same run. These cores are shared and noisy, so compare "
          "ratios rather than absolute times across runs.\n")
    for sec in SECTIONS:
        print_section(sec, res)
    for name in stray_files(res):
        res.missing.append((f"stray {name}", f"{os.path.join(res.out, name)} is read by no "
                            "section, so it never reaches results.md: add it to SECTIONS "
                            "in bench/report.py"))
    print_failures(res)
    sys.stdout.flush()
    if res.missing:
        print(f"report.py: the report is incomplete ({len(res.missing)} missing):",
              file=sys.stderr)
        for title, msg in res.missing:
            print(f"  {title}: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
