"""Fixtures: a real opjitd per test session, and clients connected to it.

The daemon comes from $OPJITD (default <repo>/build/bin/opjitd). It runs with
its own --state-dir in a temp directory and listens on a unix socket there
and on 127.0.0.1:0 (the chosen port is read from <state>/endpoints). It is
stopped with SIGTERM at the end of the session.
"""

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

REPO = os.environ.get("OPJIT_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLES = os.path.join(REPO, "kernels", "examples")
PY_EXAMPLES = os.path.join(REPO, "client", "python", "examples")

try:
    import opjit  # noqa: F401
except ImportError as e:  # pragma: no cover
    raise pytest.UsageError(
        "cannot import opjit (%s): build the `opjit_python` target and run with "
        "PYTHONPATH=<build>/python" % e)


class Daemon:
    def __init__(self, binary, state_dir):
        self.binary = binary
        self.state_dir = state_dir
        self.socket = os.path.join(state_dir, "opjitd.sock")
        self.unix_address = "unix:" + self.socket
        self.log_path = os.path.join(state_dir, "opjitd.log")
        self.proc = None
        self.tcp_address = None

    def start(self, timeout=60.0):
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [self.binary, "--state-dir", self.state_dir, "--listen", self.unix_address,
             "--listen", "127.0.0.1:0"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        endpoints = os.path.join(self.state_dir, "endpoints")
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("opjitd exited with %s:\n%s" % (self.proc.returncode,
                                                                   self.read_log()))
            if os.path.exists(endpoints):
                try:
                    with opjit.Client(self.unix_address, timeout=5) as c:
                        c.info()
                    with open(endpoints) as f:
                        for line in f.read().split():
                            if not line.startswith("unix:"):
                                self.tcp_address = line
                    return self
                except opjit.OpjitError as e:
                    last = e
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("opjitd did not answer within %.0f s (%s):\n%s"
                           % (timeout, last, self.read_log()))

    def read_log(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "log", None):
            self.log.close()


class TempDaemon:
    """Base of the tests' own daemons: a process `proc` logging to `log`
    (`log_path`), with everything under the temp dir `dir`."""

    def spawn(self, config, binary=None, prefix="opjit-t-", dir=None, tcp=False, args=(),
              serving=False):
        """Starts `binary` (default: opjitd) on a unix socket in `dir`
        (default: a new temp dir) with `config` (TOML text, in `config_path`;
        None: no --config) and `args`, and waits until it has bound. With
        `tcp`, it listens on loopback TCP (port 0) too, at `tcp_address`; with
        `serving`, it is waited for until it answers ServerInfo."""
        self.dir = dir or tempfile.mkdtemp(prefix=prefix)
        self.state = os.path.join(self.dir, "state")
        argv = [binary or opjitd_binary(), "--state-dir", self.state]
        self.config_path = None
        if config is not None:
            self.config_path = os.path.join(self.dir, "c.toml")
            with open(self.config_path, "w") as f:
                f.write(config)
            argv += ["--config", self.config_path]
        self.unix_address = "unix:" + os.path.join(self.dir, "s.sock")
        argv += ["--listen", self.unix_address]
        if tcp:
            argv += ["--listen", "127.0.0.1:0"]
        self.log_path = os.path.join(self.dir, "log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv + list(args), stdout=self.log,
                                     stderr=subprocess.STDOUT)
        endpoints = os.path.join(self.state, "endpoints")
        deadline = time.monotonic() + 60
        while not os.path.exists(endpoints):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("opjitd did not start:\n" + self.read_log())
            time.sleep(0.05)
        if tcp:
            with open(endpoints) as f:
                self.tcp_address = [a for a in f.read().split() if not a.startswith("unix:")][0]
        if serving:
            wait_for(self.answers, 60, "opjitd to answer")

    def answers(self):
        """Whether it answers ServerInfo on the unix socket (raises once it has exited)."""
        if self.proc.poll() is not None:
            raise RuntimeError("opjitd exited %s:\n%s" % (self.proc.returncode, self.read_log()))
        try:
            with opjit.Client(self.unix_address, timeout=5) as c:
                c.info()
            return True
        except opjit.OpjitError:
            return False

    def metrics_address(self, timeout=30):
        """host:port of its [metrics] endpoint, once it has written it."""
        path = os.path.join(self.state, "metrics_endpoint")
        wait_for(lambda: os.path.exists(path), timeout, "the metrics endpoint")
        with open(path) as f:
            return f.read().strip()

    def read_log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def close(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def free_port():
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout, what, interval=0.02):
    """pred()'s first true value, polled every `interval` s for up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.1f s waiting for %s" % (timeout, what))
        time.sleep(interval)


def health(address, service=""):
    """SERVING / NOT_SERVING / NOT_FOUND (or another gRPC code's name) from
    grpc.health.v1.Health/Check of `service` ("": the whole server)."""
    import grpc
    name = service.encode()
    request = (b"\x0a" + bytes([len(name)]) + name) if name else b""
    with grpc.insecure_channel(address) as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check",
                               request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            resp = check(request, timeout=10)
        except grpc.RpcError as e:
            return e.code().name
    # HealthCheckResponse { ServingStatus status = 1; }: 1 SERVING, 2 NOT_SERVING.
    return {b"\x08\x01": "SERVING", b"\x08\x02": "NOT_SERVING"}.get(resp, repr(resp))


# Entry K: busy-waits x[0] seconds (no syscall), then y[0] = x[0].
SPIN_KERNEL = r"""#include <chrono>
#include <cstdint>
extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(x[0]);
  while (std::chrono::steady_clock::now() < end) {
  }
  y[0] = x[0];
  return 0;
}
"""


def unary_kernel(body="* 2.0f", pre=""):
    """C++ of a float32 kernel K: y[i] = x[i] `body`, after the statement `pre`
    (which sees the element count k and x)."""
    return UNARY_KERNEL % {"pre": ("  %s\n" % pre) if pre else "", "body": body}


UNARY_KERNEL = r"""#include <cstdint>
extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  int64_t k = 1;
  for (int i = 0; i < nd[0]; ++i) k *= s[0][i];
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
%(pre)s  for (int64_t i = 0; i < k; ++i) y[i] = x[i] %(body)s;
  return 0;
}
"""


def unary_spec(name, source, **fields):
    """The JSON spec of a float32 op x -> y on CPU with `source`'s entry K;
    `fields` (namespace, doc, backward, ...) are added to it."""
    s = {"name": name, "inputs": [{"index": 0, "name": "x"}],
         "outputs": [{"index": 0, "name": "y"}],
         "dtype_formats": [{"dtypes": ["float32", "float32"]}],
         "implementations": [{"target": "CPU", "source": source, "entry": "K"}]}
    s.update(fields)
    return s


def vm_hwm_kb(pid):
    """The peak resident memory (VmHWM, KiB) of process `pid`."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM for pid %d" % pid)


