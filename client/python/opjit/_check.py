"""Client-side gradient checks of Python functions of Tensors (torch.autograd.gradcheck style).

``gradcheck(fn, inputs)`` compares the tape's gradients of ``fn`` with
central differences; ``gradgradcheck(fn, inputs)`` does the same for the
gradients themselves, taken with ``create_graph=True``, i.e. it checks
double backward. ``fn`` may mix client-side Tensor math and daemon ops.
"""

import numpy as np

from opjit.autograd import Tensor, grad
from opjit.errors import InvalidArgument

__all__ = ["check_function", "gradgradcheck", "FunctionCheckResult"]


class FunctionCheckInput:
    """One input's comparison: worst element and errors."""

    def __init__(self, index, max_abs_error, max_rel_error, worst_index, analytic, numeric,
                 passed):
        self.index = index
        self.name = "input %d" % index
        self.max_abs_error = max_abs_error
        self.max_rel_error = max_rel_error
        self.worst_index = worst_index
        self.analytic = analytic
        self.numeric = numeric
        self.passed = passed

    def __repr__(self):
        return ("FunctionCheckInput(%s: %s, max_abs_error=%.3g, max_rel_error=%.3g, "
                "worst_index=%d, analytic=%.6g, numeric=%.6g)" % (
                    self.name, "passed" if self.passed else "FAILED", self.max_abs_error,
                    self.max_rel_error, self.worst_index, self.analytic, self.numeric))


class FunctionCheckResult:
    """Result of gradcheck(fn, inputs) / gradgradcheck: truthy when passed."""

    def __init__(self, order, inputs):
        self.order = order
        self.inputs = inputs
        self.passed = all(i.passed for i in inputs)

    def __bool__(self):
        return bool(self.passed)

    def __repr__(self):
        return "FunctionCheckResult(order=%d, passed=%s, inputs=%r)" % (
            self.order, self.passed, self.inputs)


def _outputs(fn, xs):
    out = fn(*xs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return [o for o in outs if isinstance(o, Tensor)]


def _defaults(xs, eps, atol, rtol):
    wide = all(x.dtype == np.float64 for x in xs)
    if eps is None:
        eps = 1e-6 if wide else 1e-3
    if atol is None:
        atol = 1e-5 if wide else 1e-3
    if rtol is None:
        rtol = 1e-3 if wide else 1e-2
    return eps, atol, rtol


def _check(fn, inputs, eps, atol, rtol, seed, order):
    xs = [x if isinstance(x, Tensor) else Tensor(np.asarray(x)) for x in inputs]
    wrt = [x for x in xs if x.requires_grad]
    if not wrt:
        raise InvalidArgument("gradcheck: no input requires grad")
    for x in wrt:
        if x.dtype.kind != "f":
            raise InvalidArgument("gradcheck: input of dtype %s cannot be differentiated"
                                  % x.dtype)
    eps, atol, rtol = _defaults(wrt, eps, atol, rtol)
    rng = np.random.default_rng(seed)
    outs = _outputs(fn, xs)
    vs = [rng.uniform(0.5, 1.5, o.shape).astype(o.dtype) for o in outs]

    def scalar():
        """sum(v * fn(xs)), the quantity whose gradient the tape computes."""
        # Grad mode stays on: fn may take gradients itself (gradgradcheck).
        return sum(float(np.sum(v.astype(np.float64) * o.data))
                   for v, o in zip(vs, _outputs(fn, xs)))

    analytic = grad(outs, wrt, grad_outputs=list(vs), allow_unused=True)
    results = []
    for k, x in enumerate(wrt):
        a = analytic[k]
        a = np.zeros(x.shape) if a is None else np.asarray(a, np.float64)
        flat = x.data.reshape(-1)
        if not np.shares_memory(flat, x.data) and flat.size:
            raise InvalidArgument("gradcheck: input %d is not contiguous" % k)
        numeric = np.zeros(flat.size)
        for e in range(flat.size):
            x0 = flat[e].copy()
            flat[e] = x0 + eps
            plus, hi = scalar(), flat[e].copy()
            flat[e] = x0 - eps
            minus, lo = scalar(), flat[e].copy()
            flat[e] = x0
            numeric[e] = (plus - minus) / float(hi - lo)
        af = a.reshape(-1)
        err = np.abs(af - numeric)
        bound = atol + rtol * np.abs(numeric)
        worst = int(np.argmax(err - bound)) if err.size else 0
        rel = err / np.maximum(np.abs(numeric), 1e-12)
        results.append(FunctionCheckInput(
            k, float(err.max()) if err.size else 0.0, float(rel.max()) if rel.size else 0.0,
            worst, float(af[worst]) if af.size else 0.0,
            float(numeric[worst]) if numeric.size else 0.0, bool(np.all(err <= bound))))
    return FunctionCheckResult(order, results)


def check_function(fn, inputs, eps=None, atol=None, rtol=None, seed=0):
    """First order: the tape's gradients of fn at inputs vs central differences.

    fn takes Tensors and returns a Tensor (or a tuple); the inputs with
    requires_grad are checked. float64 inputs are advised (defaults: eps 1e-6,
    atol 1e-5, rtol 1e-3; float32: 1e-3, 1e-3, 1e-2). An element passes when
    |analytic - numeric| <= atol + rtol * |numeric|.
    """
    return _check(fn, inputs, eps, atol, rtol, seed, 1)


def gradgradcheck(fn, inputs, eps=None, atol=None, rtol=None, seed=0):
    """Second order: double backward of fn vs central differences of its gradient.

    The gradient g(x) = grad(fn(x), x, v, create_graph=True) (v random, fixed)
    is itself differentiated by the tape, and compared with central
    differences of sum(u * g(x)) (u random, fixed). Returns
    FunctionCheckResult (truthy when passed).
    """
    xs = [x if isinstance(x, Tensor) else Tensor(np.asarray(x)) for x in inputs]
    wrt = [x for x in xs if x.requires_grad]
    rng = np.random.default_rng(seed + 1)
    outs = _outputs(fn, xs)
    vs = [rng.uniform(0.5, 1.5, o.shape).astype(o.dtype) for o in outs]
    us = [rng.uniform(0.5, 1.5, x.shape).astype(x.dtype) for x in wrt]

    def first_order(*args):
        gs = grad(_outputs(fn, args), wrt, grad_outputs=list(vs), create_graph=True)
        total = None
        for g, u in zip(gs, us):
            if g is None:
                continue
            term = (g * u).sum()
            total = term if total is None else total + term
        if total is None:
            raise InvalidArgument("gradgradcheck: fn does not depend on its inputs")
        return total
    return _check(first_order, xs, eps, atol, rtol, seed, 2)
