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
import numpy as np

import opjit
from opjit import CustomRegOp, DataType

SQUARE = r'''
#include <cstdint>
extern "C" int Square(int nparam, void** params, int* ndims, int64_t** shapes,
                      const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * x[i];
  return 0;
}
'''

SQUARE_GRAD = r'''
#include <cstdint>
extern "C" int SquareGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                          const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);   // forward input
  const float* dout = static_cast<const float*>(params[2]); // output grad (params[1] is y)
  float* dx = static_cast<float*>(params[3]);
  for (int64_t i = 0; i < n; ++i) dx[i] = 2.0f * x[i];
  for (int64_t i = 0; i < n; ++i) dx[i] = dx[i] * dout[i];
  return 0;
}
'''

F32 = DataType.F32_Default

if __name__ == "__main__":
    with opjit.Client() as client:
        # The bprop is an op of its own; register it first.
        client.register(CustomRegOp("square_grad").input(0, "x").input(1, "out")
                        .input(2, "dout").output(0, "dx").dtype_format(F32, F32, F32, F32)
                        .target("CPU").impl(source=SQUARE_GRAD, entry="SquareGrad")
                        .output_rule("same_as", input=0))
        client.register(CustomRegOp("square").input(0, "x").output(0, "y").dtype_format(F32, F32)
                        .target("CPU").impl(source=SQUARE, entry="Square")
                        .output_rule("same_as", input=0).bprop("square_grad"))
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
