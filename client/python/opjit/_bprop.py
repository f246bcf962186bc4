"""A registered bprop run from tensors the client holds (shared by the tape and opjit.torch).

The daemon's autograd (server/autograd/autograd.cc) keeps a context per
forward: copies of the tensors the bprop reads, and at Backward it calls the
bprop op with them. This module says the same things on the client, so that
a forward and its backward can each be one plain op call (the fast channel
included) while the client keeps what the bprop needs:

* :func:`bprop_args`: the bprop's inputs as ``backward.inputs`` resolves
  them (server/registry/bprop_args.cc): ``("in" | "out" | "grad", index)``.
* :class:`BpropPlan`: per forward definition, which inputs and outputs to
  save, which outputs are non-differentiable, whether missing grads are zeros
  (``materialize_grads``), the ``stop_gradient_grads`` policy, and whether the
  client can express the bprop call at all (``ok``; ``why`` when it cannot).
* :func:`bprop_groups`: the bprop call's inputs from the saved tensors and
  the output grads, in ``backward.inputs`` order.
* :func:`check_stop_gradient`: a nonzero grad for an input that needs none,
  reported as the server reports it (a warning, or FAILED_PRECONDITION with
  reason ``STOP_GRADIENT_GRAD``).
"""

import warnings

import numpy as np

from opjit._grad_rules import fit_grad
from opjit.errors import FailedPrecondition, InvalidArgument, StopGradientGradWarning

__all__ = ["bprop_args", "BpropPlan", "bprop_groups", "check_stop_gradient", "nonzero"]


def bprop_args(opdef):
    """The bprop's inputs of an op definition (v1.OpDef), as the server
    resolves backward.inputs: a list of ("in" | "out" | "grad", index).
    Empty backward.inputs: (every input, every output, every output grad)."""
    ins = [p.name for p in sorted(opdef.inputs, key=lambda p: p.index)]
    outs = [p.name for p in sorted(opdef.outputs, key=lambda p: p.index)]
    entries = list(opdef.backward.inputs)
    if not entries:
        return ([("in", i) for i in range(len(ins))] + [("out", j) for j in range(len(outs))] +
                [("grad", j) for j in range(len(outs))])
    args = []
    for e in entries:
        if e in ins:
            args.append(("in", ins.index(e)))
        elif e in outs:
            args.append(("out", outs.index(e)))
        elif e in ("out", "dout"):
            args.extend((("out" if e == "out" else "grad"), j) for j in range(len(outs)))
        elif e.startswith("in:") and e[3:] in ins:
            args.append(("in", ins.index(e[3:])))
        elif e.split(":", 1)[0] in ("out", "grad", "dout") and e.split(":", 1)[-1] in outs:
            kind = "out" if e.startswith("out:") else "grad"
            args.append((kind, outs.index(e.split(":", 1)[1])))
        else:
            raise InvalidArgument("backward.inputs: %r names no tensor of op %s" % (e, opdef.name))
    return args


