#!/usr/bin/env python3
"""arith3: one op, three outputs (x + y, x * y, x / y), registered from its JSON spec.

Needs a running opjitd ($OPJIT_SERVER or the default socket).
"""
import os

import numpy as np

import opjit

SPEC = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                     "..", "..", "..", "kernels", "examples", "arith3.json"))

if __name__ == "__main__":
    with opjit.Client() as client:
        client.register(SPEC)  # source_file is read relative to the spec
        arith3 = client.op("arith3")

        x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
        y = np.array([[2.0, 4.0], [6.0, 8.0]], np.float32)
        total, product, quotient = arith3(x, y)  # several outputs come back as a tuple
        print("x + y =", total.tolist())
        print("x * y =", product.tolist())
        print("x / y =", quotient.tolist())
        np.testing.assert_allclose(total, x + y)
        np.testing.assert_allclose(product, x * y)
        np.testing.assert_allclose(quotient, x / y)

        # Inputs by name work too, and outputs feed later calls without copies.
        again = arith3(x=total, y=product)
        np.testing.assert_allclose(again[0], (x + y) + (x * y))
        print("ok")
