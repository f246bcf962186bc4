"""opjit.torch (issue 32): opjit ops on torch tensors, torch.library ops,
autograd through registered bprops, zero-copy shared-memory tensors, DLPack,
a training loop, and a daemon that goes away mid-training.

Ops are registered from kernels/examples in a namespace of this file's own
("torch_t"), so the session's other ops (a float32-only `tanh` without a
bprop, ...) are left alone; torch.ops names them opjit.torch_t__<op>.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (deploy/install-deps.sh "
                                            "installs python3-torch)")
ot = pytest.importorskip("opjit.torch")

import opjit  # noqa: E402

from conftest import EXAMPLES, PY_EXAMPLES, TempDaemon  # noqa: E402

NS = "torch_t"


def _spec(name, **changes):
    with open(os.path.join(EXAMPLES, name + ".json")) as f:
        spec = json.load(f)
    spec.update(changes)
    return spec


def register_examples(c):
    for name in ("tanh_grad", "tanh", "square_grad_grad", "square_grad", "square", "mul_grad",
                 "mul", "leaky_relu", "arith3_grad"):
        c.register(os.path.join(EXAMPLES, name + ".json"))
    # arith3 with its quotient declared non-differentiable.
    b = _spec("arith3")["backward"]
    b["non_differentiable"] = ["quot"]
    c.register(_spec("arith3", backward=b), base_dir=EXAMPLES)


@pytest.fixture(scope="module")
def tc(daemon):
    c = opjit.Client(daemon.unix_address, namespace=NS, timeout=120)
    with warnings.catch_warnings():  # the examples' ops without output rules say so
        warnings.simplefilter("ignore", opjit.OpjitWarning)
        register_examples(c)
    ot.set_default_client(c)
    yield c
    ot.set_default_client(None)
    c.close()


@pytest.fixture
def stats():
    ot.reset_copy_stats()
    return ot.copy_stats


def rand(*shape, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)


# ---- calls, torch.library, dtypes ----------------------------------------------------

def test_op_on_torch_tensors(tc):
    leaky = ot.op("leaky_relu")
    x = rand(4, 8)
    y = leaky(x, alpha=0.5)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y, torch.nn.functional.leaky_relu(x, 0.5))
    torch.testing.assert_close(leaky(x), torch.nn.functional.leaky_relu(x, 0.01))
    h = leaky(x.half(), alpha=0.5)  # the op's float16 row
    assert h.dtype == torch.float16
    torch.testing.assert_close(h, torch.nn.functional.leaky_relu(x.half().float(), 0.5).half())


def test_registered_as_torch_op(tc):
    top = ot.op("leaky_relu")
    assert top.torch_op is not None, top.torch_error
    assert top.torch_name == NS + "__leaky_relu"
    x = rand(3, 5)
    y = torch.ops.opjit.torch_t__leaky_relu(x, alpha=0.25)
    torch.testing.assert_close(y, torch.nn.functional.leaky_relu(x, 0.25))
    torch.testing.assert_close(torch.ops.opjit.torch_t__leaky_relu(x),
                               torch.nn.functional.leaky_relu(x, 0.01))
    assert "float alpha=0.01" in str(torch.ops.opjit.torch_t__leaky_relu.default._schema)
    # Through torch.ops with autograd (mul has a bprop).
    ot.op("mul")
    a, w = rand(6, requires_grad=True), rand(6, seed=1)
    torch.ops.opjit.torch_t__mul(a, w).sum().backward()
    torch.testing.assert_close(a.grad, w)


def test_default_namespace_name(client, examples_registered):
    top = ot.op("leaky_relu", client=client)
    assert top.torch_name == "leaky_relu" and top.torch_op is not None, top.torch_error
    x = rand(7)
    torch.testing.assert_close(torch.ops.opjit.leaky_relu(x, alpha=0.5),
                               torch.nn.functional.leaky_relu(x, 0.5))


def test_output_shapes_from_prepare(tc):
    s, p, q = ot.op("arith3")(rand(3, 1), rand(1, 4, seed=1) + 3)  # broadcast rule
    assert s.shape == p.shape == q.shape == (3, 4)


def test_dtype_mapping(tc):
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                 "bool"):
        assert ot.dtype_name(ot.torch_dtype(name)) == name
        assert ot.torch_dtype(np.dtype(name)) == ot.torch_dtype(name)
    for dt in (torch.bfloat16, torch.complex64):
        with pytest.raises(opjit.InvalidArgument, match="no opjit counterpart"):
            ot.dtype_name(dt)
    with pytest.raises(opjit.InvalidArgument, match="uint16 has no torch counterpart"):
        ot.torch_dtype("uint16")
    with pytest.raises(opjit.InvalidArgument, match="bfloat16"):
        ot.op("leaky_relu")(rand(4).bfloat16())
    with pytest.raises(opjit.InvalidArgument):  # a dtype the op does not list: the server says so
        ot.op("leaky_relu")(torch.arange(4))


def test_cuda_and_other_devices_refused(tc):
    leaky = ot.op("leaky_relu")
    # (Meta tensors are shape-only calls, as torch's own ops take them: test_torch_semantics.py.)
    with pytest.raises(opjit.InvalidArgument, match=r"layout torch.sparse_coo.*\.to_dense\(\)"):
        leaky(torch.ones(4).to_sparse())
    if torch.cuda.is_available():
        with pytest.raises(opjit.InvalidArgument, match=r"CUDA tensor.*CUDA IPC"):
            leaky(torch.ones(4, device="cuda"))


def test_non_contiguous_input(tc, stats):
    leaky = ot.op("leaky_relu")
    x = rand(6, 4).t()
    assert not x.is_contiguous()
    torch.testing.assert_close(leaky(x, alpha=0.5), torch.nn.functional.leaky_relu(x, 0.5))
    assert stats()["made_contiguous"] == 1
    strict = ot.op("leaky_relu", contiguous="error", register=False)
    with pytest.raises(opjit.InvalidArgument, match="not contiguous.*strides"):
        strict(x)
    strict(x.contiguous())


# ---- autograd ------------------------------------------------------------------------

def test_autograd_matches_torch(tc):
    mul = ot.op("mul")
    x, w = rand(3, 4, requires_grad=True), rand(3, 4, seed=1, requires_grad=True)
    y = mul(x, w)
    assert y.requires_grad and y.grad_fn is not None
    dy = rand(3, 4, seed=2)
    y.backward(dy)
    torch.testing.assert_close(x.grad, dy * w.detach())
    torch.testing.assert_close(w.grad, dy * x.detach())


def test_requires_grad_per_input(tc):
    mul = ot.op("mul")
    x, w = rand(5, requires_grad=True), rand(5, seed=1)
    mul(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w)
    assert w.grad is None
    # No input needs a grad, or grad mode is off: a plain call, no graph.
    assert mul(rand(5), w).grad_fn is None
    with torch.no_grad():
        assert mul(x, w).grad_fn is None


def test_op_without_bprop_fails_on_backward(tc):
    x = rand(4, requires_grad=True)
    y = ot.op("leaky_relu")(x)
    assert y.requires_grad
    with pytest.raises(opjit.FailedPrecondition, match="not differentiable") as e:
        y.sum().backward()
    assert e.value.reason == "NOT_DIFFERENTIABLE"


def test_non_differentiable_output(tc):
    x, y = rand(4, requires_grad=True), (rand(4, seed=1) + 3).requires_grad_()
    s, p, q = ot.op("arith3")(x, y)
    assert s.requires_grad and p.requires_grad and not q.requires_grad
    (s * 2 + p).sum().backward()
    torch.testing.assert_close(x.grad, 2 + y.detach())
    torch.testing.assert_close(y.grad, 2 + x.detach())


def test_gradcheck_float64(tc):
    tanh = ot.op("tanh")
    x = rand(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(tanh, (x,), eps=1e-6, atol=1e-6)
    torch.testing.assert_close(tanh(x), torch.tanh(x))


def test_double_backward(tc):
    square = ot.op("square")  # square -> square_grad -> square_grad_grad
    x = rand(5, requires_grad=True)
    g, = torch.autograd.grad(square(x).sum(), x, create_graph=True)
    torch.testing.assert_close(g, 2 * x.detach())
    assert g.requires_grad
    gg, = torch.autograd.grad((g * g).sum(), x)  # d/dx sum(4 x^2) = 8 x
    torch.testing.assert_close(gg, 8 * x.detach())
    # retain_graph: torch keeps the saved tensors, the daemon keeps nothing.
    y = square(x).sum()
    y.backward(retain_graph=True)
    y.backward()
    torch.testing.assert_close(x.grad, 4 * x.detach())


def test_double_backward_without_bprop_of_bprop(tc):
    tanh = ot.op("tanh")  # tanh_grad has no bprop
    x = rand(4, requires_grad=True)
    g, = torch.autograd.grad(tanh(x).sum(), x, create_graph=True)
    torch.testing.assert_close(g, 1 - torch.tanh(x.detach()) ** 2)
    with pytest.raises(opjit.FailedPrecondition, match="tanh_grad.*not differentiable"):
        g.sum().backward()


def test_opjit_function_in_torch(tc):
    tanh, tanh_grad = tc.op("tanh"), tc.op("tanh_grad")

    class Tanh(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            y = tanh(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, dy):
            y, = ctx.saved_tensor()
            return tanh_grad(None, y, dy)

    f = ot.function(Tanh)
    x = rand(2, 3, dtype=torch.float64, requires_grad=True)
    y = f(x)
    torch.testing.assert_close(y, torch.tanh(x))
    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-6)


# ---- memory ---------------------------------------------------------------------------

def test_zero_copy_shared_tensors(tc, stats):
    leaky = ot.op("leaky_relu")
    x = ot.empty(64, 64)
    assert ot.is_shared(x)
    x.copy_(rand(64, 64))
    y = leaky(x, alpha=0.5)
    s = stats()
    assert (s["shared_inputs"], s["copied_inputs"], s["copied_bytes"]) == (1, 0, 0)
    assert ot.is_shared(y)  # an output over shared memory
    z = leaky(y)  # fed back: by reference again
    assert stats()["shared_inputs"] == 2 and stats()["copied_inputs"] == 0
    torch.testing.assert_close(z, torch.nn.functional.leaky_relu(
        torch.nn.functional.leaky_relu(x, 0.5)))
    plain = rand(64, 64)
    assert not ot.is_shared(plain)
    leaky(plain)
    assert stats()["copied_inputs"] == 1 and stats()["copied_bytes"] == 64 * 64 * 4
    moved = ot.from_tensor(plain)
    assert ot.is_shared(moved) and ot.from_tensor(moved) is moved
    torch.testing.assert_close(moved, plain)
    g = ot.zeros(3, dtype=torch.float64, requires_grad=True)
    assert ot.is_shared(g) and g.requires_grad and float(g.sum()) == 0


def test_dlpack_both_ways(tc):
    leaky = tc.op("leaky_relu")
    t = rand(8)
    a = opjit.from_dlpack(t)  # torch -> opjit: an ndarray over the tensor's memory
    assert a.ctypes.data == t.data_ptr()
    y = leaky(t, alpha=0.5)  # an Op takes the torch tensor through __dlpack__
    back = torch.from_dlpack(y)  # opjit output -> torch, no copy
    assert back.data_ptr() == y.ctypes.data
    torch.testing.assert_close(back, torch.nn.functional.leaky_relu(t, 0.5))
    assert ot.from_dlpack(y).data_ptr() == y.ctypes.data
    assert ot.to_dlpack(t).ctypes.data == t.data_ptr()


# ---- real code --------------------------------------------------------------------------

class MLP(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(8, 32), torch.nn.Linear(32, 1)
        self.act = act
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


def test_training_matches_torch(tc):
    tanh = ot.op("tanh")
    a, b = MLP(tanh), MLP(torch.tanh)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(64, 8, generator=g)
    Y = torch.tanh(X[:, :4].sum(1, keepdim=True) / 2)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    a.eval(), b.eval()  # no dropout: the two models see the same numbers
    losses = []
    for step in range(200):
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(X[step % 4 * 16:][:16]), Y[step % 4 * 16:][:16])
            loss.backward()
            opt.step()
            if m is a:
                losses.append(loss.item())
        if step in (0, 199):
            for pa, pb in zip(a.parameters(), b.parameters()):
                torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-5)
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:20])
    with torch.no_grad():  # a whole batch at once (another shape), no graph
        out = a(X)
        assert out.shape == (64, 1) and out.grad_fn is None
        torch.testing.assert_close(out, b(X), rtol=1e-4, atol=1e-4)
    a.train()
    assert a(X).requires_grad


def test_training_example(daemon, tmp_path):
    path = os.path.join(PY_EXAMPLES, "torch_mlp.py")
    env = dict(os.environ, OPJIT_SERVER=daemon.unix_address)
    proc = subprocess.run([sys.executable, path], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "grads match torch.tanh's" in proc.stdout and "ok" in proc.stdout, proc.stdout


DEATH_SCRIPT = textwrap.dedent(r"""
    import os, sys, torch, opjit, opjit.torch as ot
    c = opjit.Client(sys.argv[1], timeout=10)
    c.register(os.path.join(sys.argv[2], "tanh_grad.json"))
    c.register(os.path.join(sys.argv[2], "tanh.json"))
    ot.set_default_client(c)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), ot.module("tanh"), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(16, 4)
    print("training", flush=True)
    try:
        for step in range(10 ** 6):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    except opjit.OpjitError as e:
        print("step %d raised %s: %s" % (step, type(e).__name__, e), flush=True)
        sys.exit(0)
    sys.exit(3)