def token_sha(token):
    """What the config keeps of a bearer token."""
    return hashlib.sha256(token.encode()).hexdigest()


def principal_toml(name, role, namespaces=(), token=None, uids=()):
    """One [[principal]] table of opjitd's config."""
    lines = ['[[principal]]', 'name = "%s"' % name, 'role = "%s"' % role]
    if namespaces:
        lines.append("namespaces = [%s]" % ", ".join('"%s"' % n for n in namespaces))
    if token is not None:
        lines.append('token_sha256 = ["%s"]' % token_sha(token))
    if uids:
        lines.append("uids = [%s]" % ", ".join(str(u) for u in uids))
    return "\n".join(lines) + "\n"


def opjitd_binary():
    path = os.environ.get("OPJITD") or os.path.join(REPO, "build", "bin", "opjitd")
    if not os.access(path, os.X_OK):
        pytest.fail("opjitd not found at %s (set $OPJITD or build the daemon)" % path)
    return path


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    # A short path: unix socket paths are limited to 107 bytes.
    binary = opjitd_binary()
    state = tempfile.mkdtemp(prefix="opjit-py-")
    d = Daemon(binary, state)
    try:
        d.start()
    except Exception:
        shutil.rmtree(state, ignore_errors=True)
        raise
    yield d
    d.stop()
    if d.proc.returncode not in (0, -signal.SIGTERM):
        sys.stderr.write("opjitd exited with %s:\n%s\n" % (d.proc.returncode, d.read_log()))
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def client(daemon):
    c = opjit.Client(daemon.unix_address, timeout=120)
    yield c
    c.close()


@pytest.fixture
def inline_client(daemon):
    c = opjit.Client(daemon.tcp_address, transport="inline", timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="session")
