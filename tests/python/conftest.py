"""Fixtures: a real opjitd per test session, and clients connected to it.

The daemon comes from $OPJITD (default <repo>/build/bin/opjitd). It runs with
its own --state-dir in a temp directory and listens on a unix socket there
and on 127.0.0.1:0 (the chosen port is read from <state>/endpoints). It is
stopped with SIGTERM at the end of the session.
"""

import hashlib
import os
import signal
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

    def spawn(self, config, binary=None, prefix="opjit-t-", dir=None):
        """Starts `binary` (default: opjitd) on a unix socket in `dir`
        (default: a new temp dir) with `config` (TOML text) and waits until it
        has bound."""
        self.dir = dir or tempfile.mkdtemp(prefix=prefix)
        self.state = os.path.join(self.dir, "state")
        cfg = os.path.join(self.dir, "c.toml")
        with open(cfg, "w") as f:
            f.write(config)
        self.unix_address = "unix:" + os.path.join(self.dir, "s.sock")
        self.log_path = os.path.join(self.dir, "log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([binary or opjitd_binary(), "--state-dir", self.state,
                                      "--config", cfg, "--listen", self.unix_address],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(self.state, "endpoints")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("opjitd did not start:\n" + self.read_log())
            time.sleep(0.05)

    def read_log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def close(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        self.log.close()
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)


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
        import shutil
        shutil.rmtree(state, ignore_errors=True)
        raise
    yield d
    d.stop()
    if d.proc.returncode not in (0, -signal.SIGTERM):
        sys.stderr.write("opjitd exited with %s:\n%s\n" % (d.proc.returncode, d.read_log()))
    import shutil
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


# Kernels for the autograd tests: square (y = x*x) with bprop square_grad
# (x, y, dy) -> 2*x*dy; mul (x, w) -> x*w with bprop mul_grad.
SQUARE_SRC = r'''
#include <cstdint>
extern "C" int Square(int nparam, void** params, int* ndims, int64_t** shapes,
                      const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * x[i];
  return 0;
}
'''

SQUARE_GRAD_SRC = r'''
#include <cstdint>
extern "C" int SquareGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                          const char** dtypes, void* stream, void* extra) {
  // inputs: x, y, dy; output: dx
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  const float* dy = static_cast<const float*>(params[2]);
  float* dx = static_cast<float*>(params[3]);
  for (int64_t i = 0; i < n; ++i) dx[i] = 2.0f * x[i] * dy[i];
  return 0;
}
'''

MUL_SRC = r'''
#include <cstdint>
extern "C" int Mul(int nparam, void** params, int* ndims, int64_t** shapes,
                   const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  const float* w = static_cast<const float*>(params[1]);
  float* y = static_cast<float*>(params[2]);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * w[i];
  return 0;
}
'''

MUL_GRAD_SRC = r'''
#include <cstdint>
extern "C" int MulGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                       const char** dtypes, void* stream, void* extra) {
  // inputs: x, w, y, dy; outputs: dx, dw
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  const float* w = static_cast<const float*>(params[1]);
  const float* dy = static_cast<const float*>(params[3]);
  float* dx = static_cast<float*>(params[4]);
  float* dw = static_cast<float*>(params[5]);
  for (int64_t i = 0; i < n; ++i) { dx[i] = dy[i] * w[i]; dw[i] = dy[i] * x[i]; }
  return 0;
}
'''

# Elementwise helpers for Function tests (client-side backward calls these).
TANH_SRC = r'''
#include <cmath>
#include <cstdint>
extern "C" int Tanh(int nparam, void** params, int* ndims, int64_t** shapes,
                    const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = std::tanh(x[i]);
  return 0;
}
'''

TANH_GRAD_SRC = r'''
#include <cstdint>
extern "C" int TanhGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                        const char** dtypes, void* stream, void* extra) {
  // inputs: dy, y; output: dy * (1 - y*y)
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* dy = static_cast<const float*>(params[0]);
  const float* y = static_cast<const float*>(params[1]);
  float* dx = static_cast<float*>(params[2]);
  for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * (1.0f - y[i] * y[i]);
  return 0;
}
'''


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
        c.register(opjit.CustomRegOp("tanh_grad").input(0, "dy").input(1, "y").output(0, "dx")
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
