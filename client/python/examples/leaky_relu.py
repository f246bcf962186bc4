#!/usr/bin/env python3
"""leaky_relu: MindSpore's aot kernel (kernels/examples/leaky_relu.cc), unchanged, on opjitd.

Registers the op with the CustomRegOp builder, then calls it on numpy arrays,
like MindSpore's test_cpu_op.py. Needs a running opjitd ($OPJIT_SERVER or the
default socket).
"""
import os

import numpy as np

import opjit
from opjit import CustomRegOp, DataType

KERNELS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "..", "..", "..", "kernels", "examples"))

leaky_relu_info = (CustomRegOp("leaky_relu")
                   .input(0, "x", "required")
                   .output(0, "y", "required")
                   .attr("alpha", "optional", "float", "0.01")
                   .dtype_format(DataType.F32_Default, DataType.F32_Default)
                   .dtype_format(DataType.F16_Default, DataType.F16_Default)
                   .target("CPU")
                   .impl(source_file="leaky_relu.cc", entry="CustomLeakyRelu", language="c++")
                   .output_rule("same_as", input=0)
                   .doc("y = x if x > 0 else alpha * x")
                   .get_op_info())

if __name__ == "__main__":
    with opjit.Client() as client:
        reg = client.register(leaky_relu_info, base_dir=KERNELS)
        print("registered %s version %d" % (reg.record.op.name, reg.record.version))
        leaky_relu = client.op("leaky_relu")

        x0 = np.array([[0.0, -0.1], [-0.2, 1.0]]).astype(np.float32)
        output = leaky_relu(x0)
        print(output)
        np.testing.assert_allclose(output, [[0.0, -0.001], [-0.002, 1.0]], rtol=1e-6)

        # float16 and an explicit attr
        y16 = leaky_relu(x0.astype(np.float16), alpha=0.5)
        print(y16)
        np.testing.assert_allclose(y16, [[0.0, -0.05], [-0.1, 1.0]], atol=1e-3)
        print("transport:", client.transport)
