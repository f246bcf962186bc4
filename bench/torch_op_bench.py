#!/usr/bin/env python3
"""Per-call cost of an opjit op inside PyTorch (issue 32): opjit.torch against
opjit.Op and against torch's own op.

    PYTHONPATH=build/python /usr/bin/python3 bench/torch_op_bench.py [--build build]
        [--json OUT.json] [--seconds 1.5]

Starts its own opjitd (BUILD/bin/opjitd, state in a temp dir, a unix socket;
$OPJIT_SERVER instead when set), registers kernels/examples' leaky_relu and
tanh/tanh_grad, and times, alternating the variants in batches (median of
the batches, per call):

* tiny: leaky_relu on 16 float32: torch.nn.functional.leaky_relu; opjit.Op
  on an ndarray in shared memory (client.empty); opjit.torch on a tensor in
  shared memory (opjit.torch.empty) and on a plain torch tensor (one copy
  into shared memory per call); torch.ops.opjit.leaky_relu (the dispatcher
  on top); and the prepared calls of both (opjit.Op.prepare, opjit.torch's
  TorchOp.prepare: the same outputs every call, driven by opjit._fastcall).
* tiny forward+backward: tanh on 16 float32 with requires_grad, then
  backward: opjit.torch (both passes on the fast channel) against opjit.Op
  on the client's tape (also on the fast channel since issue 30: the bprop
  runs as a channel call; over gRPC before) and torch.tanh.
* copy: leaky_relu on 1 Mi float32 (4 MiB): a tensor in shared memory
  against a plain tensor, i.e. what the copy into shared memory costs.

A standalone bench: bench/run.sh and bench/report.py do not run it; its
numbers are quoted in README.md's "PyTorch" section.
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import warnings

import numpy as np

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
EXAMPLES = os.path.join(REPO, "kernels", "examples")


def start_daemon(build, tmp):
    import opjit
    state = os.path.join(tmp, "state")
    sock = os.path.join(tmp, "s.sock")
    log = open(os.path.join(tmp, "log"), "wb")
    proc = subprocess.Popen([os.path.join(build, "bin", "opjitd"), "--state-dir", state,
                             "--listen", "unix:" + sock, "--log-level", "warn"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("opjitd exited with %s" % proc.returncode)
        if os.path.exists(sock):
            try:
                with opjit.Client("unix:" + sock, timeout=2) as c:
                    c.info()
                return proc, "unix:" + sock
            except opjit.OpjitError:
                pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("opjitd did not answer within 60 s")


def per_call_us(variants, seconds, batch):
    """{name: median µs per call}, the variants alternating in batches of `batch` calls."""
    for fn in variants.values():  # warm-up: Prepare, channel, caches
        for _ in range(20):
            fn()
    samples = {k: [] for k in variants}
    end = time.monotonic() + seconds
    while time.monotonic() < end or min(len(s) for s in samples.values()) < 5:
        for name, fn in variants.items():
            t0 = time.perf_counter_ns()
            for _ in range(batch):
                fn()
            samples[name].append((time.perf_counter_ns() - t0) / batch / 1000.0)
    return {k: round(statistics.median(v), 2) for k, v in samples.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--json")
    ap.add_argument("--seconds", type=float, default=1.5, help="per section")
    args = ap.parse_args()

    import torch
    import opjit
    import opjit.torch as ot

    tmp = proc = None
    address = os.environ.get("OPJIT_SERVER")
    if not address:
        tmp = tempfile.mkdtemp(prefix="opjit-tb-")
        proc, address = start_daemon(args.build, tmp)
    try:
        client = opjit.Client(address, namespace="torch_bench", timeout=60)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", opjit.OpjitWarning)
            for name in ("leaky_relu", "tanh_grad", "tanh"):
                client.register(os.path.join(EXAMPLES, name + ".json"))
        ot.set_default_client(client)
        torch.set_num_threads(1)
        out = {"fast_path": client.fast_path_active(), "torch": torch.__version__}

        op = client.op("leaky_relu")
        top = ot.op("leaky_relu")
        tops = getattr(torch.ops.opjit, top.torch_name)
        x_np = client.empty(16, np.float32)
        x_np[:] = np.linspace(-1, 1, 16)
        x_sh = ot.from_tensor(torch.linspace(-1, 1, 16))
        x_pl = torch.linspace(-1, 1, 16)
        op_prep = op.prepare(x_np, alpha=0.5)
        top_prep = top.prepare(x_sh, alpha=0.5)
        out["prepared_paths"] = {"opjit.Op.prepare": op_prep.path,
                                 "opjit.torch prepare": top_prep.prepared.path}
        out["tiny_us"] = per_call_us({
            "torch": lambda: torch.nn.functional.leaky_relu(x_pl, 0.5),
            "opjit.Op (shm)": lambda: op(x_np, alpha=0.5),
            "opjit.Op.prepare (shm)": op_prep,
            "opjit.torch (shm)": lambda: top(x_sh, alpha=0.5),
            "opjit.torch (plain tensor)": lambda: top(x_pl, alpha=0.5),
            "torch.ops.opjit": lambda: tops(x_sh, alpha=0.5),
            "opjit.torch prepare (shm)": top_prep,
        }, args.seconds, 200)

        tanh_op, tanh_top = client.op("tanh"), ot.op("tanh")
        t_np = np.linspace(-1, 1, 16, dtype=np.float32)
        t_t = ot.from_tensor(torch.linspace(-1, 1, 16)).requires_grad_()

        def opjit_tape():
            x = opjit.tensor(t_np, requires_grad=True)
            tanh_op(x).sum().backward()

        def opjit_torch():
            t_t.grad = None
            tanh_top(t_t).sum().backward()

        def torch_own():
            t_t.grad = None
            torch.tanh(t_t).sum().backward()

        out["tiny_fwd_bwd_us"] = per_call_us({
            "torch": torch_own, "opjit.Op (client tape)": opjit_tape,
            "opjit.torch": opjit_torch}, args.seconds, 50)

        big_sh = ot.from_tensor(torch.randn(1 << 20))
        big_pl = torch.randn(1 << 20)
        out["copy_4MiB_us"] = per_call_us({
            "opjit.torch (shm)": lambda: top(big_sh, alpha=0.5),
            "opjit.torch (plain tensor)": lambda: top(big_pl, alpha=0.5),
            "torch": lambda: torch.nn.functional.leaky_relu(big_pl, 0.5),
        }, args.seconds, 10)
        c0 = client.call_counts()
        opjit_tape()
        c1 = client.call_counts()
        out["tape_fwd_bwd_calls"] = {k: c1[k] - c0.get(k, 0) for k in c1 if c1[k] != c0.get(k, 0)}
        out["call_counts"] = client.call_counts()
        client.close()
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            shutil.rmtree(tmp, ignore_errors=True)

    t = out["tiny_us"]
    out["ratio_torch_vs_op"] = round(t["opjit.torch (shm)"] / t["opjit.Op (shm)"], 2)
    out["ratio_plain_tensor_vs_op"] = round(t["opjit.torch (plain tensor)"] / t["opjit.Op (shm)"],
                                            2)
    out["ratio_prepared_torch_vs_op"] = round(
        t["opjit.torch prepare (shm)"] / t["opjit.Op.prepare (shm)"], 2)
    out["ratio_torch_vs_op_prepared"] = round(t["opjit.torch (shm)"] / t["opjit.Op.prepare (shm)"],
                                              2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print("fast path: %s, torch %s" % (out["fast_path"], out["torch"]))
    for sec in ("tiny_us", "tiny_fwd_bwd_us", "copy_4MiB_us"):
        print("%s:" % sec)
        for k, v in out[sec].items():
            print("  %-42s %9.1f us" % (k, v))
    print("prepared paths: %s; one opjit.Op tape fwd+bwd: %s"
          % (out["prepared_paths"], out["tape_fwd_bwd_calls"]))
    print("opjit.torch / opjit.Op (tiny, shm): %.2fx; plain tensor / opjit.Op: %.2fx"
          % (out["ratio_torch_vs_op"], out["ratio_plain_tensor_vs_op"]))
    print("opjit.torch prepare / opjit.Op.prepare: %.2fx; opjit.torch / opjit.Op.prepare: %.2fx"
          % (out["ratio_prepared_torch_vs_op"], out["ratio_torch_vs_op_prepared"]))


if __name__ == "__main__":
    main()
