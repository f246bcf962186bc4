#!/usr/bin/env python3
"""Inline tensors over TCP against a plain gRPC echo of the same bytes.

    /usr/bin/python3 bench/inline_bench.py OUT.json [--build build] [--md OUT.md]
        [--sizes-mib 1,16,64,256] [--runs N]

What a client on another host pays: an opjit forward whose input and output
travel inline in the ForwardRequest/ForwardResponse, next to the floor any
gRPC transport of those bytes has, a unary echo (the request's bytes come
back as the response) on a tiny Python gRPC server in this process. Both go
over TCP loopback with the same grpcio, the same channel options (the
client's message limits) and no compression.

* opjit: `Client(tcp, transport="inline").op("inline_ident")(x)`, the whole
  public API path (numpy in, numpy out, checked against x), on a real opjitd
  (BUILD/bin/opjitd, its own state dir, executors in sandboxed processes as
  by default). The kernel is a memcpy of x into y (float32, shape [n]).
  The daemon runs with max_message_mb = 272 so that 256 MiB fits in one
  message (the default, 64, holds a tensor just under 64 MiB).
* echo: `channel.unary_unary("/bench.Echo/Echo")(x.tobytes())`: bytes in,
  bytes out, handed back as they arrived by a Python gRPC server in a child
  process (opjitd is a process of its own too).

The variants alternate call by call (the order flips each round), `--runs`
timed calls each per size after a warm-up call; medians and their ratio.
OUT.json holds every sample; --md writes the markdown table that bench/run.sh
appends to bench/results.md.
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures

import numpy as np

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
MAX_MESSAGE_MB = 272  # 256 MiB of tensor plus the message around it
MIB = 1 << 20

IDENT_SRC = r'''
#include <cstdint>
#include <cstring>
extern "C" int InlineIdent(int nparam, void** params, int* ndims, int64_t** shapes,
                           const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  std::memcpy(params[1], params[0], static_cast<size_t>(n) * sizeof(float));
  return 0;
}
'''


def start_daemon(build, tmp, opjit):
    state = os.path.join(tmp, "state")
    cfg = os.path.join(tmp, "opjitd.toml")
    with open(cfg, "w") as f:
        f.write("max_message_mb = %d\n" % MAX_MESSAGE_MB)
    log = open(os.path.join(tmp, "opjitd.log"), "wb")
    proc = subprocess.Popen(
        [os.path.join(build, "bin", "opjitd"), "--state-dir", state, "--config", cfg,
         "--listen", "unix:" + os.path.join(tmp, "s.sock"), "--listen", "127.0.0.1:0",
         "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    endpoints = os.path.join(state, "endpoints")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("opjitd exited with %s:\n%s" % (proc.returncode, log_tail(tmp)))
        if os.path.exists(endpoints):
            with open(endpoints) as f:
                tcp = [a for a in f.read().split() if not a.startswith("unix:")]
            if tcp:
                try:
                    with opjit.Client(tcp[0], timeout=5) as c:
                        c.info()
                    return proc, tcp[0]
                except opjit.OpjitError:
                    pass
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError("opjitd did not answer within 60 s:\n" + log_tail(tmp))


def log_tail(tmp, n=3000):
    try:
        with open(os.path.join(tmp, "opjitd.log"), "rb") as f:
            return f.read().decode(errors="replace")[-n:]
    except OSError:
        return ""


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_echo(max_message):
    """The echo server (a child process, as opjitd is one): a unary echo on
    127.0.0.1:0, the request's bytes are the response. Prints its port."""
    import grpc
    options = [("grpc.max_send_message_length", max_message),
               ("grpc.max_receive_message_length", max_message)]
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or exits)
    server.stop(None)


def start_echo(max_message):
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-echo",
                             str(max_message)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    line = proc.stdout.readline()
    if not line.strip():
        proc.kill()
        proc.wait()
        raise RuntimeError("the echo server did not start")
    return proc, "127.0.0.1:%d" % int(line)


