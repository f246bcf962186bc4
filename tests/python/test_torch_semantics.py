"""opjit.torch as a torch custom op should behave (issue 40, item 2, and the
opjit.torch parts of item 1): attrs by position or keyword in the torch
schema; meta and fake tensors get output shapes from the op's rules without
running the kernel (a Meta kernel, FakeTensorMode, CrossRefFakeMode); an op
whose output aliases an input writes it in place with no copy (Tensor(a!),
versions, mark_dirty, SchemaCheckMode); double backward through registered
bprop-of-bprops and through ot.function matches torch in float64; forward-mode
AD and functorch transforms raise instead of answering None; integer outputs
carry no gradient, and grads come back summed and cast to their input.

Kernels: kernels/examples/torch_sem (tanh, exp and cube whose backwards read
a saved output, a broadcasting mul, each with bprop and bprop-of-bprop; one
source, so one compile), registered once in this file's own namespace.
Expected values are torch's own, computed here.
"""

import json
import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (deploy/install-deps.sh "
                                            "installs python3-torch)")
ot = pytest.importorskip("opjit.torch")

import opjit  # noqa: E402
from opjit import _grad_rules  # noqa: E402
from opjit._proto import op_pb2  # noqa: E402

from conftest import EXAMPLES  # noqa: E402

NS = "torch_sem"
SEM = os.path.join(EXAMPLES, "torch_sem")
OPS = {
    "tanh": torch.tanh,
    "exp": torch.exp,
    "cube": lambda x: x ** 3,
}


@pytest.fixture(scope="module")
def tc(daemon):
    c = opjit.Client(daemon.unix_address, namespace=NS, timeout=120)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", opjit.OpjitWarning)
        for base in ("tanh", "exp", "cube", "bmul"):
            for suffix in ("_grad_grad", "_grad", ""):
                c.register(os.path.join(SEM, "sem_%s%s.json" % (base, suffix)))
        c.register(os.path.join(EXAMPLES, "leaky_relu.json"))
    ot.set_default_client(c)
    yield c
    ot.set_default_client(None)
    c.close()


@pytest.fixture
def stats():
    ot.reset_copy_stats()
    return ot.copy_stats


def rand(*shape, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)


def tops():
    """The four ops as TorchOps, each a function of (x[, b]) returning the
    torch-comparable value (cube: its first output)."""
    return {
        "tanh": ot.op("sem_tanh"),
        "exp": ot.op("sem_exp"),
        "cube": ot.op("sem_cube"),
        "bmul": ot.op("sem_bmul"),
    }


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ---- attrs by position or keyword ------------------------------------------------------

def test_attrs_positional_and_keyword(tc):
    leaky = ot.op("leaky_relu")
    assert leaky.torch_op is not None, leaky.torch_error
    schema = str(torch.ops.opjit.torch_sem__leaky_relu.default._schema)
    assert "float alpha=0.01" in schema and "*" not in schema
    x = rand(3, 5, dtype=torch.float32)
    want = torch.nn.functional.leaky_relu(x, 0.25)
    close(torch.ops.opjit.torch_sem__leaky_relu(x, 0.25), want)
    close(torch.ops.opjit.torch_sem__leaky_relu.default(x, 0.25), want)
    close(torch.ops.opjit.torch_sem__leaky_relu(x, alpha=0.25), want)
    close(torch.ops.opjit.torch_sem__leaky_relu(x), torch.nn.functional.leaky_relu(x, 0.01))
    close(leaky(x, 0.25), want)
    close(leaky(x, alpha=0.25), want)
    # A torch.ops call binds like a direct one: its attrs as keywords, cached.
    leaky._calls.clear()
    torch.ops.opjit.torch_sem__leaky_relu(x, 0.25)
    torch.ops.opjit.torch_sem__leaky_relu(x, 0.25)
    assert len(leaky._calls) == 1 and next(iter(leaky._calls.values())).kw == {"alpha": 0.25}


