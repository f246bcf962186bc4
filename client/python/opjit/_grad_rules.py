"""The gradient rules every opjit autograd path shares.

The Python tape (opjit.autograd: math nodes, op nodes, Function/PyLayer),
opjit.torch and opjit.mindspore's ``Custom``/``_Function`` all hand a
gradient to an input through ``fit_grad``, so the three agree on what the
frameworks agree on:

* a gradient whose shape broadcasts to the input's is summed back to it
  (torch's engine ``sum_to``, MindSpore's ``auto_reduce``);
* it is cast to the input's dtype (torch's engine, MindSpore's
  ``auto_cast``);
* anything else is refused, naming the input and both shapes
  (``GradShapeError``: an ``InvalidArgument`` that is also the framework's
  own exception type, ``RuntimeError`` as torch raises);
* only floating and complex tensors are differentiable
  (``differentiable``): integer and bool outputs get no gradient.

A gradient is an ndarray or an opjit.Tensor; a Tensor is reduced and cast
with recorded Tensor ops, so under ``create_graph`` the reduction is part of
the graph (double backward through a broadcast stays exact).
"""

import numpy as np

from opjit.errors import InvalidArgument

__all__ = ["GradShapeError", "differentiable", "expandable", "sum_to", "fit_grad"]


class GradShapeError(InvalidArgument, RuntimeError):
    """A gradient that cannot be reduced to its input's shape (torch raises RuntimeError).

    Its reason is ``GRAD_SHAPE``; metadata names the input and both shapes."""


def differentiable(dtype):
    """Whether tensors of dtype carry gradients (floating point and complex)."""
    return np.dtype(dtype).kind in "fc"


def expandable(shape, to):
    """Whether a tensor of `shape` broadcasts to `to` (torch's is_expandable_to)."""
    shape, to = tuple(shape), tuple(to)
    if len(shape) > len(to):
        return False
    for a, b in zip(reversed(shape), reversed(to)):
        if a != b and a != 1:
            return False
    return True


def _is_tensor(g):
    return not isinstance(g, np.ndarray) and hasattr(g, "grad_fn")


def sum_to(g, shape):
    """g summed over the axes along which `shape` was broadcast to g's shape.

    g: ndarray or opjit.Tensor whose shape `shape` is expandable to. The
    result has exactly `shape`."""
    shape = tuple(shape)
    gshape = tuple(g.shape)
    if gshape == shape:
        return g
    lead = len(gshape) - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and gshape[lead + i] != 1)
    if _is_tensor(g):
        if axes:
            g = g.sum(axis=axes, keepdims=True)
        return g.reshape(shape) if tuple(g.shape) != shape else g
    if axes:
        g = np.sum(g, axis=axes, keepdims=True)
    return np.reshape(g, shape)


def fit_grad(g, shape, dtype, name, where="", reduce=True, cast=True):
    """The gradient g for an input of `shape` and `dtype`, as the frameworks deliver it.

    name: the input's name (or "input 1") for the error; where: who returned
    g ("Square.backward"), for the error too. reduce/cast turn the summing
    and the cast off (a framework that refuses instead). Returns g, reduced
    and cast (an ndarray or a Tensor, as given); raises GradShapeError."""
    if g is None:
        return None
    if not _is_tensor(g) and not isinstance(g, np.ndarray):
        g = np.asarray(g)
    shape = tuple(shape)
    if tuple(g.shape) != shape:
        if not (reduce and expandable(shape, g.shape)):
            raise GradShapeError(
                "%sgradient for %s has shape %s, which does not match the input's shape %s%s"
                % ((where + ": ") if where else "", name, list(g.shape), list(shape),
                   "" if not reduce else " and cannot be summed to it"),
                reason="GRAD_SHAPE", metadata={"input": str(name), "grad_shape": str(list(g.shape)),
                          "input_shape": str(list(shape))})
        g = sum_to(g, shape)
    dtype = np.dtype(dtype)
    if cast and g.dtype != dtype and differentiable(dtype):
        g = g.astype(dtype)
    return g
