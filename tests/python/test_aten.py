"""PyTorch ATen kernels, written as MindSpore's guide to third-party operator
libraries shows (kernels/examples/aten/), through a daemon whose config puts
libtorch's, Python's and the example's include directories in [compiler]
extra_include_dirs and allows libtorch_cpu and libc10.

Needs Debian's libtorch-dev, pybind11-dev and python3-dev (deploy/install-deps.sh
installs them); skips with the reason when they are missing.
"""

import json
import os
import sysconfig
import time

import numpy as np
import pytest

import opjit

from conftest import EXAMPLES, TempDaemon

ATEN = os.path.join(EXAMPLES, "aten")
TORCH_API = "/usr/include/torch/csrc/api/include"
PY_INCLUDE = sysconfig.get_paths()["include"]

pytestmark = pytest.mark.skipif(
    not (os.path.exists(os.path.join(TORCH_API, "torch", "all.h"))
         and os.path.exists(os.path.join(PY_INCLUDE, "Python.h"))
         and os.path.exists("/usr/include/pybind11/pybind11.h")),
    reason="libtorch-dev, pybind11-dev or python3-dev is not installed "
           "(deploy/install-deps.sh installs them)")


class AtenDaemon(TempDaemon):
    def __init__(self):
        self.spawn("[compiler]\ntimeout_ms = 900000\n"
                   "extra_include_dirs = %s\n" % json.dumps([TORCH_API, PY_INCLUDE, ATEN]) +
                   'allowed_libraries = ["libtorch_cpu.so", "libc10.so"]\n'
                   # A cold ATen compile takes minutes of CPU on a busy 2-core
                   # machine; the default quota would refuse the next one.
                   "[quota]\ncompile_seconds_per_minute = 100000\n", prefix="opjit-aten-")

    def pch_headers(self):
        d = os.path.join(self.state, "cache", "pch")
        out = []
        for name in sorted(os.listdir(d)):
            if name.endswith(".pch"):
                with open(os.path.join(d, name[:-4] + ".h")) as f:
                    out.append(f.read())
        return out


@pytest.fixture(scope="module")
def aten():
    d = AtenDaemon()
    yield d
    d.close()


def test_aten_kernels_compile_and_run_unchanged(aten):
    with opjit.Client(aten.unix_address, timeout=1200) as c:
        t0 = time.monotonic()
        r = c.register(os.path.join(ATEN, "leaky_relu.json"))
        first_s = time.monotonic() - t0
        assert r.compiled[0].cache_hit == ""
        x = np.linspace(-3, 3, 1001, dtype=np.float32).reshape(7, 143)
        y = c.op("aten_leaky_relu")(x)
        np.testing.assert_allclose(y, np.where(x > 0, x, 0.01 * x), rtol=1e-6)
        x64 = np.linspace(-1, 1, 11)
        np.testing.assert_allclose(c.op("aten_leaky_relu")(x64), np.where(x64 > 0, x64, 0.01 * x64))

        # A second, different kernel with the same include block reuses the
        # first one's precompiled preamble (one PCH for both).
        with open(os.path.join(ATEN, "leaky_relu.json")) as f:
            spec = json.load(f)
        spec["name"] = "aten_softplus"
        spec["implementations"][0].update(source_file="softplus.cc", entry="Softplus")
        t0 = time.monotonic()
        r = c.register(spec, base_dir=ATEN)
        second_s = time.monotonic() - t0
        assert r.compiled[0].cache_hit == ""
        np.testing.assert_allclose(c.op("aten_softplus")(x), np.log1p(np.exp(x)), rtol=1e-5)
        headers = aten.pch_headers()
        assert headers == ['#include <string.h>\n#include <torch/extension.h>\n#include "ms_ext.h"\n'], \
            headers
        print("ATen: first kernel %.1f s (PCH built), second %.1f s" % (first_s, second_s))


def test_aten_compile_errors_name_the_users_file(aten):
    with open(os.path.join(ATEN, "leaky_relu.json")) as f:
        spec = json.load(f)
    spec["name"] = "aten_broken"
    spec["implementations"][0]["source"] = (
        '#include <string.h>\n#include <torch/extension.h>\n#include "ms_ext.h"\n'
        'extern "C" int LeakyRelu(int n, void** p, int* nd, int64_t** s, const char** d,\n'
        '                         void* st, void* e) {\n  return torch::no_such_op();\n}\n')
    spec["implementations"][0]["source_file"] = "my_relu.cc"
    with opjit.Client(aten.unix_address, timeout=1200) as c:
        with pytest.raises(opjit.InvalidArgument) as e:
            c.register(spec)
    assert e.value.reason == "COMPILE_FAILED"
    assert "my_relu.cc:6:17: error: no member named 'no_such_op'" in str(e.value), str(e.value)
