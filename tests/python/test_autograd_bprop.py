"""Server-side bprops end to end through the real daemon: MindSpore's parameter
positions with a partial save_for_backward, and requires_grad on an op that has
no backward.

The bprop kernels here check ``nparam`` and read ``params[k]`` at MindSpore's
index k, returning a non-zero code (so the call fails) when a position is off.
The session daemon runs kernels in sandboxed executor processes, so the null
slots cross the worker boundary; both shared-memory and inline transports run.
"""

import os

import numpy as np
import pytest

import opjit

from conftest import EXAMPLES

# (x, w) -> (y = x * w, z = x + w). The bprop's params are (x, w, y, z, dy,
# dz, dx, dw): nparam 8 whatever is saved. Only w and z are saved, so x and y
# are null slots: params[0] == params[2] == nullptr, ndims 0, dtype float32.
with open(os.path.join(EXAMPLES, "mul_add.cc")) as _f:
    POS_SRC = _f.read()

F32 = opjit.DataType.F32_Default


def _fwd(name, materialize):
    return {
        "name": name,
        "inputs": [{"index": 0, "name": "x"}, {"index": 1, "name": "w"}],
        "outputs": [{"index": 0, "name": "y"}, {"index": 1, "name": "z"}],
        "dtype_formats": [{"dtypes": ["float32"] * 4}],
        "implementations": [{"target": "CPU", "source": POS_SRC, "entry": "MulAdd"}],
        "backward": {"op": "bppos_grad", "save_for_backward": ["w", "z"],
                     "materialize_grads": materialize},
    }


@pytest.fixture(scope="module")
def pos_ops(daemon):
    with opjit.Client(daemon.unix_address, timeout=120) as c:
        c.register({
            "name": "bppos_grad",
            "inputs": [{"index": i, "name": n}
                       for i, n in enumerate(["x", "w", "y", "z", "dy", "dz"])],
            "outputs": [{"index": 0, "name": "dx"}, {"index": 1, "name": "dw"}],
            "dtype_formats": [{"dtypes": ["float32"] * 8}],
            "implementations": [{"target": "CPU", "source": POS_SRC, "entry": "MulAddGrad"}],
            "output_rules": [{"kind": "same_as", "input": 1}, {"kind": "same_as", "input": 1}],
        })
        c.register(_fwd("bppos", True))
        c.register(_fwd("bppos_nomat", False))
        c.register(opjit.CustomRegOp("bp_nodiff").input(0, "x").output(0, "y")
                   .dtype_format(F32, F32).target("CPU")
                   .impl(source=POS_SRC.replace("MulAdd(", "Unused(") + r'''
extern "C" int BpCopy2(int nparam, void** params, int* ndims, int64_t** shapes, const char**,
                       void*, void*) {
  if (nparam != 2) return 1;
  const int64_t n = Numel(ndims[0], shapes[0]);
  for (int64_t i = 0; i < n; ++i)
    static_cast<float*>(params[1])[i] = 2.0f * static_cast<const float*>(params[0])[i];
  return 0;
}
''', entry="BpCopy2").output_rule("same_as", input=0))
    return True


X = np.array([1.0, 2.0, -3.0], np.float32)
W = np.array([4.0, 0.5, 2.0], np.float32)
DY = np.array([1.0, 2.0, 3.0], np.float32)
DZ = np.array([0.5, 0.5, 0.5], np.float32)


@pytest.fixture(params=["client", "inline_client"])
def any_client(request):
    return request.getfixturevalue(request.param)