class BpropPlan:
    """How a forward's backward runs from client-held tensors.

    ``args``: bprop_args; ``save_in``/``save_out``: indices of the inputs and
    outputs to keep (those ``args`` names, less what ``save_for_backward``
    leaves out); ``non_diff``: indices of non-differentiable outputs;
    ``materialize``: missing grads are zeros (else null slots);
    ``policy``: "warn" or "error" for stop_gradient grads; ``bprop``: the
    bprop op's name; ``dynamic``: per bprop input, whether it is dynamic.
    ``ok`` is False (``why`` says why) when the client cannot express the call
    the server would make; then the caller keeps the daemon's context instead.
    """

    __slots__ = ("opdef", "args", "save_in", "save_out", "non_diff", "materialize", "policy",
                 "bprop", "dynamic", "bprop_attrs", "in_names", "out_names", "ok", "why")

    def __init__(self, opdef, bdef):
        """opdef: the forward's v1.OpDef; bdef: its bprop's (v1.OpDef)."""
        self.opdef = opdef
        b = opdef.backward
        self.bprop = b.op
        inputs = sorted(opdef.inputs, key=lambda p: p.index)
        outputs = sorted(opdef.outputs, key=lambda p: p.index)
        self.in_names = [p.name for p in inputs]
        self.out_names = [p.name for p in outputs]
        self.args = bprop_args(opdef)
        save = set(b.save_for_backward)
        self.save_in = {i for kind, i in self.args if kind == "in"
                        and (not save or self.in_names[i] in save)}
        self.save_out = {j for kind, j in self.args if kind == "out"
                         and (not save or self.out_names[j] in save)}
        nd = set(b.non_differentiable)
        self.non_diff = frozenset(j for j, n in enumerate(self.out_names) if n in nd)
        self.materialize = b.materialize_grads if b.HasField("materialize_grads") else True
        self.policy = "error" if b.stop_gradient_grads == "error" else "warn"
        binputs = sorted(bdef.inputs, key=lambda p: p.index)
        self.dynamic = [(p.param_type or "required") == "dynamic" for p in binputs]
        self.bprop_attrs = frozenset(a.name for a in bdef.attrs)
        self.ok, self.why = True, ""
        if len(binputs) != len(self.args) or len(bdef.outputs) != len(inputs):
            # The server answers this backward with CheckBpropSignature's error.
            self.ok, self.why = False, "the bprop's signature does not match backward.inputs"
            return
        for (kind, i), p in zip(self.args, binputs):
            optional = (p.param_type or "required") == "optional"
            dyn = (p.param_type or "required") == "dynamic"
            if kind == "in":
                fdyn = (inputs[i].param_type or "required") == "dynamic"
                if fdyn != dyn:
                    self.ok, self.why = False, "a dynamic input meets a non-dynamic bprop input"
                    return
                if i not in self.save_in and not optional:
                    # The server passes a null placeholder (params[i] == nullptr)
                    # in a required slot; an op call cannot.
                    self.ok, self.why = False, "an unsaved input in a required bprop input"
                    return
            elif kind == "out":
                if i not in self.save_out and not optional:
                    self.ok, self.why = False, "an unsaved output in a required bprop input"
                    return
            elif not self.materialize and not optional:
                # A missing grad is a null slot there.
                self.ok, self.why = False, "materialize_grads false with a required grad input"
                return


def nonzero(a):
    """Whether array a holds anything but zeros (-0.0 is zero too)."""
    return a.size > 0 and bool(np.any(a))


def bprop_groups(plan, saved_in, saved_out, grads, out_meta):
    """The bprop call's inputs, one per bprop input: an array, a list (a
    dynamic input) or None (absent). saved_in: per forward input, a list of
    arrays (empty: absent) or None (not saved); saved_out: per output, an
    array or None; grads: per output, an array (or Tensor) or None; out_meta:
    per output (shape, dtype), for zero grads."""
    values = []
    for (kind, i), dyn in zip(plan.args, plan.dynamic):
        if kind == "in":
            g = saved_in[i]
            values.append(None if not g else (list(g) if dyn else g[0]))
        elif kind == "out":
            values.append(saved_out[i])
        else:
            g = grads[i] if i < len(grads) and i not in plan.non_diff else None
            if g is None and plan.materialize:
                shape, dtype = out_meta[i]
                g = np.zeros(shape, dtype)
            values.append(g)
    return values


def check_grad(plan, j, g, meta, qualified_name):
    """The grad given for output j, in the output's shape and dtype: summed
    where it broadcasts, cast (opjit._grad_rules, the rule every autograd
    path shares); GradShapeError (an InvalidArgument) naming the output and
    both shapes where it cannot be. g: an ndarray or a Tensor (returned as
    such)."""
    shape, dtype = meta
    if tuple(g.shape) == tuple(shape) and g.dtype == dtype:
        return g
    return fit_grad(g, shape, dtype, "grad_outputs[%d] (%s)" % (j, plan.out_names[j]),
                    where="op %s" % qualified_name)


def check_stop_gradient(plan, qualified_name, i, g, stacklevel=4):
    """The bprop returned grad g for input i, which needs none: nothing when
    it is all zeros, else a warning (it is dropped) or, with
    stop_gradient_grads "error", FailedPrecondition STOP_GRADIENT_GRAD.
    The words are the daemon's (CollectGrads)."""
    if g is None or not nonzero(g):
        return
    name = plan.in_names[i]
    what = ("the bprop %s of %s returned a nonzero grad for input %s, which needs none "
            "(requires_grad false, Paddle's stop_gradient)" % (plan.bprop, qualified_name, name))
    if plan.policy == "error":
        raise FailedPrecondition(what + '; backward.stop_gradient_grads is "error": return zeros '
                                 "for it, or set requires_grad on it",
                                 reason="STOP_GRADIENT_GRAD", metadata={"input": name})
    warnings.warn("backward of %s: %s; it was dropped" % (qualified_name, what),
                  StopGradientGradWarning, stacklevel=stacklevel)
