#!/usr/bin/env python3
"""Python-side benchmarks of opjit against PyTorch (and numpy as the floor).

    /usr/bin/python3 bench/py_bench.py OUT.json [--build build]

Starts its own opjitd (BUILD/bin/opjitd, a state dir in a temp directory,
listening on a unix socket there), stops it at exit, and writes OUT.json:

* "torch_compile": PyTorch's load_inline of a softplus op (fresh subprocess,
  empty build dir; then fresh subprocesses on the same build dir) next to
  opjitd's Compile of the same kernel in the aot ABI (cold, memory hit, disk
  hit after a daemon restart).
* "autograd": forward+backward of tanh per call at 1k and 1M float32
  elements: opjit with a registered bprop, an opjit.Function, a
  torch.autograd.Function, and plain numpy. The variants alternate in batches.
  With the fast channel the registered bprop runs from tensors the client
  keeps (forward and bprop are two channel calls, no Backward RPC);
  "opjit_bprop_grpc" is the same over gRPC (fast="off": the daemon keeps a
  context, one Forward and one Backward RPC).
* "fast_path": the same-host fast channel (issue 15) against gRPC, each
  measured side by side in one run, alternating in batches:
  - "tiny": leaky_relu on 16 float32 through the fast channel, through
    grpcio (the same client with fast="off"), and a raw socketpair
    ping-pong of a 94-byte message between two Python processes (the floor
    a socket-based transport cannot beat);
  - "shm": tanh on 1 MiB and 64 MiB already in shared memory, per call
    end to end against the kernel's own kernel_ms (fast and gRPC);
  - "prepared": the Python tiny call at its leanest, an Op.prepare'd call
    (opjit.PreparedCall) of leaky_relu on 16 float32 in shared memory,
    through the compiled extension opjit._fastcall and through the
    pure-Python channel (a second client with Transport.pure_python), next
    to plain Op calls on the same array both ways, and to torch's own
    in-process calls of the same op: a torch.library "DEF" op with a
    Python impl, and a torch.autograd.Function's apply;
  the autograd section also runs opjit.Function over gRPC (fast="off")
  next to the fast path.
* "machine": cores, CPU, date, versions, load average.

Every number comes from this run; a section (or sub-section) that fails holds
{"error": "..."} instead of numbers.
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

import numpy as np

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
EXAMPLES = os.path.join(REPO, "kernels", "examples")
MAX_SAMPLES = 2000          # raw latencies kept per variant
SUBPROCESS_TIMEOUT_S = 180  # per load_inline subprocess
TORCH_EXT_NAME = "opjit_bench_softplus"
# opjitd compiles with clang -O3 -march=native unless told otherwise
# (server/compiler/cpu/clang_frontend.cc); torch's build gets the same.
TORCH_CFLAGS = ["-O3", "-march=native"]

# The opjit benchmark kernel (bench/compile_bench.cc, kCmathKernel), aot ABI.
OPJIT_SOFTPLUS = r'''
#include <cmath>
#include <cstdint>
extern "C" int Softplus(int nparam, void** params, int* ndims, int64_t** shapes,
                        const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = std::log1p(std::exp(x[i]));
  return 0;
}
'''

# The same op as a PyTorch C++ extension.
TORCH_SOFTPLUS = r'''
#include <torch/extension.h>
#include <cmath>
#include <cstdint>
torch::Tensor softplus(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "softplus: float32 only");
  torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty_like(xc);
  const int64_t n = xc.numel();
  const float* px = xc.data_ptr<float>();
  float* py = y.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) py[i] = std::log1p(std::exp(px[i]));
  return y;
}
'''


# ---- small helpers -------------------------------------------------------------------

def median(xs):
    return statistics.median(xs) if xs else None


def timing(samples, **extra):
    """{"median": .., "samples": [..]} plus extra keys."""
    out = {"median": median(samples), "samples": list(samples)}
    out.update(extra)
    return out


def err(e):
    if isinstance(e, BaseException):
        text = "%s: %s" % (type(e).__name__, e)
    else:
        text = str(e)
    return {"error": text.strip()[:2000]}


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def mtime_ns(path):
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


# ---- the daemon ------------------------------------------------------------------------

class Daemon:
    """One opjitd on TMP/state, stopped with SIGTERM (then waited for)."""

    def __init__(self, build, tmp, opjit):
        self.binary = os.path.join(build, "bin", "opjitd")
        self.state = os.path.join(tmp, "state")
        self.socket = os.path.join(self.state, "opjitd.sock")
        self.address = "unix:" + self.socket
        self.log_path = os.path.join(tmp, "opjitd.log")
        self.opjit = opjit
        self.proc = None
        self.exits = []

    def start(self, timeout=30.0):
        os.makedirs(self.state, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [self.binary, "--state-dir", self.state, "--listen", self.address,
                 "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise RuntimeError("opjitd exited with %s before answering; log:\n%s"
                                   % (code, self.log_tail()))
            if os.path.exists(self.socket):
                try:
                    with self.opjit.Client(self.address, timeout=2) as c:
                        c.info()
                    return self
                except Exception as e:  # not listening yet
                    last = e
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("opjitd did not answer on %s within %.0f s (%s); log:\n%s"
                           % (self.address, timeout, last, self.log_tail()))

    def stop(self):
        p, self.proc = self.proc, None
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.exits.append(p.returncode)
        return p.returncode

    def log_tail(self, n=3000):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-n:]
        except OSError:
            return ""


# ---- torch load_inline in a child process ------------------------------------------------

def torch_child(build_dir):
    """Helper mode: import torch, load_inline the softplus op, check it; JSON on stdout."""
    out = {}
    t0 = time.perf_counter()
    import torch
    from torch.utils.cpp_extension import load_inline
    t1 = time.perf_counter()
    out["import_torch_s"] = t1 - t0
    out["torch_version"] = torch.__version__
    mod = load_inline(name=TORCH_EXT_NAME, cpp_sources=[TORCH_SOFTPLUS], functions=["softplus"],
                      build_directory=build_dir, extra_cflags=TORCH_CFLAGS, verbose=False)
    t2 = time.perf_counter()
    out["load_inline_s"] = t2 - t1
    x = np.linspace(-20.0, 20.0, 4099, dtype=np.float32)
    y = mod.softplus(torch.from_numpy(x)).numpy()
    want = np.log1p(np.exp(x))
    abs_err = float(np.max(np.abs(y.astype(np.float64) - want.astype(np.float64))))
    out["max_abs_err"] = abs_err
    out["result_ok"] = bool(np.allclose(y, want, rtol=1e-5, atol=1e-6))
    print("PY_BENCH_CHILD " + json.dumps(out), flush=True)


def run_child(build_dir, env):
    """Runs the helper mode in a fresh /usr/bin/python3; returns its dict (raises on failure)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-child", build_dir]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         start_new_session=True, text=True)
    def kill_group():
        # The child runs in its own session. SIGTERM first: ninja puts each
        # compiler in a process group of its own and only takes those down
        # itself when it is signalled (a SIGKILL would orphan them).
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        p.communicate()

    try:
        stdout, stderr = p.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_group()
        raise RuntimeError("load_inline subprocess ran past %d s" % SUBPROCESS_TIMEOUT_S)
    except BaseException:  # SIGTERM/SIGINT of this script: take the build down too
        kill_group()
        raise
    for line in stdout.splitlines():
        if line.startswith("PY_BENCH_CHILD "):
            return json.loads(line[len("PY_BENCH_CHILD "):])
    raise RuntimeError("load_inline subprocess exited %s: %s"
                       % (p.returncode, (stderr or stdout).strip()[-1500:]))


