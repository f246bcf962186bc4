"""The tape over daemon ops with a registered bprop (server-side Backward), and gradcheck.

Tests against the real daemon skip only when it answers UNIMPLEMENTED. The
client's side of the protocol is also exercised against a small in-process
fake Executor, so it is covered whatever the daemon offers.
"""

from concurrent import futures

import grpc
import numpy as np
import pytest

import opjit
from opjit._proto import exec_pb2, exec_pb2_grpc, registry_pb2_grpc
from conftest import SQUARE_SRC

F32 = opjit.DataType.F32_Default


# ---- against the real daemon ------------------------------------------------------

def test_square_bprop(client, backward_supported):
    square = client.op("square")
    x = opjit.tensor(np.array([1.0, 4.0, 9.0], np.float32), requires_grad=True)
    y = square(x)
    assert isinstance(y, opjit.Tensor) and y.grad_fn is not None
    np.testing.assert_allclose(y.numpy(), [1, 16, 81])
    y.backward(np.ones(3, np.float32))
    np.testing.assert_allclose(x.grad, [2, 8, 18])


def test_requires_grad_keyword_makes_leaves(client, backward_supported):
    y = client.op("square")(np.array([1.0, 2.0], np.float32), requires_grad=True)
    y.backward(np.array([1.0, 10.0], np.float32))
    leaf = y.grad_fn.inputs[0]
    np.testing.assert_allclose(leaf.grad, [2, 40])


def test_stop_gradient_input_gets_no_grad(client, backward_supported):
    mul = client.op("mul")
    x = opjit.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    w = opjit.tensor(np.array([3.0, 5.0], np.float32))  # stop_gradient
    y = mul(x, w)
    y.backward()
    np.testing.assert_allclose(x.grad, [3, 5])
    assert w.grad is None
    w.stop_gradient = False
    x.zero_grad()
    mul(x, w).backward(np.array([1.0, 2.0], np.float32))
    np.testing.assert_allclose(x.grad, [3, 10])
    np.testing.assert_allclose(w.grad, [1, 4])


def test_no_input_needs_grad_records_nothing(client, grad_ops):
    y = client.op("square")(opjit.tensor(np.array([2.0], np.float32)))
    assert isinstance(y, opjit.Tensor)
    assert y.grad_fn is None and not y.requires_grad
    y.backward()  # a no-op, no server call
    with opjit.no_grad():
        y = client.op("square")(opjit.tensor(np.array([2.0], np.float32), requires_grad=True))
    assert y.grad_fn is None


def test_context_used_once_unless_retained(client, backward_supported):
    x = opjit.tensor(np.array([3.0], np.float32), requires_grad=True)
    y = client.op("square")(x)
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad, [12.0])
    with pytest.raises(opjit.FailedPrecondition):
        y.backward()
    # The server refuses a context that was used, too.
    y2 = client.op("square")(x)
    y2.grad_fn.apply([np.ones(1, np.float32)], retain_graph=False)
    with pytest.raises(opjit.FailedPrecondition):
        y2.grad_fn.apply([np.ones(1, np.float32)], retain_graph=False)


def test_op_without_bprop(client, examples_registered, grad_ops):
    # requires_grad on an op without a backward: the forward runs, and its
    # output is not differentiable, so a backward through it fails naming the op.
    y = client.op("tanh")(np.array([0.5], np.float32), requires_grad=True)
    np.testing.assert_allclose(y.numpy(), np.tanh([0.5]), rtol=1e-6)
    with pytest.raises(opjit.FailedPrecondition) as e:
        y.backward()
    assert e.value.reason == "NOT_DIFFERENTIABLE"
    assert "default/tanh" in e.value.message