""")


def test_daemon_gone_mid_training():
    """SIGKILL to the daemon while a model trains: the training loop gets an
    opjit.OpjitError (Unavailable) within seconds, never a hang."""
    d = TempDaemon()
    d.spawn(None, serving=True)
    try:
        proc = subprocess.Popen([sys.executable, "-W", "ignore", "-c", DEATH_SCRIPT,
                                 d.unix_address, EXAMPLES], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=os.environ)
        first = proc.stdout.readline().strip()
        if first != "training":
            pytest.fail("the training script failed before training:\n%s\n%s"
                        % (first, proc.communicate(timeout=60)[0]))
        time.sleep(0.5)
        d.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        d.proc.wait(30)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("training hung after the daemon died:\n%s" % proc.communicate()[0])
        took = time.monotonic() - killed
        assert proc.returncode == 0, out
        print("%s, %.2f s after SIGKILL" % (out.strip().splitlines()[-1], took))
        assert took < 30
        assert "raised" in out and ("Unavailable" in out or "Internal" in out
                                    or "Aborted" in out), out
    finally:
        d.close()


# ---- the fast path (issue 32 goal 5) ----------------------------------------------------

def _fast_plan(top, x, **attrs):
    """The _Fast plan opjit.torch cached for this call shape (None: none)."""
    top(x, **attrs)
    key = (tuple(attrs.items()), (x.dtype, x.shape))
    call = top._calls.get(key)
    return call.fast if call is not None else None


def test_fast_path_passes_tensors_by_reference(tc, stats):
    """On the fast channel, the tensor refs the call writes point at the
    input tensor's own bytes (shared memory) and at the output tensor's."""
    leaky = ot.op("leaky_relu", register=False)
    x = ot.from_tensor(rand(32))
    f = _fast_plan(leaky, x, alpha=0.5)
    if not tc.fast_path_active():
        assert f is None
        pytest.skip("no fast channel (OPJIT_FAST=off): calls take the ordinary path")
    assert f is not None
    sent = []
    native = f.native

    def spy(handle, refs, deadline_ns, flags):
        sent.append(list(refs))
        return native(handle, refs, deadline_ns, flags)

    f.native = spy
    try:
        before = tc.call_counts()
        y = leaky(x, alpha=0.5)
        plain = rand(32, seed=3)
        z = leaky(plain, alpha=0.5)
    finally:
        f.native = native
    after = tc.call_counts()
    assert after["fast"] - before["fast"] == 2 and after["grpc"] == before["grpc"]
    regions = {r.id: r for r in leaky._pool._regions}
    (xid, xoff, yid, yoff), (pid, poff, zid, zoff) = sent
    assert regions[xid].addr + xoff == x.data_ptr()  # the input by reference
    assert regions[yid].addr + yoff == y.data_ptr()  # the output written in place
    assert regions[zid].addr + zoff == z.data_ptr()
    assert regions[pid].addr + poff != plain.data_ptr()  # a plain tensor: a copy
    torch.testing.assert_close(y, torch.nn.functional.leaky_relu(x, 0.5))
    torch.testing.assert_close(z, torch.nn.functional.leaky_relu(plain, 0.5))
    s = stats()
    assert (s["shared_inputs"], s["copied_inputs"], s["copied_bytes"]) >= (2, 1, 32 * 4)


def test_outputs_are_fresh_tensors(tc):
    """Every call returns new output memory; a freed output's block is
    reused only once no tensor (or view) over it is alive."""
    leaky = ot.op("leaky_relu", register=False)
    x = ot.from_tensor(rand(16))
    want = torch.nn.functional.leaky_relu(x, 0.5)
    ys = [leaky(x * (i + 1), alpha=0.5) for i in range(8)]
    assert len({y.data_ptr() for y in ys}) == 8
    for i, y in enumerate(ys):
        torch.testing.assert_close(y, want * (i + 1))
    view = ys[0][4:8]
    arr = ys[1].numpy()
    keep = [v.clone() for v in (view, ys[1])]
    del ys
    for i in range(20):  # the freed blocks go round again
        torch.testing.assert_close(leaky(x * 7, alpha=0.5), want * 7)
    torch.testing.assert_close(view, keep[0])  # still their own bytes
    torch.testing.assert_close(torch.from_numpy(arr), keep[1])
    before = leaky._pool.stats()["blocks"]
    for _ in range(50):
        leaky(x, alpha=0.5)
    assert leaky._pool.stats()["blocks"] <= before + 5  # blocks come back, none leak


def test_fast_path_survives_reregistration_and_closed_channel(tc):
    """A new version of the op (its handle goes stale) and a channel closed
    under the client: the call takes the ordinary path once, then the fast
    one again, with the new op's results."""
    leaky = ot.op("leaky_relu", register=False)
    x = ot.from_tensor(rand(16))
    torch.testing.assert_close(leaky(x, alpha=0.5), torch.nn.functional.leaky_relu(x, 0.5))
    version = leaky.record.version
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", opjit.OpjitWarning)
        tc.register(_spec("leaky_relu", doc="leaky_relu, registered again"), base_dir=EXAMPLES)
    for _ in range(3):
        torch.testing.assert_close(leaky(x, alpha=0.5), torch.nn.functional.leaky_relu(x, 0.5))
    assert leaky.record.version > version  # the new version ran, and was noticed
    if tc.fast_path_active():
        tr = tc.session(NS)._t
        ch = tr._channels.get(NS)
        tr._drop_channel(NS, ch)  # as when the daemon closes it
        for _ in range(3):
            torch.testing.assert_close(leaky(x, alpha=0.5),
                                       torch.nn.functional.leaky_relu(x, 0.5))
        before = tc.call_counts()["fast"]
        leaky(x, alpha=0.5)
        assert tc.call_counts()["fast"] == before + 1