def bench_torch_load_inline(tmp, res):
    """Fills res with cold_s, second_process_s, import_torch_s, note (or errors)."""
    ext_dir = os.path.join(tmp, "torch_extensions")
    build_dir = os.path.join(ext_dir, "softplus_build")
    os.makedirs(build_dir)
    env = dict(os.environ)
    env["TORCH_EXTENSIONS_DIR"] = ext_dir
    res["extra_cflags"] = TORCH_CFLAGS
    res["subprocess_timeout_s"] = SUBPROCESS_TIMEOUT_S
    imports = []
    checks = []

    def files():
        return {name: mtime_ns(os.path.join(build_dir, name))
                for name in ("main.cpp", "main.o", TORCH_EXT_NAME + ".so")}

    try:
        r = run_child(build_dir, env)
        imports.append(r["import_torch_s"])
        checks.append(r)
        if not r["result_ok"]:
            raise RuntimeError("load_inline softplus does not match numpy (max abs err %g)"
                               % r["max_abs_err"])
        res["cold_s"] = timing([r["load_inline_s"]])
        res["torch_version"] = r["torch_version"]
    except Exception as e:
        res["cold_s"] = err(e)
        res["second_process_s"] = {"error": "skipped: the cold load_inline failed"}
        if imports:
            res["import_torch_s"] = timing(imports)
        return

    second, rebuilt = [], []
    try:
        for _ in range(2):
            before = files()
            r = run_child(build_dir, env)
            after = files()
            imports.append(r["import_torch_s"])
            checks.append(r)
            if not r["result_ok"]:
                raise RuntimeError("load_inline softplus does not match numpy (max abs err %g)"
                                   % r["max_abs_err"])
            second.append(r["load_inline_s"])
            rebuilt.append({name: (before[name] is None or after[name] is None
                                   or after[name] != before[name]) for name in before})
        res["second_process_s"] = timing(second, rewritten=rebuilt)
    except Exception as e:
        res["second_process_s"] = err(e)
    res["import_torch_s"] = timing(imports)
    res["max_abs_err_vs_numpy"] = max(c["max_abs_err"] for c in checks)

    # ninja's own record: one line per build of main.o.
    try:
        with open(os.path.join(build_dir, ".ninja_log")) as f:
            res["ninja_log_main_o_builds"] = sum(
                1 for line in f if not line.startswith("#") and line.split("\t")[3:4] == ["main.o"])
    except OSError as e:
        res["ninja_log_main_o_builds"] = err(e)
    if second:
        cold = res["cold_s"]["median"]
        n_rebuilt = sum(1 for r in rebuilt if r["main.o"])
        res["main_o_rebuilt_in_second_process"] = [r["main.o"] for r in rebuilt]
        if n_rebuilt:
            res["note"] = (
                "main.o was rebuilt in %d of %d second-process runs (its mtime changed; "
                "ninja's log lists %s builds of it over the %d processes): "
                "torch %s's load_inline rewrites <build_directory>/main.cpp on every call, "
                "so the file is newer than main.o and ninja recompiles and relinks even "
                "though the source is identical; the build directory is no cache across "
                "processes (second-process median %.1f s vs cold %.1f s)."
                % (n_rebuilt, len(rebuilt), res.get("ninja_log_main_o_builds"), 1 + len(second),
                   res.get("torch_version", "?"), median(second),
                   cold))
        else:
            res["note"] = ("main.o was not rebuilt in the second-process runs (mtime "
                           "unchanged): ninja found the build up to date.")