def test_bprop_gets_mindspore_positions_with_a_partial_save(any_client, pos_ops,
                                                             backward_supported):
    x = opjit.tensor(X, requires_grad=True)
    w = opjit.tensor(W, requires_grad=True)
    y, z = any_client.op("bppos")(x, w)
    np.testing.assert_array_equal(y.numpy(), X * W)
    np.testing.assert_array_equal(z.numpy(), X + W)
    dx, dw = opjit.grad([y, z], [x, w], grad_outputs=[DY, DZ])
    np.testing.assert_allclose(dx, DY * W + DZ, rtol=1e-6)
    np.testing.assert_allclose(dw, DY * X + DZ, rtol=1e-6)
    # Through .backward too, accumulating into .grad.
    y, z = any_client.op("bppos")(x, w)
    y.backward(DY)
    np.testing.assert_allclose(x.grad, DY * W, rtol=1e-6)   # dz materialized as zeros
    np.testing.assert_allclose(w.grad, DY * X, rtol=1e-6)


def test_a_missing_grad_without_materialize_is_a_null_slot(any_client, pos_ops,
                                                           backward_supported):
    x = opjit.tensor(X, requires_grad=True)
    w = opjit.tensor(W, requires_grad=True)
    y, z = any_client.op("bppos_nomat")(x, w)
    y.backward(DY)  # z gets no grad: the bprop sees params[5] == nullptr
    np.testing.assert_allclose(x.grad, DY * W, rtol=1e-6)
    np.testing.assert_allclose(w.grad, DY * X, rtol=1e-6)


def test_gradcheck_runs_the_positional_bprop(client, pos_ops, gradcheck_supported):
    r = opjit.gradcheck(client, "bppos", inputs=[X, W])
    assert r.passed, r


def test_requires_grad_on_an_op_without_backward(any_client, pos_ops, grad_ops,
                                                 backward_supported):
    nodiff = any_client.op("bp_nodiff")
    x = opjit.tensor(X, requires_grad=True)
    # The forward runs (it used to be refused).
    y = nodiff(x)
    np.testing.assert_array_equal(y.numpy(), 2 * X)
    # Over gRPC the server kept a context; with a fast channel open the
    # forward ran there and the client knows the op has no bprop.
    assert y.grad_fn is not None
    assert y.grad_fn.context_id or any_client.session().fast_channel_open()
    # Its output is not differentiable: a backward through it fails on the
    # server, with a machine-readable reason, naming the op.
    with pytest.raises(opjit.FailedPrecondition) as e:
        y.backward()
    assert e.value.reason == "NOT_DIFFERENTIABLE"
    assert e.value.metadata.get("op") == "default/bp_nodiff"
    assert "default/bp_nodiff" in e.value.message
    # Also when it sits behind a differentiable op.
    with pytest.raises(opjit.FailedPrecondition) as e:
        any_client.op("square")(nodiff(x)).backward()
    assert e.value.reason == "NOT_DIFFERENTIABLE"
    assert "bp_nodiff" in e.value.message
    # A graph that does not go through it is unaffected.
    x.zero_grad()
    nodiff(x)
    any_client.op("square")(x).backward()
    np.testing.assert_allclose(x.grad, 2 * X)


def test_requires_grad_without_backward_over_raw_rpc(client, pos_ops, backward_supported):
    from opjit._proto import exec_pb2
    from opjit.errors import error_from_rpc
    req = exec_pb2.ForwardRequest(op="bp_nodiff")
    req.inputs.add().tensors.add(dtype="float32", shape=[3], inline_data=X.tobytes())
    req.requires_grad.append(True)
    resp = client._executor.Forward(req, timeout=30)
    np.testing.assert_array_equal(np.frombuffer(resp.outputs[0].inline_data, np.float32), 2 * X)
    assert resp.context_id
    b = exec_pb2.BackwardRequest(context_id=resp.context_id)
    b.grad_outputs.add(dtype="float32", shape=[3], inline_data=DY.tobytes())
    with pytest.raises(Exception) as e:
        client._executor.Backward(b, timeout=30)
    err = error_from_rpc(e.value)
    assert err.code.name == "FAILED_PRECONDITION"
    assert err.reason == "NOT_DIFFERENTIABLE"
    assert "default/bp_nodiff" in err.message
