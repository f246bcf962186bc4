#!/usr/bin/env python3
"""MindSpore's bprop example on opjit: op `square` with a registered backward op.

square computes y = x * x (the seed's kernel read y before writing it; this
one reads x). Its bprop `square_grad` follows MindSpore's convention: inputs
(forward inputs..., forward outputs..., output grads...) = (x, y, dy), one
output per forward input: dx = 2 * x * dy. The backward runs in opjitd
(Backward RPC) on the context the forward kept. Then GradCheck compares the
bprop with finite differences. Needs a running opjitd ($OPJIT_SERVER or the
default socket) with Backward support.
"""
import os

import numpy as np

import opjit
from opjit import CustomRegOp, DataType

# square.cc holds Square and its bprop SquareGrad (and SquareGradGrad).
KERNELS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "..", "..", "..", "kernels", "examples"))

F32 = DataType.F32_Default

if __name__ == "__main__":
    with opjit.Client() as client:
        # The bprop is an op of its own; register it first.
        client.register(CustomRegOp("square_grad").input(0, "x").input(1, "out")
                        .input(2, "dout").output(0, "dx").dtype_format(F32, F32, F32, F32)
                        .target("CPU").impl(source_file="square.cc", entry="SquareGrad")
                        .output_rule("same_as", input=0), base_dir=KERNELS)
        client.register(CustomRegOp("square").input(0, "x").output(0, "y").dtype_format(F32, F32)
                        .target("CPU").impl(source_file="square.cc", entry="Square")
                        .output_rule("same_as", input=0).bprop("square_grad"), base_dir=KERNELS)
        square = client.op("square")

        x = opjit.tensor(np.array([1.0, 4.0, 9.0]).astype(np.float32), requires_grad=True)
        y = square(x)
        print("y =", y.numpy())
        np.testing.assert_allclose(y.numpy(), [1.0, 16.0, 81.0])
        y.backward(np.ones(3, np.float32))  # ms.grad(Net())(x): sens = ones
        dx = x.grad
        print(dx)
        np.testing.assert_allclose(dx, [2.0, 8.0, 18.0])

        result = opjit.gradcheck(client, "square", inputs=[x.numpy()], atol=1e-2, rtol=1e-2)
        print(result)
        assert result.passed
        print("ok")