# ---- compiles through the daemon -----------------------------------------------------------

def bench_opjit_compile(client_factory, daemon, res):
    """opjit_daemon_cold_ms, _hit_ms and _disk_hit_after_restart_ms, each failing alone."""
    res["opjit_compile_options"] = []  # the server's defaults
    client = client_factory()
    # The daemon's first compile (compiler start-up): recorded, not in the cold median.
    try:
        t0 = time.perf_counter()
        r = client.compile(OPJIT_SOFTPLUS + "// warm-up %s\n" % uuid.uuid4().hex,
                           entry="Softplus", language="c++")
        res["opjit_daemon_first_compile_ms"] = {
            "ms": (time.perf_counter() - t0) * 1e3, "cache_hit": r.cache_hit,
            "server_compile_ms": r.compile_ms}
    except Exception as e:
        res["opjit_daemon_first_compile_ms"] = err(e)

    try:
        samples, server_total, server_compile, hits = [], [], [], []
        for i in range(5):
            src = OPJIT_SOFTPLUS + "// cold %d %s\n" % (i, uuid.uuid4().hex)
            t0 = time.perf_counter()
            r = client.compile(src, entry="Softplus", language="c++")
            samples.append((time.perf_counter() - t0) * 1e3)
            if r.cache_hit:
                raise RuntimeError("a uniquely commented source was a %r cache hit" % r.cache_hit)
            if "Softplus" not in r.defined_symbols:
                raise RuntimeError("compiled object lacks Softplus (defines %s)"
                                   % list(r.defined_symbols))
            server_total.append(r.total_ms)
            server_compile.append(r.compile_ms)
            hits.append(r.cache_hit)
        res["opjit_daemon_cold_ms"] = timing(samples, server_total_ms=server_total,
                                             server_compile_ms=server_compile, cache_hit=hits)
    except Exception as e:
        res["opjit_daemon_cold_ms"] = err(e)

    try:
        first = client.compile(OPJIT_SOFTPLUS, entry="Softplus", language="c++")
        samples, server_total, kinds = [], [], set()
        for _ in range(5):  # warm-up
            client.compile(OPJIT_SOFTPLUS, entry="Softplus", language="c++")
        for _ in range(50):
            t0 = time.perf_counter()
            r = client.compile(OPJIT_SOFTPLUS, entry="Softplus", language="c++")
            samples.append((time.perf_counter() - t0) * 1e3)
            server_total.append(r.total_ms)
            kinds.add(r.cache_hit)
            if r.cache_key != first.cache_key:
                raise RuntimeError("cache key changed between identical compiles")
        if kinds != {"memory"}:
            raise RuntimeError("expected only memory hits, got cache_hit values %s"
                               % sorted(kinds))
        res["opjit_daemon_hit_ms"] = timing(samples, server_total_ms=server_total,
                                            cache_hit=sorted(kinds))
    except Exception as e:
        res["opjit_daemon_hit_ms"] = err(e)
    client.close()

    # Restart the daemon on the same state dir: the compile should be a disk hit.
    samples, server_total, kinds = [], [], []
    try:
        for _ in range(3):
            daemon.stop()
            daemon.start()
            c = client_factory()
            c.info()  # connect first: time the compile, not the channel set-up
            t0 = time.perf_counter()
            r = c.compile(OPJIT_SOFTPLUS, entry="Softplus", language="c++")
            samples.append((time.perf_counter() - t0) * 1e3)
            server_total.append(r.total_ms)
            kinds.append(r.cache_hit)
            c.close()
        out = timing(samples, server_total_ms=server_total, cache_hit=kinds)
        if any(k != "disk" for k in kinds):
            out["warning"] = "not every compile after a restart was a disk hit"
        res["opjit_daemon_disk_hit_after_restart_ms"] = out
    except Exception as e:
        res["opjit_daemon_disk_hit_after_restart_ms"] = err(e)