def run(args):
    sys.path.insert(0, args.python_dir or os.path.join(os.path.abspath(args.build), "python"))
    import grpc
    import opjit
    from opjit import client as client_mod

    tmp = tempfile.mkdtemp(prefix="opjit-inline-bench-")
    proc = None
    server = None
    try:
        proc, tcp = start_daemon(os.path.abspath(args.build), tmp, opjit)
        # The Python client's own channel options (its message limits), for both sides.
        options = [("grpc.max_send_message_length", client_mod._MAX_MESSAGE),
                   ("grpc.max_receive_message_length", client_mod._MAX_MESSAGE)]
        server, echo_addr = start_echo(client_mod._MAX_MESSAGE)
        channel = grpc.insecure_channel(echo_addr, options=options)
        echo = channel.unary_unary("/bench.Echo/Echo")

        client = opjit.Client(tcp, transport="inline", timeout=600)
        F32 = opjit.DataType.F32_Default
        client.register(opjit.CustomRegOp("inline_ident").input(0, "x").output(0, "y")
                        .dtype_format(F32, F32).target("CPU")
                        .impl(source=IDENT_SRC, entry="InlineIdent")
                        .output_rule("same_as", input=0))
        op = client.op("inline_ident")

        rows = []
        for mib in args.sizes_mib:
            n = mib * MIB // 4
            x = np.arange(n, dtype=np.float32)
            runs = args.runs if args.runs else (15 if mib <= 16 else 7 if mib <= 64 else 3)

            def opjit_call():
                y = op(x)
                return y

            def echo_call():
                return echo(x.tobytes(), timeout=600)

            # Warm-up (and correctness: each side returns x exactly).
            y = opjit_call()
            if y.shape != x.shape or not np.array_equal(y, x):
                raise RuntimeError("opjit returned wrong numbers at %d MiB" % mib)
            del y
            back = echo_call()
            if len(back) != x.nbytes:
                raise RuntimeError("the echo returned %d bytes" % len(back))
            del back
            samples = {"opjit_inline": [], "grpc_echo": []}
            variants = [("opjit_inline", opjit_call), ("grpc_echo", echo_call)]
            for r in range(runs):
                order = variants if r % 2 == 0 else variants[::-1]
                for name, fn in order:
                    t0 = time.perf_counter()
                    out = fn()
                    samples[name].append((time.perf_counter() - t0) * 1e3)
                    del out
            o = statistics.median(samples["opjit_inline"])
            e = statistics.median(samples["grpc_echo"])
            rows.append({"mib": mib, "runs": runs, "opjit_inline_ms": o, "grpc_echo_ms": e,
                         "ratio": o / e if e else None, "samples_ms": samples})
            print("inline_bench: %4d MiB  opjit %9.2f ms  echo %9.2f ms  ratio %.2f"
                  % (mib, o, e, o / e), file=sys.stderr)
        client.close()
        channel.close()
        return {"rows": rows, "max_message_mb": MAX_MESSAGE_MB,
                "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                            "grpcio": grpc.__version__, "numpy": np.__version__,
                            "date": datetime.datetime.now().isoformat(timespec="seconds"),
                            "loadavg": os.getloadavg()}}
    finally:
        if server is not None:
            server.stdin.close()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        if proc is not None:
            stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def markdown(result):
    lines = ["## Inline tensors over TCP (remote clients)", "",
             "`bench/inline_bench.py`: the Python client's inline forward "
             "(`transport=\"inline\"`, a memcpy kernel, float32 in and out) against a plain "
             "gRPC unary echo of the same bytes (a Python echo server in a child process, same grpcio and channel "
             "options), both over TCP loopback, alternating call by call. Medians; goal: "
             "≤ 1.5× the echo at 64 MiB. The daemon runs with max_message_mb = %d (the "
             "default 64 holds a tensor just under 64 MiB)." % result["max_message_mb"], "",
             "| size | runs | opjit inline | gRPC echo | opjit / echo |",
             "|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append("| %d MiB | %d | %.1f ms | %.1f ms | **%.2f×** |"
                     % (r["mib"], r["runs"], r["opjit_inline_ms"], r["grpc_echo_ms"], r["ratio"]))
    m = result["machine"]
    lines += ["", "Load average at the end: %.2f %.2f %.2f." % tuple(m["loadavg"]), ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--md", default=None)
    ap.add_argument("--sizes-mib", default="1,16,64,256",
                    type=lambda s: [int(v) for v in s.split(",") if v])
    ap.add_argument("--runs", type=int, default=0, help="timed calls per size (default: by size)")
    ap.add_argument("--python-dir", default=None,
                    help="where the opjit package is (default: BUILD/python)")
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-echo":
        return serve_echo(int(sys.argv[2]))
    args = ap.parse_args()
    try:
        result = run(args)
    except Exception as e:
        if args.md:
            with open(args.md, "w") as f:
                f.write("## Inline tensors over TCP (remote clients)\n\nfailed: %s\n" % e)
        raise
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
