#!/usr/bin/env python3
"""Paddle's PyLayer tanh example on opjit: a Function whose forward and backward call daemon ops.

forward runs op `tanh` and saves y with ctx.save_for_backward; backward reads
it back with ctx.saved_tensor() and computes dy * (1 - y^2) with op
`tanh_grad`. The backward runs here, client side; the arithmetic runs in
opjitd. Needs a running opjitd ($OPJIT_SERVER or the default socket).
"""
import numpy as np

import opjit
from opjit import CustomRegOp, DataType

TANH = r'''
#include <cmath>
#include <cstdint>
extern "C" int Tanh(int nparam, void** params, int* ndims, int64_t** shapes,
                    const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = std::tanh(x[i]);
  return 0;
}
'''

TANH_GRAD = r'''
#include <cstdint>
// inputs: dy, y; output: dx = dy * (1 - y^2)
extern "C" int TanhGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                        const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* dy = static_cast<const float*>(params[0]);
  const float* y = static_cast<const float*>(params[1]);
  float* dx = static_cast<float*>(params[2]);
  for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * (1.0f - y[i] * y[i]);
  return 0;
}
'''

F32 = DataType.F32_Default

client = opjit.Client()
client.register(CustomRegOp("tanh").input(0, "x").output(0, "y").dtype_format(F32, F32)
                .target("CPU").impl(source=TANH, entry="Tanh").output_rule("same_as", input=0))
client.register(CustomRegOp("tanh_grad").input(0, "dy").input(1, "y").output(0, "dx")
                .dtype_format(F32, F32, F32).target("CPU").impl(source=TANH_GRAD, entry="TanhGrad")
                .output_rule("same_as", input=0))
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
        return tanh_grad(dy, y)


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