def test_function_and_tape_chain(client, backward_supported):
    tanh, tanh_grad, square = (client.op(n) for n in ("tanh", "tanh_grad", "square"))

    class CusTanh(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            y = tanh(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, dy):
            y, = ctx.saved_tensor()
            return tanh_grad(y, dy)

    data = np.array([0.3, -0.7], np.float32)
    x = opjit.tensor(data, requires_grad=True)
    z = CusTanh.apply(square(x))  # tanh(x^2)
    z.backward()
    np.testing.assert_allclose(x.grad, (1 - np.tanh(data ** 2) ** 2) * 2 * data, rtol=1e-5)


def test_backward_inline_transport(inline_client, backward_supported):
    x = opjit.tensor(np.array([1.0, 4.0, 9.0], np.float32), requires_grad=True)
    inline_client.op("square")(x).backward()
    np.testing.assert_allclose(x.grad, [2, 8, 18])


def test_gradcheck_passes(client, gradcheck_supported):
    r = opjit.gradcheck(client, "square", inputs=[np.array([1.0, -2.0, 0.5], np.float32)],
                        atol=1e-2, rtol=1e-2)
    assert r.passed, r
    assert bool(r)
    assert r.inputs and r.inputs[0].name == "x"
    r2 = opjit.gradcheck(client.op("mul"), inputs=[np.array([1.0, 2.0], np.float32),
                                                   np.array([3.0, 4.0], np.float32)],
                         atol=1e-2, rtol=1e-2)
    assert r2.passed, r2
    r3 = opjit.gradcheck(client, "square", random_shape=[5], seed=3, atol=1e-2, rtol=1e-2)
    assert r3.passed, r3


def test_gradcheck_finds_a_wrong_bprop(client, gradcheck_supported):
    wrong = r'''
    #include <cstdint>
    extern "C" int WrongGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                             const char** dtypes, void* stream, void* extra) {
      int64_t n = 1;
      for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
      const float* x = static_cast<const float*>(params[0]);
      const float* dy = static_cast<const float*>(params[2]);
      float* dx = static_cast<float*>(params[3]);
      for (int64_t i = 0; i < n; ++i) dx[i] = x[i] * dy[i];  // should be 2*x*dy
      return 0;
    }'''
    client.register(opjit.CustomRegOp("square_wrong_grad").input(0, "x").input(1, "y")
                    .input(2, "dy").output(0, "dx").dtype_format(F32, F32, F32, F32)
                    .target("CPU").impl(source=wrong, entry="WrongGrad"))
    client.register(opjit.CustomRegOp("square_wrong").input(0, "x").output(0, "y")
                    .dtype_format(F32, F32).target("CPU").impl(source=SQUARE_SRC, entry="Square")
                    .bprop("square_wrong_grad"))
    r = opjit.gradcheck(client, "square_wrong", inputs=[np.array([1.0, 2.0, 3.0], np.float32)])
    assert not r.passed
    assert not r.inputs[0].passed
    assert r.inputs[0].max_abs_error > 0.5


BIAS_SRC = r'''
    #include <cstdint>
    static int64_t Numel(const int* nd, int64_t** s, int i) {
      int64_t n = 1;
      for (int d = 0; d < nd[i]; ++d) n *= s[i][d];
      return n;
    }
    // y = x + b, b broadcast along x's leading axes.
    extern "C" int TapeBiasAdd(int nparam, void** params, int* ndims, int64_t** shapes,
                               const char** dtypes, void* stream, void* extra) {
      if (nparam != 3) return 1;
      const int64_t n = Numel(ndims, shapes, 0), m = Numel(ndims, shapes, 1);
      const float* x = static_cast<const float*>(params[0]);
      const float* b = static_cast<const float*>(params[1]);
      float* y = static_cast<float*>(params[2]);
      for (int64_t i = 0; i < n; ++i) y[i] = x[i] + b[i % m];
      return 0;
    }
    // (dy) -> (dx, db) = (dy, dy): db at x's shape, for the caller to sum to b's.
    extern "C" int TapeBiasAddGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                                   const char** dtypes, void* stream, void* extra) {
      if (nparam != 3) return 1;
      const int64_t n = Numel(ndims, shapes, 0);
      const float* dy = static_cast<const float*>(params[0]);
      for (int64_t i = 0; i < n; ++i) {
        static_cast<float*>(params[1])[i] = dy[i];
        static_cast<float*>(params[2])[i] = dy[i];
      }
      return 0;
    }'''


def test_a_bprop_grad_for_a_broadcast_input_is_summed(client, backward_supported):
    # The bprop gives the bias's grad at x's shape (4, 8); the tape sums it to (8,), as
    # torch's engine (sum_to) and opjit.torch do (issue 40).
    client.register(opjit.CustomRegOp("tape_bias_add_grad").input(0, "dy").output(0, "dx")
                    .output(1, "db").dtype_format(F32, F32, F32).target("CPU")
                    .impl(source=BIAS_SRC, entry="TapeBiasAddGrad")
                    .output_rule("same_as", input=0).output_rule("same_as", input=0))
    client.register(opjit.CustomRegOp("tape_bias_add").input(0, "x").input(1, "b")
                    .output(0, "y").dtype_format(F32, F32, F32).target("CPU")
                    .impl(source=BIAS_SRC, entry="TapeBiasAdd").output_rule("same_as", input=0)
                    .bprop("tape_bias_add_grad", inputs=["grad:y"]))
    rng = np.random.default_rng(40)
    x = opjit.tensor(rng.standard_normal((4, 8)).astype(np.float32), requires_grad=True)
    b = opjit.tensor(rng.standard_normal(8).astype(np.float32), requires_grad=True)
    y = client.op("tape_bias_add")(x, b)
    np.testing.assert_allclose(y.numpy(), x.numpy() + b.numpy(), rtol=1e-6)
    (y * y).sum().backward()
    assert b.grad.shape == (8,) and b.grad.dtype == np.float32
    np.testing.assert_allclose(b.grad, (2 * y.numpy()).sum(0), rtol=1e-5)
    np.testing.assert_allclose(x.grad, 2 * y.numpy(), rtol=1e-6)


# ---- against a fake Executor (protocol of the client side) ---------------------------

class FakeExecutor(exec_pb2_grpc.ExecutorServicer):
    """square only, inline tensors: Forward keeps (x, y) under a context id."""

    def __init__(self):
        self.contexts = {}
        self.requests = []
        self.released = []

    def Forward(self, req, ctx):
        self.requests.append(req)
        t = req.inputs[0].tensors[0]
        x = np.frombuffer(t.inline_data, np.float32).reshape(tuple(t.shape))
        y = x * x
        resp = exec_pb2.ForwardResponse(version=1)
        resp.outputs.add(dtype="float32", shape=list(y.shape), inline_data=y.tobytes())
        if any(req.requires_grad):
            cid = "ctx%d" % (len(self.contexts) + 1)
            self.contexts[cid] = x
            resp.context_id = cid
        return resp

    def Backward(self, req, ctx):
        self.requests.append(req)
        x = self.contexts.get(req.context_id)
        if x is None:
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "no context " + req.context_id)
        if not req.retain_context:
            del self.contexts[req.context_id]
        g = req.grad_outputs[0]
        dy = np.frombuffer(g.inline_data, np.float32).reshape(tuple(g.shape)) if g.dtype \
            else np.zeros_like(x)
        dx = 2 * x * dy
        resp = exec_pb2.BackwardResponse()
        resp.grad_inputs.add().tensors.add(dtype="float32", shape=list(dx.shape),
                                           inline_data=dx.tobytes())
        return resp

    def ReleaseContext(self, req, ctx):
        self.released.append(req.context_id)
        self.contexts.pop(req.context_id, None)
        return exec_pb2.ReleaseContextResponse()

    def GradCheck(self, req, ctx):
        self.requests.append(req)
        resp = exec_pb2.GradCheckResponse(passed=True, dtype="float32")
        resp.inputs.add(name="x", passed=True, max_abs_error=1e-6)
        return resp