def test_schema_keeps_positional_params_valid():
    """torch wants no positional parameter without a default after one with
    a default: from there on attrs are keyword-only (torch 1.13 would abort)."""
    d = op_pb2.OpDef(name="f")
    d.inputs.add(index=0, name="x")
    d.inputs.add(index=1, name="y", param_type="optional")
    d.outputs.add(index=0, name="z")
    d.outputs.add(index=1, name="w")
    d.attrs.add(name="a", value_type="float", default_value="1.5")
    d.attrs.add(name="b", value_type="int")
    d.attrs.add(name="c", value_type="listInt", param_type="optional")
    s = ot._schema("f", d)
    assert s == "f(Tensor x, Tensor? y=None, float a=1.5, *, int b, int[]? c=None) -> (Tensor, Tensor)"
    torch._C.parse_schema(s)
    s = ot._schema("f_", d, {1: 0})
    assert s.startswith("f_(Tensor(a!) x, Tensor? y=None,") and s.endswith("-> (Tensor, Tensor(a!))")
    torch._C.parse_schema(s)
    d.attrs[0].default_value = ""
    assert ot._schema("f", d) == ("f(Tensor x, Tensor? y=None, *, float a, int b, "
                                  "int[]? c=None) -> (Tensor, Tensor)")
    d.inputs[1].param_type = ""
    assert ot._schema("f", d) == ("f(Tensor x, Tensor y, float a, int b, int[]? c=None) "
                                  "-> (Tensor, Tensor)")
    torch._C.parse_schema(ot._schema("f", d))


# ---- meta and fake tensors -------------------------------------------------------------

def test_meta_tensors_take_shapes_from_rules(tc, stats):
    bmul, cube = ot.op("sem_bmul"), ot.op("sem_cube")
    before = tc.call_counts()
    a, b = torch.empty(4, 8, device="meta"), torch.empty(8, device="meta")
    z = bmul(a, b)
    assert z.is_meta and z.shape == (4, 8) and z.dtype == torch.float32
    y, d = cube(torch.empty(2, 3, dtype=torch.float64, device="meta"))
    assert y.is_meta and d.is_meta and y.shape == d.shape == (2, 3) and y.dtype == torch.float64
    # Through the torch op: its Meta kernel.
    z = torch.ops.opjit.torch_sem__sem_bmul(a, b)
    assert z.is_meta and z.shape == (4, 8)
    # No kernel ran: no forward on any path, no opjit.torch call counted.
    after = tc.call_counts()
    assert all(after[k] == before[k] for k in ("fast", "grpc", "handle")), (before, after)
    assert stats()["calls"] == 0
    # A meta call leaves no binding behind: real calls of its shape keep their fast plan.
    ra, rb = rand(4, 8, dtype=torch.float32), rand(8, seed=1, dtype=torch.float32)
    close(bmul(ra, rb), ra * rb)
    if tc.fast_path_active():
        assert all(c.fast is not None for c in bmul._calls.values()), bmul._calls
    # The op's rules still check the call (a shape the broadcast rule refuses).
    with pytest.raises(opjit.InvalidArgument):
        bmul(torch.empty(4, 8, device="meta"), torch.empty(3, device="meta"))


def test_meta_autograd_runs_shape_only(tc):
    bmul = ot.op("sem_bmul")
    a = torch.empty(4, 8, dtype=torch.float64, device="meta", requires_grad=True)
    b = torch.empty(8, dtype=torch.float64, device="meta", requires_grad=True)
    z = torch.ops.opjit.torch_sem__sem_bmul(a, b)
    assert z.is_meta and z.requires_grad
    ga, gb = torch.autograd.grad(bmul(a, b).sum(), (a, b))
    assert ga.is_meta and ga.shape == (4, 8) and gb.is_meta and gb.shape == (8,)


def test_rules_without_prepare():
    """A server without Prepare: shapes from the output rules, here."""
    rec = op_pb2.OpDef(name="f")
    rec.output_rules.add(kind="broadcast")
    rec.output_rules.add(kind="same_as", input=1, dtype="float64")
    rec.output_rules.add(kind="explicit", shape=[2, 2], dtype="int32")
    for j in range(3):
        rec.outputs.add(index=j, name="o%d" % j)
    g = [[np.empty((4, 1), np.float32)], [np.empty((5,), np.float32)]]
    assert ot._rule_specs(rec, g, {}, "f") == [(np.dtype(np.float32), (4, 5)),
                                               (np.dtype(np.float64), (5,)),
                                               (np.dtype(np.int32), (2, 2))]


