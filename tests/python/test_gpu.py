"""GPU ops from the Python client, against a real opjitd (`make test-gpu`).

An NVRTC kernel (scale_add: a template instantiated through a launch spec)
and a MindSpore aot `.cu` kernel built by nvcc (add_aot) are registered from
kernels/examples and called with target="GPU" over shared memory and inline
bytes, and checked against numpy and the op's CPU implementation. Device
memory and out-of-memory are covered below the daemon, by gpu_exec_test.

Without a GPU every test skips, naming the daemon's reason, unless
OPJIT_REQUIRE_GPU=1 (set by `make test-gpu`): then a missing GPU fails.
"""
import json
import os
import shutil

import numpy as np
import pytest

import opjit

EXAMPLES = os.path.join(os.environ.get("OPJIT_SOURCE_DIR", ""), "kernels", "examples")
REQUIRE = os.environ.get("OPJIT_REQUIRE_GPU") == "1"


@pytest.fixture(scope="module")
def gpu(daemon):
    with opjit.Client(daemon.unix_address, timeout=120) as c:
        info = c.info()
    if not os.path.exists("/usr/local/cuda/include/nvrtc.h"):
        reason = "no CUDA toolkit in /usr/local/cuda"
    elif not info.gpu.available:
        reason = "the daemon sees no GPU: %s" % (info.gpu.reason or "no device")
    else:
        return info.gpu
    if REQUIRE:
        pytest.fail("OPJIT_REQUIRE_GPU=1 but " + reason)
    pytest.skip(reason)


def register_copy(client, tmp_path, spec_name, new_name, source):
    with open(os.path.join(EXAMPLES, spec_name)) as f:
        spec = json.load(f)
    spec["name"] = new_name
    shutil.copy(os.path.join(EXAMPLES, source), tmp_path / source)
    path = tmp_path / (new_name + ".json")
    path.write_text(json.dumps(spec))
    return client.register(str(path))


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_nvrtc_op_runs_on_the_gpu(gpu, daemon, tmp_path, transport):
    address = daemon.unix_address if transport == "shm" else daemon.tcp_address
    with opjit.Client(address, timeout=120, transport=transport) as c:
        register_copy(c, tmp_path, "scale_add_gpu.json", "gpu_scale_add_" + transport,
                      "scale_add.cu")
        op = c.op("gpu_scale_add_" + transport)
        x = np.random.default_rng(0).standard_normal(100_003).astype(np.float32)
        b = np.ones_like(x)
        y_gpu = op(x, b, alpha=2.5, target="GPU")
        y_cpu = op(x, b, alpha=2.5, target="CPU")
        np.testing.assert_allclose(y_gpu, 2.5 * x + b, rtol=1e-6)
        np.testing.assert_allclose(y_gpu, y_cpu, rtol=1e-6)


def test_mindspore_aot_cu_through_nvcc(gpu, client, tmp_path):
    register_copy(client, tmp_path, "add_aot_gpu.json", "gpu_add_aot", "add_aot.cu")
    op = client.op("gpu_add_aot")
    x = np.arange(4096, dtype=np.float32)
    y = np.full(4096, 0.5, dtype=np.float32)
    np.testing.assert_array_equal(op(x, y, target="GPU"), x + y)