class FakeRegistry(registry_pb2_grpc.RegistryServicer):
    def __init__(self):
        self.record = opjit._proto.op_pb2.OpRecord(version=1)
        self.record.op.CopyFrom(opjit.load_spec({
            "name": "square", "inputs": [{"index": 0, "name": "x"}],
            "outputs": [{"index": 0, "name": "y"}],
            "dtype_formats": [{"dtypes": ["float32", "float32"]}],
            "backward": {"op": "square_grad"}}))

    def GetOp(self, req, ctx):
        if req.name != "square":
            ctx.abort(grpc.StatusCode.NOT_FOUND, "op %s is not registered" % req.name)
        return self.record


@pytest.fixture
def fake():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ex = FakeExecutor()
    exec_pb2_grpc.add_ExecutorServicer_to_server(ex, server)
    registry_pb2_grpc.add_RegistryServicer_to_server(FakeRegistry(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    c = opjit.Client("127.0.0.1:%d" % port, transport="inline", timeout=10)
    yield c, ex
    c.close()
    server.stop(None)


def test_fake_forward_requests_grad_and_backward(fake):
    c, ex = fake
    x = opjit.tensor(np.array([1.0, 4.0, 9.0], np.float32), requires_grad=True)
    y = c.op("square")(x)
    assert list(ex.requests[-1].requires_grad) == [True]
    assert y.grad_fn.context_id == "ctx1"
    y.backward()
    b = ex.requests[-1]
    assert b.context_id == "ctx1" and not b.retain_context
    np.testing.assert_allclose(x.grad, [2, 8, 18])
    assert "ctx1" not in ex.contexts


def test_fake_no_grad_sends_no_flags(fake):
    c, ex = fake
    c.op("square")(np.array([2.0], np.float32))
    assert len(ex.requests[-1].requires_grad) == 0
    c.op("square")(opjit.tensor(np.array([2.0], np.float32)))
    assert len(ex.requests[-1].requires_grad) == 0


def test_fake_retain_and_release_on_gc(fake):
    import gc
    c, ex = fake
    x = opjit.tensor(np.array([3.0], np.float32), requires_grad=True)
    y = c.op("square")(x)
    y.backward(retain_graph=True)
    assert ex.requests[-1].retain_context
    cid = y.grad_fn.context_id
    del y
    gc.collect()
    c._flush_contexts()
    assert cid in ex.released


def test_fake_gradcheck_request(fake):
    c, ex = fake
    r = opjit.gradcheck(c, "square", inputs=[np.array([1.0, 2.0], np.float32)], atol=1e-3,
                        rtol=1e-2, eps=1e-4, seed=7)
    assert r.passed and r.inputs[0].name == "x"
    req = ex.requests[-1]
    assert req.op == "square" and req.atol == 1e-3 and req.rtol == 1e-2 and req.seed == 7
    assert len(req.inputs) == 1 and req.inputs[0].tensors[0].shape == [2]