def test_fake_tensor_mode(tc):
    from torch._subclasses import FakeTensorMode
    from torch._subclasses.fake_tensor import FakeTensor
    before = tc.call_counts()
    with FakeTensorMode():
        a, b = torch.empty(4, 8), torch.empty(8)
        z = torch.ops.opjit.torch_sem__sem_bmul(a, b)
        y, d = ot.op("sem_cube")(torch.empty(5, dtype=torch.float64))
    assert isinstance(z, FakeTensor) and z.shape == (4, 8) and z.dtype == torch.float32
    assert isinstance(y, FakeTensor) and y.shape == d.shape == (5,) and y.dtype == torch.float64
    # Shape-only tracing: the graph holds the op itself, and no kernel ran.
    from torch.fx.experimental.proxy_tensor import make_fx
    g = make_fx(lambda a, b: torch.ops.opjit.torch_sem__sem_bmul(a, b).sum(0),
                tracing_mode="fake")(rand(4, 8), rand(8))
    assert "opjit.torch_sem__sem_bmul.default" in [str(n.target) for n in g.graph.nodes]
    after = tc.call_counts()
    assert all(after[k] == before[k] for k in ("fast", "grpc", "handle"))
    a, b = rand(4, 8), rand(8, seed=1)
    close(g(a, b), (a * b).sum(0))