def examples_registered(daemon):
    with opjit.Client(daemon.unix_address, timeout=120) as c:
        for name in ("leaky_relu", "add_n", "arith3", "reduce_sum", "scale_bias"):
            c.register(os.path.join(EXAMPLES, name + ".json"))
    return True


def example_source(name):
    """The text of kernels/examples/<name>: tests use the examples' kernels, not copies."""
    with open(os.path.join(EXAMPLES, name)) as f:
        return f.read()


# Kernels for the autograd tests, from kernels/examples: square.cc (Square:
# y = x*x, SquareGrad: (x, y, dy) -> 2*x*dy), mul.cc (Mul: (x, w) -> x*w,
# MulGrad: (x, w, y, dy) -> (dy*w, dy*x)) and tanh.cc (Tanh, and TanhGrad:
# (y, dy) -> dy * (1 - y*y) when called directly).
SQUARE_SRC = SQUARE_GRAD_SRC = example_source("square.cc")
MUL_SRC = MUL_GRAD_SRC = example_source("mul.cc")
TANH_SRC = TANH_GRAD_SRC = example_source("tanh.cc")


def unary(name, src, entry, bprop=None, doc=""):
    b = (opjit.CustomRegOp(name).input(0, "x").output(0, "y")
         .dtype_format(opjit.DataType.F32_Default, opjit.DataType.F32_Default)
         .target("CPU").impl(source=src, entry=entry).output_rule("same_as", input=0).doc(doc))
    if bprop:
        b.bprop(bprop)
    return b


@pytest.fixture(scope="session")
def grad_ops(daemon):
    """Registers square/square_grad, mul/mul_grad, tanh/tanh_grad; returns their names."""
    F32 = opjit.DataType.F32_Default
    with opjit.Client(daemon.unix_address, timeout=120) as c:
        c.register(opjit.CustomRegOp("square_grad").input(0, "x").input(1, "y").input(2, "dy")
                   .output(0, "dx").dtype_format(F32, F32, F32, F32).target("CPU")
                   .impl(source=SQUARE_GRAD_SRC, entry="SquareGrad")
                   .output_rule("same_as", input=0))
        c.register(unary("square", SQUARE_SRC, "Square", bprop="square_grad"))
        c.register(opjit.CustomRegOp("mul_grad").input(0, "x").input(1, "w").input(2, "y")
                   .input(3, "dy").output(0, "dx").output(1, "dw")
                   .dtype_format(F32, F32, F32, F32, F32, F32).target("CPU")
                   .impl(source=MUL_GRAD_SRC, entry="MulGrad")
                   .output_rule("same_as", input=0).output_rule("same_as", input=1))
        c.register(opjit.CustomRegOp("mul").input(0, "x").input(1, "w").output(0, "y")
                   .dtype_format(F32, F32, F32).target("CPU").impl(source=MUL_SRC, entry="Mul")
                   .output_rule("same_as", input=0).bprop("mul_grad"))
        c.register(unary("tanh", TANH_SRC, "Tanh"))
        c.register(opjit.CustomRegOp("tanh_grad").input(0, "y").input(1, "dy").output(0, "dx")
                   .dtype_format(F32, F32, F32).target("CPU")
                   .impl(source=TANH_GRAD_SRC, entry="TanhGrad").output_rule("same_as", input=0))
    return True


@pytest.fixture
def backward_supported(client, grad_ops):
    """Skips (only) when the daemon answers Backward with UNIMPLEMENTED."""
    try:
        client._executor.Backward(opjit._proto.exec_pb2.BackwardRequest(context_id="probe"),
                                  timeout=10)
    except Exception as e:  # grpc.RpcError
        code = getattr(e, "code", lambda: None)()
        if code is not None and code.name == "UNIMPLEMENTED":
            pytest.skip("opjitd does not implement Executor.Backward yet (UNIMPLEMENTED)")
    return True


@pytest.fixture
def gradcheck_supported(client, grad_ops):
    try:
        client._executor.GradCheck(opjit._proto.exec_pb2.GradCheckRequest(op="no_such_op_probe"),
                                   timeout=10)
    except Exception as e:
        code = getattr(e, "code", lambda: None)()
        if code is not None and code.name == "UNIMPLEMENTED":
            pytest.skip("opjitd does not implement Executor.GradCheck yet (UNIMPLEMENTED)")
    return True
