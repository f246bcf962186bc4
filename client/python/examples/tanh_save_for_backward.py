#!/usr/bin/env python3
"""Paddle's PyLayer tanh example on opjit: a Function whose forward and backward call daemon ops.

forward runs op `tanh` and saves y with ctx.save_for_backward; backward reads
it back with ctx.saved_tensor() and computes dy * (1 - y^2) with op
`tanh_grad`. The backward runs here, client side; the arithmetic runs in
opjitd. Needs a running opjitd ($OPJIT_SERVER or the default socket).
"""
import os

import numpy as np

import opjit
from opjit import CustomRegOp, DataType

# tanh.cc holds Tanh and TanhGrad; called directly, TanhGrad takes (y, dy).
KERNELS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "..", "..", "..", "kernels", "examples"))

F32 = DataType.F32_Default

client = opjit.Client()
client.register(CustomRegOp("tanh").input(0, "x").output(0, "y").dtype_format(F32, F32)
                .target("CPU").impl(source_file="tanh.cc", entry="Tanh").output_rule("same_as", input=0),
                base_dir=KERNELS)
client.register(CustomRegOp("tanh_grad").input(0, "y").input(1, "dy").output(0, "dx")
                .dtype_format(F32, F32, F32).target("CPU").impl(source_file="tanh.cc",
                                                                        entry="TanhGrad")
                .output_rule("same_as", input=0), base_dir=KERNELS)
tanh = client.op("tanh")
tanh_grad = client.op("tanh_grad")


class cus_tanh(opjit.Function):
    @staticmethod
    def forward(ctx, x):
        y = tanh(x)
        # ctx carries y from forward to backward.
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        # one forward output, so one gradient in; one forward input, so one out.
        y, = ctx.saved_tensor()
        return tanh_grad(y, dy)


if __name__ == "__main__":
    data = opjit.tensor(np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32))
    data.stop_gradient = False
    z = cus_tanh.apply(data)
    # z.mean().backward(): the gradient of the mean is 1/N everywhere.
    z.backward(np.full(z.shape, 1.0 / z.size, np.float32))
    print(data.grad)

    expected = (1.0 - np.tanh(data.numpy()) ** 2) / z.size
    np.testing.assert_allclose(data.grad, expected, rtol=1e-5)
    client.close()
    print("ok")
