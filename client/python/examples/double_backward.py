#!/usr/bin/env python3
"""Paddle/torch-style scripts on opjit: a daemon op, Tensor math, mean().backward(), and
double backward with create_graph.

`square` (kernels/examples/square.json) has the bprop `square_grad`, which
has its own bprop `square_grad_grad`, so its gradient can be differentiated
again: with create_graph=True the server keeps a context on the bprop call
too. The Tensor arithmetic around it (`* 0.5`, `+ x`, `mean`) runs in this
process with numpy and is recorded on the same tape. Needs a running opjitd
($OPJIT_SERVER or the default socket).
"""
import os

import numpy as np

import opjit

KERNELS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "..", "..", "..", "kernels", "examples"))

if __name__ == "__main__":
    # A namespace of its own: other examples register a `square` without a bprop's bprop.
    with opjit.Client(namespace="double_backward_example") as client:
        for name in ("square_grad_grad", "square_grad", "square"):  # bprops first
            client.register(os.path.join(KERNELS, name + ".json"))
        square = client.op("square")

        x = opjit.tensor(np.array([1.0, -2.0, 3.0], np.float32), requires_grad=True)
        loss = (square(x) * 0.5 + x).mean()           # y = op(x), then client-side math
        loss.backward()                               # Paddle: z.mean().backward()
        print("d loss/dx =", x.grad)                  # (x + 1) / 3
        np.testing.assert_allclose(x.grad, (x.numpy() + 1) / 3, rtol=1e-6)

        loss = (square(x) * 0.5 + x).mean()
        g, = opjit.grad(loss, x, create_graph=True)   # a Tensor with a grad_fn
        gg, = opjit.grad(g.sum(), x)                  # through square_grad_grad
        print("d2 loss/dx2 (summed) =", gg)           # 1/3 each
        np.testing.assert_allclose(gg, np.full(3, 1 / 3), rtol=1e-6)

        result = opjit.gradgradcheck(lambda t: square(t) * t, [x])
        print(result)
        assert result
        print("ok")