def test_prepared_torch_call(tc):
    leaky = ot.op("leaky_relu", register=False)
    x = ot.from_tensor(rand(16))
    p = leaky.prepare(x, alpha=0.5)
    y = p()
    assert isinstance(y, torch.Tensor) and p() is y and ot.is_shared(y)
    torch.testing.assert_close(y, torch.nn.functional.leaky_relu(x, 0.5))
    x.mul_(-2)  # new values in place: the same tensor is the prepared input
    assert p() is y
    torch.testing.assert_close(y, torch.nn.functional.leaky_relu(x, 0.5))
    plain = rand(16, seed=2)
    q = leaky.prepare(plain, alpha=0.5)  # copied into shared memory once: q.inputs
    q.inputs[0][0].copy_(plain * 3)
    torch.testing.assert_close(q(), torch.nn.functional.leaky_relu(plain * 3, 0.5))
    assert p.prepared.path == ("fast" if tc.fast_path_active() else "forward")
    with pytest.raises(opjit.InvalidArgument, match="no gradient"):
        leaky.prepare(rand(4, requires_grad=True))


def test_torch_calls_are_one_channel_call_each(tc):
    """Goal 5's path (its cost is bench/torch_op_bench.py's, not a timed
    test's): once a call shape is cached, every opjit.torch call (a tensor
    in shared memory, or a plain one copied in) is exactly one fast-channel
    call, with no RPC and no prepared-handle lookup; a forward+backward is
    two such calls."""
    if not tc.fast_path_active():
        pytest.skip("no fast channel (OPJIT_FAST=off)")
    top = ot.op("leaky_relu", register=False)
    x_t = ot.from_tensor(torch.linspace(-1, 1, 16))
    plain = torch.linspace(-1, 1, 16)
    want = torch.nn.functional.leaky_relu(plain, 0.5)
    torch.testing.assert_close(top(x_t, alpha=0.5), want)  # caches the call shape
    torch.testing.assert_close(top(plain, alpha=0.5), want)
    before = tc.call_counts()
    for _ in range(20):
        torch.testing.assert_close(top(x_t, alpha=0.5), want)
        torch.testing.assert_close(top(plain, alpha=0.5), want)
    after = tc.call_counts()
    assert after["fast"] - before["fast"] == 40
    assert (after["grpc"], after["handle"]) == (before["grpc"], before["handle"])
    tanh = ot.op("tanh", register=False)
    t = ot.from_tensor(rand(16)).requires_grad_()
    tanh(t).sum().backward()
    before = tc.call_counts()
    for _ in range(5):
        t.grad = None
        tanh(t).sum().backward()
    after = tc.call_counts()
    assert after["fast"] - before["fast"] == 10
    assert (after["grpc"], after["handle"]) == (before["grpc"], before["handle"])
    torch.testing.assert_close(t.grad, 1 - torch.tanh(t.detach()) ** 2)


def test_threads_share_a_call_shape(tc):
    """Threads calling one TorchOp on the same call shape (its cached plan,
    kept blocks and spare outputs shared) each get their own results."""
    import threading
    leaky = ot.op("leaky_relu", register=False)
    errors = []

    def work(seed):
        try:
            shared = ot.from_tensor(rand(64, seed=seed))
            for i in range(200):
                plain = rand(64, seed=seed * 1000 + i)
                for x in (plain, shared):
                    torch.testing.assert_close(leaky(x, alpha=0.5),
                                               torch.nn.functional.leaky_relu(x, 0.5))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