# ---- autograd ------------------------------------------------------------------------------

def percentile(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


def bench_autograd(opjit, client, res, torch, grpc_client=None):
    client.register(os.path.join(EXAMPLES, "tanh_grad.json"))
    client.register(os.path.join(EXAMPLES, "tanh.json"))
    tanh = client.op("tanh")
    tanh_grad = client.op("tanh_grad")

    class OpjitTanh(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            y = tanh(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, dy):
            y, = ctx.saved_tensor()
            # tanh_grad's inputs are (x optional, y, dy); x is not needed.
            return tanh_grad(y=y, dy=dy)

    def opjit_bprop(arr, g, _):
        x = opjit.tensor(arr, requires_grad=True)
        y = tanh(x)
        y.backward(g)
        return x.grad

    def opjit_function(arr, g, _):
        x = opjit.tensor(arr, requires_grad=True)
        z = OpjitTanh.apply(x)
        z.backward(g)
        return x.grad

    def numpy_variant(arr, g, _):
        y = np.tanh(arr)
        return g * (1.0 - y * y)

    variants = [("opjit_bprop", opjit_bprop), ("opjit_function", opjit_function)]
    if grpc_client is not None:
        tanh_g = grpc_client.op("tanh")
        tanh_grad_g = grpc_client.op("tanh_grad")

        class OpjitTanhGrpc(opjit.Function):
            @staticmethod
            def forward(ctx, x):
                y = tanh_g(x)
                ctx.save_for_backward(y)
                return y

            @staticmethod
            def backward(ctx, dy):
                y, = ctx.saved_tensor()
                return tanh_grad_g(y=y, dy=dy)

        def opjit_function_grpc(arr, g, _):
            x = opjit.tensor(arr, requires_grad=True)
            z = OpjitTanhGrpc.apply(x)
            z.backward(g)
            return x.grad

        def opjit_bprop_grpc(arr, g, _):
            x = opjit.tensor(arr, requires_grad=True)
            y = tanh_g(x)
            y.backward(g)
            return x.grad

        variants.append(("opjit_function_grpc", opjit_function_grpc))
        variants.append(("opjit_bprop_grpc", opjit_bprop_grpc))
    if torch is not None:
        class TorchTanh(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                y = torch.tanh(x)
                ctx.save_for_backward(y)
                return y

            @staticmethod
            def backward(ctx, dy):
                y, = ctx.saved_tensors
                return dy * (1 - y * y)

        def torch_function(arr, g, g_torch):
            x = torch.from_numpy(arr).requires_grad_()
            z = TorchTanh.apply(x)
            z.backward(g_torch)
            return x.grad

        variants.append(("torch_function", torch_function))
    variants.append(("numpy", numpy_variant))

    res["torch_num_threads"] = torch.get_num_threads() if torch is not None else None
    res["grad_check"] = {"rtol": 1e-5, "atol": 1e-6, "reference": "numpy float32: "
                         "g * (1 - tanh(x)^2)"}
    res["timed"] = ("one call: wrap x, forward, backward(g), read x.grad; "
                    "variants alternate in batches, the order rotating each round")
    if torch is None:
        res["torch_function_skipped"] = "torch is not importable"

    rng = np.random.default_rng(1234)
    plan = [(1000, 10, 20, 10), (1_000_000, 3, 10, 3)]  # n, batch, rounds, warm-up calls
    res["sizes"] = [p[0] for p in plan]
    for n, batch, rounds, warmup in plan:
        arr = rng.standard_normal(n).astype(np.float32)
        g = rng.uniform(-1.5, 1.5, n).astype(np.float32)
        y_ref = np.tanh(arr)
        ref = g * (1.0 - y_ref * y_ref)
        g_torch = torch.from_numpy(g) if torch is not None else None
        out = {}
        live = []

        def check(name, gx):
            if gx is None:
                raise RuntimeError("x.grad is None after backward")
            if hasattr(gx, "detach"):
                gx = gx.detach().numpy()
            gx = np.asarray(gx)
            if gx.shape != ref.shape or gx.dtype != np.float32:
                raise RuntimeError("gradient has shape %s dtype %s, want %s float32"
                                   % (gx.shape, gx.dtype, ref.shape))
            if not np.allclose(gx, ref, rtol=1e-5, atol=1e-6):
                raise RuntimeError("gradient mismatch vs numpy: max abs err %g"
                                   % float(np.max(np.abs(gx.astype(np.float64) - ref))))
            return float(np.max(np.abs(gx.astype(np.float64) - ref)))

        for name, fn in variants:
            try:
                for _ in range(warmup):
                    gx = fn(arr, g, g_torch)
                out[name] = {"max_abs_err_warmup": check(name, gx)}
                del gx
                live.append((name, fn))
            except Exception as e:
                out[name] = err(e)
        samples = {name: [] for name, _ in live}
        failed = {}
        for rnd in range(rounds):
            k = rnd % len(live) if live else 0
            for name, fn in live[k:] + live[:k]:
                if name in failed:
                    continue
                try:
                    for _ in range(batch):
                        t0 = time.perf_counter_ns()
                        gx = fn(arr, g, g_torch)
                        samples[name].append((time.perf_counter_ns() - t0) / 1e3)
                    if rnd == rounds - 1:
                        out[name]["max_abs_err_last"] = check(name, gx)
                    del gx
                except Exception as e:
                    failed[name] = e
        for name, _ in live:
            if name in failed:
                out[name] = err(failed[name])
                continue
            s = samples[name]
            out[name].update({
                "p50_us": percentile(s, 50), "p99_us": percentile(s, 99),
                "mean_us": float(np.mean(s)), "min_us": float(np.min(s)),
                "n_calls": len(s), "samples_us": [round(v, 2) for v in s[:MAX_SAMPLES]]})
        res["n_%d" % n] = out


# ---- the fast path -------------------------------------------------------------------------

ECHO_CHILD = r"""
import os, socket, sys
s = socket.socket(fileno=int(sys.argv[1]))
while True:
    b = s.recv(65536)
    if not b:
        break
    s.sendall(b)
"""


def alternate(variants, batch, rounds, warmup):
    """{name: [latency us]}: each variant runs `batch` calls per round, the
    order rotating each round; `warmup` untimed calls first."""
    for _, fn in variants:
        for _ in range(warmup):
            fn()
    samples = {name: [] for name, _ in variants}
    clock = time.perf_counter_ns
    for rnd in range(rounds):
        k = rnd % len(variants)
        for name, fn in variants[k:] + variants[:k]:
            out = samples[name]
            for _ in range(batch):
                t0 = clock()
                fn()
                out.append((clock() - t0) / 1e3)
    return samples


def stats_us(s):
    return {"p50_us": percentile(s, 50), "p99_us": percentile(s, 99),
            "mean_us": float(np.mean(s)), "min_us": float(np.min(s)), "n_calls": len(s),
            "samples_us": [round(v, 2) for v in s[:MAX_SAMPLES]]}


def bench_fast_path(opjit, daemon, res, torch=None):
    fast = opjit.Client(daemon.address, timeout=120, fast="on")
    grpc_client = opjit.Client(daemon.address, timeout=120, fast="off")
    # The same client on the pure-Python channel (its calls never touch
    # opjit._fastcall), to compare both paths in one process.
    pure = opjit.Client(daemon.address, timeout=120, fast="on")
    pure._transport.pure_python = True
    a, b = socket.socketpair()
    echo = subprocess.Popen([sys.executable, "-c", ECHO_CHILD, str(b.fileno())],
                            pass_fds=[b.fileno()])
    b.close()
    try:
        fast.register(os.path.join(EXAMPLES, "leaky_relu.json"))
        fast.register(os.path.join(EXAMPLES, "tanh_grad.json"))
        fast.register(os.path.join(EXAMPLES, "tanh.json"))
        res["channel"] = {"spin_us": fast._transport.channel(fast.namespace).spin_ns / 1000}

        # 1. A tiny call.
        x16 = np.linspace(-1, 1, 16, dtype=np.float32)
        lr_fast, lr_grpc = fast.op("leaky_relu"), grpc_client.op("leaky_relu")
        lr_pure = pure.op("leaky_relu")
        np.testing.assert_allclose(lr_fast(x16), lr_grpc(x16))
        np.testing.assert_allclose(lr_pure(x16), lr_grpc(x16))
        msg = b"x" * 94

        def ping():
            a.sendall(msg)
            got = 0
            while got < len(msg):
                got += len(a.recv(65536))

        before = fast.call_counts()["fast"], pure.call_counts()["fast"]
        tiny = alternate([("opjit_fast", lambda: lr_fast(x16)),
                          ("opjit_fast_pure", lambda: lr_pure(x16)),
                          ("opjit_grpc", lambda: lr_grpc(x16)),
                          ("socketpair_pingpong", ping)], batch=200, rounds=20, warmup=200)
        if fast.call_counts()["fast"] - before[0] < 4000 or \
                pure.call_counts()["fast"] - before[1] < 4000:
            raise RuntimeError("the fast client did not use the fast channel")
        res["tiny"] = {k: stats_us(v) for k, v in tiny.items()}
        res["tiny"]["what"] = ("leaky_relu on 16 float32 (a fresh ndarray each call: copied into "
                               "shared memory, output a view), vs a 94-byte socketpair echo "
                               "between two Python processes; opjit_fast_pure: the same client "
                               "on the pure-Python channel")
        res["tiny"]["extension"] = fast._transport.channel(fast.namespace).__class__.__name__
        p50 = {k: v["p50_us"] for k, v in res["tiny"].items() if isinstance(v, dict)}
        res["tiny"]["ratios_p50"] = {
            "fast / socketpair": p50["opjit_fast"] / p50["socketpair_pingpong"],
            "grpc / socketpair": p50["opjit_grpc"] / p50["socketpair_pingpong"],
            "grpc / fast": p50["opjit_grpc"] / p50["opjit_fast"],
            "fast pure / fast": p50["opjit_fast_pure"] / p50["opjit_fast"]}

        # 1b. The same op as a prepared call, against torch's in-process calls.
        try:
            bench_prepared(opjit, fast, pure, torch, res)
        except Exception as e:
            traceback.print_exc()
            res["prepared"] = err(e)

        # 2. Big tensors already in shared memory: the call against the kernel's time.
        out = {}
        for label, nbytes, batch, rounds in (("1MiB", 1 << 20, 20, 10),
                                             ("64MiB", 64 << 20, 2, 5)):
            n = nbytes // 4
            row = {}
            kernel = {"fast": [], "grpc": []}
            for path, c in (("fast", fast), ("grpc", grpc_client)):
                xs = c.asarray(np.random.default_rng(5).standard_normal(n).astype(np.float32))
                sess = c.session()

                def call(sess=sess, xs=xs, path=path):
                    r = sess.forward("tanh", [[xs]])
                    kernel[path].append(r.kernel_ms * 1e3)
                    return r
                row[path] = call
            samples = alternate(list(row.items()), batch=batch, rounds=rounds, warmup=2)
            entry = {}
            for path in ("fast", "grpc"):
                k = kernel[path][-len(samples[path]):]
                st = stats_us(samples[path])
                st["kernel_p50_us"] = percentile(k, 50)
                st["call_over_kernel_p50"] = st["p50_us"] / st["kernel_p50_us"]
                entry[path] = st
            entry["grpc / fast"] = entry["grpc"]["p50_us"] / entry["fast"]["p50_us"]
            out[label] = entry
        res["shm"] = out
        res["shm"]["what"] = ("tanh on float32 already in this client's shared memory "
                              "(Client.asarray), output a view; Session.forward end to end "
                              "vs the kernel_ms the executor reports for that call")
    finally:
        a.close()
        echo.wait(10)
        fast.close()
        grpc_client.close()
        pure.close()


def bench_prepared(opjit, fast, pure, torch, res):
    """res["prepared"]: the tiny call as an Op.prepare'd call (the compiled
    extension, and pure Python) and as plain Op calls on the same shm array,
    against torch.library and torch.autograd.Function calls of leaky_relu."""
    from opjit import _fast
    x = np.linspace(-1, 1, 16, dtype=np.float32)
    want = np.where(x > 0, x, np.float32(0.01) * x)
    variants, extra = [], {}
    if _fast.EXTENSION is not None:
        xs = fast.asarray(x)
        call = fast.op("leaky_relu").prepare(xs)
        np.testing.assert_allclose(call(), want, rtol=1e-6)
        if call.path != "fast" or not isinstance(call, _fast.EXTENSION.Call):
            raise RuntimeError("the prepared call is not on the extension's fast channel")
        op = fast.op("leaky_relu")
        variants += [("opjit_prepared", call), ("opjit_op_shm", lambda: op(xs))]
    else:
        extra["opjit_prepared"] = {"error": "opjit._fastcall is not built (or not importable)"}
    xp = pure.asarray(x)
    pcall = pure.op("leaky_relu").prepare(xp)
    np.testing.assert_allclose(pcall(), want, rtol=1e-6)
    if pcall.path != "fast" or isinstance(pcall, getattr(_fast.EXTENSION, "Call", ())):
        raise RuntimeError("the pure-Python prepared call is not on a pure-Python channel")
    pop = pure.op("leaky_relu")
    variants += [("opjit_prepared_pure", pcall), ("opjit_op_shm_pure", lambda: pop(xp))]
    if torch is not None:
        F = torch.nn.functional
        lib = torch.library.Library("opjit_py_bench", "DEF")
        lib.define("leaky_relu(Tensor x) -> Tensor")
        lib.impl("leaky_relu", lambda t: F.leaky_relu(t, 0.01), "CPU")
        torch_op = torch.ops.opjit_py_bench.leaky_relu

        class LeakyRelu(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return F.leaky_relu(t, 0.01)

            @staticmethod
            def backward(ctx, g):  # never called: no input requires grad
                return g

        xt = torch.from_numpy(x.copy())
        np.testing.assert_allclose(torch_op(xt).numpy(), want, rtol=1e-6)
        np.testing.assert_allclose(LeakyRelu.apply(xt).numpy(), want, rtol=1e-6)
        variants += [("torch_library_op", lambda: torch_op(xt)),
                     ("torch_autograd_function", lambda: LeakyRelu.apply(xt))]
    else:
        extra["torch_library_op"] = {"error": "torch is not importable"}
    before = pure.call_counts()["fast"]
    samples = alternate(variants, batch=200, rounds=30, warmup=500)
    if pure.call_counts()["fast"] - before < 2 * 30 * 200:
        raise RuntimeError("the pure-Python client did not use the fast channel")
    out = {k: stats_us(v) for k, v in samples.items()}
    out.update({k: v for k, v in extra.items() if isinstance(v, dict)})
    out["what"] = ("leaky_relu on 16 float32 in shared memory: opjit_prepared is "
                   "client.op('leaky_relu').prepare(x) called again and again (opjit._fastcall), "
                   "opjit_prepared_pure the same on the pure-Python channel, opjit_op_shm(_pure) "
                   "plain Op calls on the same array; torch_library_op a torch.library 'DEF' op "
                   "whose Python impl calls F.leaky_relu, torch_autograd_function a "
                   "torch.autograd.Function's apply of F.leaky_relu (no grad), on a 16-float "
                   "tensor, in process")
    p50 = {k: v["p50_us"] for k, v in out.items() if isinstance(v, dict) and "p50_us" in v}
    ratios = {}
    for a, b in (("opjit_prepared", "torch_library_op"),
                 ("opjit_prepared", "torch_autograd_function"),
                 ("opjit_prepared_pure", "torch_library_op"),
                 ("opjit_prepared_pure", "opjit_prepared"),
                 ("opjit_op_shm_pure", "opjit_op_shm"),
                 ("opjit_op_shm", "opjit_prepared")):
        if a in p50 and b in p50:
            ratios["%s / %s" % (a, b)] = p50[a] / p50[b]
    out["ratios_p50"] = ratios
    res["prepared"] = out


# ---- main ------------------------------------------------------------------------------

def machine_info(torch):
    return {
        "cores": os.cpu_count(),
        "cpu_model": cpu_model(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "torch_version": torch.__version__ if torch is not None else None,
        "numpy_version": np.__version__,
        "loadavg_start": loadavg(),
    }


def fmt_ms(d, key="median"):
    if not isinstance(d, dict) or "error" in d or d.get(key) is None:
        return "failed (%s)" % (d.get("error", "?")[:80] if isinstance(d, dict) else "?")
    return "%.2f ms" % d[key]


def fmt_s(d):
    if not isinstance(d, dict) or "error" in d or d.get("median") is None:
        return "failed (%s)" % (d.get("error", "?")[:80] if isinstance(d, dict) else "?")
    return "%.1f s" % d["median"]


def summary(result):
    lines = []
    tc = result.get("torch_compile")
    if tc is None:
        pass
    elif "error" in tc:
        lines.append("torch_compile: failed: %s" % tc["error"][:200])
    else:
        lines.append("compile, softplus:")
        lines.append("  torch load_inline cold            %s (import torch %s)"
                     % (fmt_s(tc.get("cold_s")), fmt_s(tc.get("import_torch_s"))))
        lines.append("  torch load_inline 2nd process     %s" % fmt_s(tc.get("second_process_s")))
        if tc.get("note"):
            lines.append("    note: " + tc["note"])
        lines.append("  opjitd compile cold (client)      %s" % fmt_ms(tc.get("opjit_daemon_cold_ms")))
        lines.append("  opjitd compile memory hit         %s" % fmt_ms(tc.get("opjit_daemon_hit_ms")))
        d = tc.get("opjit_daemon_disk_hit_after_restart_ms")
        lines.append("  opjitd compile after restart      %s%s" % (
            fmt_ms(d), " (cache_hit %s)" % d.get("cache_hit") if isinstance(d, dict)
            and "cache_hit" in d else ""))
    ag = result.get("autograd", {})
    if ag and "error" in ag:
        lines.append("autograd: failed: %s" % ag["error"][:200])
    else:
        for n in ag.get("sizes", []):
            lines.append("autograd tanh fwd+bwd, n=%d (p50 / p99 per call):" % n)
            for name, v in ag.get("n_%d" % n, {}).items():
                if "error" in v:
                    lines.append("  %-15s failed: %s" % (name, v["error"][:160]))
                else:
                    lines.append("  %-20s %10.1f us / %10.1f us  (%d calls)"
                                 % (name, v["p50_us"], v["p99_us"], v["n_calls"]))
            row = ag.get("n_%d" % n, {})
            t = row.get("torch_function", {}).get("p50_us")
            for name in ("opjit_function", "opjit_function_grpc", "opjit_bprop",
                         "opjit_bprop_grpc"):
                v = row.get(name, {}).get("p50_us")
                if t and v:
                    lines.append("  %s / torch_function p50: %.2fx" % (name, v / t))
    fp = result.get("fast_path", {})
    if "error" in fp:
        lines.append("fast path: failed: %s" % fp["error"][:200])
    elif fp:
        lines.append("tiny call, leaky_relu on 16 float32 (p50 / p99):")
        for name in ("opjit_fast", "opjit_fast_pure", "opjit_grpc", "socketpair_pingpong"):
            if name not in fp["tiny"]:
                continue
            v = fp["tiny"][name]
            lines.append("  %-20s %8.1f us / %8.1f us" % (name, v["p50_us"], v["p99_us"]))
        for k, v in fp["tiny"]["ratios_p50"].items():
            lines.append("  %-20s %8.2fx" % (k, v))
        pr = fp.get("prepared", {})
        if "error" in pr:
            lines.append("prepared tiny call: failed: %s" % pr["error"][:200])
        elif pr:
            lines.append("prepared tiny call, leaky_relu on 16 float32 in shm (p50 / p99):")
            for name, v in pr.items():
                if isinstance(v, dict) and "p50_us" in v:
                    lines.append("  %-24s %8.2f us / %8.2f us" % (name, v["p50_us"], v["p99_us"]))
                elif isinstance(v, dict) and "error" in v:
                    lines.append("  %-24s not run: %s" % (name, v["error"][:120]))
            for k, v in pr.get("ratios_p50", {}).items():
                lines.append("  %-44s %6.2fx" % (k, v))
        for label in ("1MiB", "64MiB"):
            e = fp["shm"][label]
            for path in ("fast", "grpc"):
                v = e[path]
                lines.append("tanh %-5s %-4s call p50 %9.1f us, kernel %9.1f us: %.2fx the kernel"
                             % (label, path, v["p50_us"], v["kernel_p50_us"],
                                v["call_over_kernel_p50"]))
    return "\n".join(lines)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--torch-child":
        torch_child(sys.argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output JSON")
    ap.add_argument("--build", default=os.path.join(REPO, "build"), help="build directory")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temp directory")
    ap.add_argument("--only", choices=("autograd", "fast_path"), action="append",
                    help="run only these sections (repeatable; default: all)")
    args = ap.parse_args()
    build = os.path.abspath(args.build)

    # SIGTERM/SIGINT unwind through the finally below, which stops the daemon.
    def on_signal(signum, _frame):
        print("py_bench: signal %d: stopping opjitd and any build, writing no JSON" % signum,
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_signal)

    started = time.monotonic()
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install
        torch = None
        torch_error = "cannot import torch: %s: %s" % (type(e).__name__, e)
    result = {"machine": machine_info(torch)}
    tmp = tempfile.mkdtemp(prefix="opjit-py-bench-")
    result["config"] = {"build": build, "opjitd": os.path.join(build, "bin", "opjitd")}
    daemon = None
    opjit = None
    try:
        try:
            sys.path.insert(0, os.path.join(build, "python"))
            import opjit as opjit_mod
            opjit = opjit_mod
        except Exception as e:
            opjit_error = err("cannot import opjit from %s/python: %s: %s"
                              % (build, type(e).__name__, e))
        daemon_error = None
        if opjit is not None:
            daemon = Daemon(build, tmp, opjit)
            try:
                daemon.start()
            except Exception as e:
                daemon_error = err(e)
        else:
            daemon_error = opjit_error

        def client_factory():
            return opjit.Client(daemon.address, timeout=120)

        def wanted(section):
            return not args.only or section in args.only

        # 1. autograd
        if not wanted("autograd"):
            pass
        elif daemon_error:
            result["autograd"] = daemon_error
        else:
            ag = {}
            client = client_factory()
            grpc_client = opjit.Client(daemon.address, timeout=120, fast="off")
            try:
                bench_autograd(opjit, client, ag, torch, grpc_client)
                ag["client_transport"] = client.transport
                ag["client_fast"] = client.fast
                ag["calls_by_path"] = client.call_counts()
                result["autograd"] = ag
            except Exception as e:
                traceback.print_exc()
                result["autograd"] = err(e)
            finally:
                client.close()
                grpc_client.close()

        # 1b. the fast path against gRPC and a raw socket
        if not wanted("fast_path"):
            pass
        elif daemon_error:
            result["fast_path"] = daemon_error
        else:
            fp = {}
            try:
                bench_fast_path(opjit, daemon, fp, torch)
                result["fast_path"] = fp
            except Exception as e:
                traceback.print_exc()
                result["fast_path"] = err(e)

        # 2. compiles: the daemon's, then torch's (subprocesses)
        tc = {}
        if args.only:
            torch = None  # skipped below
            torch_error = "not asked for (--only)"
        else:
            result["torch_compile"] = tc
        if args.only:
            pass
        elif daemon_error:
            for k in ("opjit_daemon_cold_ms", "opjit_daemon_hit_ms",
                      "opjit_daemon_disk_hit_after_restart_ms"):
                tc[k] = daemon_error
        else:
            try:
                bench_opjit_compile(client_factory, daemon, tc)
            except Exception as e:
                traceback.print_exc()
                tc["opjit_daemon_error"] = err(e)["error"]
        if daemon is not None:
            daemon.stop()  # idle during torch's build anyway; keeps the machine quiet
        if args.only:
            pass
        elif torch is None:
            tc["cold_s"] = {"error": torch_error}
            tc["second_process_s"] = {"error": torch_error}
        else:
            try:
                bench_torch_load_inline(tmp, tc)
            except Exception as e:
                traceback.print_exc()
                tc["cold_s"] = tc.get("cold_s") or err(e)
    finally:
        if daemon is not None:
            daemon.stop()
            result["opjitd_exit_codes"] = daemon.exits
        if args.keep_tmp:
            print("temp directory kept: %s" % tmp, file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    result["machine"]["loadavg_end"] = loadavg()
    result["total_s"] = time.monotonic() - started
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(summary(result))
    print("total %.0f s; wrote %s" % (result["total_s"], args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