class SchemaCheck:
    """A torch dispatch mode that checks each op against its schema, as
    torch's SchemaCheckMode does (which needs expecttest): an argument the
    call changed must be declared written (``Tensor(a!)``), an output that
    shares an argument's memory must be declared its alias. Records
    (op, argument, mutated, aliased outputs)."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __init__(self):
                self.seen = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                before = [a.clone() if isinstance(a, torch.Tensor) else None for a in args]
                out = func(*args, **kwargs)
                outs = out if isinstance(out, tuple) else (out,)
                schema = func._schema
                for k, (arg, a, b) in enumerate(zip(schema.arguments, args, before)):
                    if b is None:
                        continue
                    info = arg.alias_info
                    written = info is not None and info.is_write
                    mutated = not torch.equal(a, b)
                    if mutated and not written:
                        raise AssertionError("%s changed %s, which its schema does not declare "
                                             "written" % (schema.name, arg.name))
                    aliased = [j for j, o in enumerate(outs)
                               if isinstance(o, torch.Tensor) and torch._C._overlaps(o, a)]
                    for j in aliased:
                        ret = schema.returns[j].alias_info
                        if info is None or ret is None or not (set(ret.before_set) &
                                                               set(info.before_set)):
                            raise AssertionError("%s: output %d aliases %s undeclared"
                                                 % (schema.name, j, arg.name))
                    self.seen.append((schema.name, arg.name, mutated, aliased))
                return out

        return Mode()


def test_cross_ref_fake_and_schema_check(tc):
    """opcheck-style: each call run for real and under FakeTensorMode, shapes,
    dtypes, strides and aliasing compared (torch's CrossRefFakeMode); and what
    a call mutates and aliases is what its schema says."""
    from torch._subclasses.fake_utils import CrossRefFakeMode
    ot.op("sem_bmul")
    ot.op("sem_cube")
    ot.op("sem_bmul", aliases={0: 0})
    a, b = rand(4, 8), rand(8, seed=1)
    with CrossRefFakeMode():
        z = torch.ops.opjit.torch_sem__sem_bmul(a, b)
        torch.ops.opjit.torch_sem__sem_cube(a)
        c = a.clone()
        r = torch.ops.opjit.torch_sem__sem_bmul_(c, b)
    close(z, a * b)
    assert r is c
    close(c, a * b)
    mode = SchemaCheck()
    with mode:
        torch.ops.opjit.torch_sem__sem_bmul(a, b)
        c = a.clone()
        torch.ops.opjit.torch_sem__sem_bmul_(c, b)
    ours = [x for x in mode.seen if x[0].startswith("opjit::")]
    assert ours == [("opjit::torch_sem__sem_bmul", "a", False, []),
                    ("opjit::torch_sem__sem_bmul", "b", False, []),
                    ("opjit::torch_sem__sem_bmul_", "a", True, [0]),
                    ("opjit::torch_sem__sem_bmul_", "b", False, [])]


# ---- outputs that alias inputs ----------------------------------------------------------

def test_in_place_op_writes_shared_input_without_copy(tc, stats):
    bmul_ = ot.op("sem_bmul", aliases={0: 0})
    assert bmul_.aliases == {0: 0} and bmul_.torch_name == NS + "__sem_bmul_"
    schema = str(torch.ops.opjit.torch_sem__sem_bmul_.default._schema)
    assert "Tensor(a!) a" in schema and schema.endswith("-> Tensor(a!)")
    a0, b0 = rand(4, 8), rand(8, seed=1)
    a, b = ot.from_tensor(a0), ot.from_tensor(b0)
    assert ot.is_shared(a) and ot.is_shared(b)
    ptr, v0 = a.data_ptr(), a._version
    stats()
    r = bmul_(a, b)
    assert r is a and a.data_ptr() == ptr and a._version > v0
    close(a, a0 * b0)
    s = stats()
    assert (s["shared_inputs"], s["copied_inputs"], s["copied_bytes"]) == (2, 0, 0), s
    assert (s["written_in_place"], s["copied_back"]) == (1, 0), s
    # The torch op too: in place, the version moved on.
    v1 = a._version
    r = torch.ops.opjit.torch_sem__sem_bmul_(a, b)
    assert r is a and a._version > v1
    close(a, a0 * b0 * b0)


def test_in_place_op_on_plain_tensor(tc, stats):
    """An input outside shared memory is written too: a copy in, one back (counted)."""
    bmul_ = ot.op("sem_bmul", aliases={"z": "a"})
    a0, b = rand(4, 8, dtype=torch.float32), rand(8, seed=1, dtype=torch.float32)
    a = a0.clone()
    v0 = a._version
    r = bmul_(a, b)
    assert r is a and a._version > v0
    close(a, a0 * b)
    s = stats()
    assert (s["copied_back"], s["copied_back_bytes"], s["written_in_place"]) == (1, 4 * 8 * 4, 0)
    big = torch.zeros(4, 16)
    v = big[:, ::2]  # non-contiguous: made contiguous, written back through the view
    v.copy_(a0)
    assert not v.is_contiguous() and bmul_(v, b) is v
    close(big[:, ::2], a0 * b)
    assert not big[:, 1::2].any()
    with pytest.raises(opjit.InvalidArgument, match="aliased output must have its input"):
        bmul_(rand(8), rand(4, 8, seed=1))  # the output (4, 8) cannot be written into (8,)
    with pytest.raises(opjit.InvalidArgument, match="has 1 output"):
        ot.op("sem_bmul", aliases={1: 0})


def test_in_place_on_every_path(daemon, tc, stats):
    """Over gRPC with the prepared handle (no fast channel): written in place
    too; with no shared memory at all (inline): computed, then copied back."""
    a0, b = rand(4, 8), rand(8, seed=1)
    with opjit.Client(daemon.unix_address, namespace=NS, timeout=120, fast="off") as c:
        bmul_ = ot.op("sem_bmul", client=c, aliases={0: 0}, register=False)
        a = ot.from_tensor(a0, client=c)
        before = c.call_counts()
        assert bmul_(a, b) is a
        close(a, a0 * b)
        assert c.call_counts()["handle"] == before["handle"] + 1
        assert (stats()["written_in_place"], stats()["copied_back"]) == (1, 0)
    ot.reset_copy_stats()
    with opjit.Client(daemon.tcp_address, namespace=NS, timeout=120, transport="inline") as c:
        bmul_ = ot.op("sem_bmul", client=c, aliases={0: 0}, register=False)
        a = a0.clone()
        assert bmul_(a, b) is a
        close(a, a0 * b)
        assert (stats()["written_in_place"], stats()["copied_back"]) == (0, 1)


def test_in_place_autograd(tc):
    bmul_ = ot.op("sem_bmul", aliases={0: 0})
    x, w = rand(4, 8, requires_grad=True), rand(8, seed=1, requires_grad=True)
    # A leaf that requires grad cannot be written in place (torch's rule).
    with pytest.raises(RuntimeError, match="leaf") as e:
        bmul_(x, w)
    assert isinstance(e.value, ot.InPlaceError) and e.value.reason == "INPLACE_LEAF"
    y = x.clone()
    v0 = y._version
    r = bmul_(y, w)
    assert r is y and y._version > v0 and y.grad_fn is not None
    dy = rand(4, 8, seed=2)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    # torch's own in-place mul; the bprop read a as it was before the write.
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = x2.clone()
    y2.mul_(w2)
    gx2, gw2 = torch.autograd.grad(y2, (x2, w2), dy)
    close(gx, gx2)
    close(gw, gw2)
    # A tensor saved for backward, then written in place: torch's version check.
    t = ot.op("sem_tanh")(x)
    bmul_(t, w)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        t.sum().backward()


# ---- double backward: registered bprop-of-bprops -----------------------------------------

def _double(fn, inputs, seed=7):
    """(first grads, second grads) of fn at inputs, with random cotangents."""
    out = fn(*inputs)
    v = rand(*out.shape, dtype=out.dtype, seed=seed)
    g = torch.autograd.grad(out, inputs, v, create_graph=True)
    w = [rand(*t.shape, dtype=t.dtype, seed=seed + 1 + k) for k, t in enumerate(g)]
    gg = torch.autograd.grad(sum((a * b).sum() for a, b in zip(g, w)), inputs)
    return g, gg


@pytest.mark.parametrize("name", ["tanh", "exp", "cube", "bmul"])
def test_double_backward_through_registered_bprops(tc, name):
    top = tops()[name]
    if name == "bmul":
        def ours(a, b):
            return top(a, b)

        def ref(a, b):
            return a * b
        shapes = [(4, 8), (8,)]
    else:
        def ours(x):
            r = top(x)
            return r[0] if name == "cube" else r
        ref = OPS[name]
        shapes = [(4, 8)]
    inputs = [rand(*s, seed=k, requires_grad=True) for k, s in enumerate(shapes)]
    g, gg = _double(ours, inputs)
    g_ref, gg_ref = _double(ref, inputs)
    for a, b in zip(g, g_ref):
        close(a, b)
    for a, b in zip(gg, gg_ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        close(a, b)
    # through torch.ops as well, and the float32 row
    tname = "torch_sem__sem_" + name
    f = getattr(torch.ops.opjit, tname)
    g2, gg2 = _double(lambda *t: f(*t)[0] if name == "cube" else f(*t), inputs)
    for a, b in zip(gg2, gg_ref):
        close(a, b)
    x32 = [t.detach().float().requires_grad_() for t in inputs]
    g32, _ = _double(ours, x32)
    g32_ref, _ = _double(ref, x32)
    for a, b in zip(g32, g32_ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b)


def test_cube_saved_output_terms(tc):
    """cube's backward reads its saved output d = 3x^2; a loss on d too."""
    cube = ot.op("sem_cube")
    x = rand(5, requires_grad=True)
    y, d = cube(x)
    g, = torch.autograd.grad((y + d * d).sum(), x, create_graph=True)
    close(g, 3 * x.detach() ** 2 + 36 * x.detach() ** 3)
    gg, = torch.autograd.grad(g.sum(), x)
    close(gg, 6 * x.detach() + 108 * x.detach() ** 2)
    assert torch.autograd.gradgradcheck(lambda t: cube(t)[0], (rand(3, requires_grad=True),))


def test_broadcast_grad_summed_and_cast(tc):
    """sem_bmul_grad returns b's grad at a's shape (4, 8): it reaches b summed to (8,)."""
    bmul = ot.op("sem_bmul")
    a, b = rand(4, 8, requires_grad=True), rand(8, seed=1, requires_grad=True)
    call, flat = bmul._bind_call((a, b), {})
    full = torch.ones(4, 8, dtype=torch.float32)
    ga, gb = bmul._fit_grads(call, flat, [None, full])
    assert ga is None and gb.shape == (8,) and gb.dtype == torch.float64
    close(gb, torch.full((8,), 4.0, dtype=torch.float64))
    with pytest.raises(_grad_rules.GradShapeError, match=r"gradient for b.*\[3\].*\[8\]") as e:
        bmul._fit_grads(call, flat, [None, torch.ones(3)])
    assert isinstance(e.value, RuntimeError) and e.value.metadata["input"] == "b"


# ---- double backward through ot.function ---------------------------------------------------

class TapeTanh(opjit.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.tanh()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, = ctx.saved_tensor()
        return dy * (1 - y * y)


class TapeExp(opjit.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, = ctx.saved_tensor()
        return dy * y


class TapeCube(opjit.Function):
    @staticmethod
    def forward(ctx, x):
        d = 3 * x * x
        ctx.save_for_backward(x, d)
        return x * x * x, d

    @staticmethod
    def backward(ctx, dy, dd):
        x, d = ctx.saved_tensor()
        return dy * d + 6 * x * dd


class TapeBmul(opjit.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, dz):
        a, b = ctx.saved_tensor()
        return dz * b, dz * a  # b's grad at a's shape: summed by the frameworks' rule


@pytest.mark.parametrize("name", ["tanh", "exp", "cube", "bmul"])
def test_double_backward_through_function(tc, name):
    fn = ot.function({"tanh": TapeTanh, "exp": TapeExp, "cube": TapeCube,
                      "bmul": TapeBmul}[name])
    if name == "bmul":
        ours, ref, shapes = fn, (lambda a, b: a * b), [(4, 8), (8,)]
    else:
        ours = (lambda x: fn(x)[0]) if name == "cube" else fn
        ref, shapes = OPS[name], [(4, 8)]
    inputs = [rand(*s, seed=k, requires_grad=True) for k, s in enumerate(shapes)]
    g, gg = _double(ours, inputs)
    g_ref, gg_ref = _double(ref, inputs)
    for a, b in zip(g, g_ref):
        close(a, b)
    for a, b in zip(gg, gg_ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        close(a, b)


def test_function_of_registered_ops(tc):
    """An ot.function whose forward and backward call registered ops (on the
    tape, their bprops recorded under create_graph): double backward too."""
    tanh, tanh_grad = tc.op("sem_tanh"), tc.op("sem_tanh_grad")

    class OpTanh(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            y = tanh(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, dy):
            y, = ctx.saved_tensor()
            return tanh_grad(y, dy)

    x = rand(3, 4, requires_grad=True)
    g, gg = _double(ot.function(OpTanh), [x])
    g_ref, gg_ref = _double(torch.tanh, [x])
    close(g[0], g_ref[0])
    close(gg[0], gg_ref[0])


def test_function_outputs_and_grad_dtypes(tc):
    """Integer outputs of an ot.function carry no gradient; grads are cast to the input's dtype."""
    class ArgmaxScale(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            idx = opjit.Tensor(np.argmax(x.numpy(), axis=-1))
            return x * 2, idx

        @staticmethod
        def backward(ctx, dy, didx):
            return (dy * 2).astype(np.float32)

    f = ot.function(ArgmaxScale)
    x = rand(3, 4, requires_grad=True)
    y, idx = f(x)
    assert y.requires_grad and not idx.requires_grad and idx.dtype == torch.int64
    y.sum().backward()
    assert x.grad.dtype == torch.float64
    close(x.grad, torch.full((3, 4), 2.0, dtype=torch.float64))


# ---- forward-mode AD and functorch ------------------------------------------------------------

def test_forward_ad_raises(tc):
    import torch.autograd.forward_ad as fwAD
    tanh = ot.op("sem_tanh")
    f = ot.function(TapeTanh)
    with fwAD.dual_level():
        x = fwAD.make_dual(rand(4), rand(4, seed=1))
        assert fwAD.unpack_dual(torch.tanh(x)).tangent is not None  # torch's own op
        for call in (lambda: tanh(x), lambda: torch.ops.opjit.torch_sem__sem_tanh(x),
                     lambda: f(x)):
            with pytest.raises(NotImplementedError, match="forward-mode AD") as e:
                call()
            assert isinstance(e.value, RuntimeError) and isinstance(e.value, opjit.OpjitError)
            assert e.value.reason == "FORWARD_AD_UNSUPPORTED"
        # A plain tensor in a dual level is still an ordinary call.
        close(tanh(rand(4)), torch.tanh(rand(4)))


def test_functorch(tc):
    functorch = pytest.importorskip("functorch")
    tanh = ot.op("sem_tanh")
    x = rand(3, 4)
    with warnings.catch_warnings():  # torch's "no batching rule" performance warning
        warnings.simplefilter("ignore")
        close(functorch.vmap(torch.ops.opjit.torch_sem__sem_tanh)(x), torch.tanh(x))
        close(functorch.vmap(tanh)(x), torch.tanh(x))  # through the torch op's fallback
        bare = ot.op("sem_tanh", register=False)
        with pytest.raises(ot.UnsupportedTransform, match="vmap"):
            functorch.vmap(bare)(x)
        with pytest.raises(RuntimeError, match="functorch") as e:
            functorch.grad(lambda t: tanh(t).sum())(rand(4))
        assert isinstance(e.value, ot.UnsupportedTransform)
