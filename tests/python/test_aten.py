"""PyTorch ATen kernels, written as MindSpore's guide to third-party operator
libraries shows (seed 003; kernels/examples/aten/), through a daemon whose
config names no include directory or library of libtorch's: the "aten"
toolchain profile is on by default where libtorch-dev is installed, and a
kernel selects it by naming its libraries. Its config only says who may
([toolchains.aten] namespaces) and builds the profile's shared PCH of
<torch/extension.h> as it starts, charged to no one.

The guide's own layout (leaky_relu.cpp, ms_ext.h with declarations, ms_ext.cpp
with the code) compiles cold within the default limits ([compiler] timeout_ms,
30 s of CPU in the long lane; [quota] compile_seconds_per_minute, 120): both
of its translation units load the shared PCH.

Needs Debian's libtorch-dev, pybind11-dev and python3-dev (deploy/install-deps.sh
installs them); skips with the reason when they are missing.
"""

import glob
import json
import os
import sysconfig
import time

import numpy as np
import pytest

import opjit

from conftest import EXAMPLES, TempDaemon, wait_for

ATEN = os.path.join(EXAMPLES, "aten")
SEED003 = os.path.join(ATEN, "seed003")
TORCH_API = "/usr/include/torch/csrc/api/include"
PY_INCLUDE = sysconfig.get_paths()["include"]

# Under the sanitizers (make test-sanitize) everything runs several times
# slower: the default limits are not what is measured there.
SANITIZED = bool(os.environ.get("ASAN_OPTIONS"))

pytestmark = pytest.mark.skipif(
    not (os.path.exists(os.path.join(TORCH_API, "torch", "all.h"))
         and os.path.exists(os.path.join(PY_INCLUDE, "Python.h"))
         and os.path.exists("/usr/include/pybind11/pybind11.h")),
    reason="libtorch-dev, pybind11-dev or python3-dev is not installed "
           "(deploy/install-deps.sh installs them)")

CONFIG = ('[toolchains.aten]\nnamespaces = ["default", "seed"]\npch_at_start = true\n' +
          ("[compiler]\ntimeout_ms = 900000\n[quota]\ncompile_seconds_per_minute = 100000\n"
           if SANITIZED else ""))


class AtenDaemon(TempDaemon):
    def __init__(self, config):
        self.spawn(config, prefix="opjit-aten-")

    def profile_pchs(self):
        """The profiles' shared PCHs (one per profile)."""
        return sorted(glob.glob(os.path.join(self.state, "cache", "pch", "profiles", "*.pch")))

    def namespace_pchs(self):
        """The namespaces' own preamble PCHs."""
        return sorted(glob.glob(os.path.join(self.state, "cache", "pch", "*.pch")))


@pytest.fixture(scope="module")
def aten():
    d = AtenDaemon(CONFIG)
    yield d
    d.close()


def leaky(x):
    return np.where(x > 0, x, 0.01 * x)


def test_seed003_guide_layout_compiles_cold_within_the_default_limits(aten):
    # The profile's PCH is the daemon's, built as it started: the kernel's
    # compile below is its own two translation units only.
    t0 = time.monotonic()
    wait_for(aten.profile_pchs, 900, "the aten profile's PCH", interval=0.2)
    pch_s = time.monotonic() - t0
    with opjit.Client(aten.unix_address, namespace="seed", timeout=900) as c:
        t0 = time.monotonic()
        r = c.register(os.path.join(SEED003, "leaky_relu.json"))
        wall_s = time.monotonic() - t0
        assert r.compiled[0].cache_hit == ""
        if not SANITIZED:
            # Compile seconds charged to the namespace: well inside the
            # defaults (30 s of CPU per compile, 120 s per minute).
            assert r.compiled[0].compile_ms < 30000, r.compiled[0].compile_ms
        op = c.op("seed003_leaky_relu")
        # The guide's own input and printed output.
        x0 = np.array([[0.0, -0.1], [-0.2, 1.0]], dtype=np.float32)
        np.testing.assert_allclose(op(x0), [[0.0, -0.001], [-0.002, 1.0]], rtol=1e-6)
        x = np.linspace(-3, 3, 1001, dtype=np.float32).reshape(7, 143)
        np.testing.assert_allclose(op(x), leaky(x), rtol=1e-6)
        x64 = np.linspace(-1, 1, 11)
        np.testing.assert_allclose(op(x64), leaky(x64))
    # Both units loaded the shared PCH: no namespace built one of its own.
    assert len(aten.profile_pchs()) == 1
    assert aten.namespace_pchs() == []
    print("seed 003: profile PCH ready after %.1f s; kernel %.1f s wall, %.1f s compile"
          % (pch_s, wall_s, r.compiled[0].compile_ms / 1000))


def test_aten_kernels_compile_and_run_unchanged(aten):
    # opjit's header-only ms_ext.h, in another namespace: the same shared PCH.
    with opjit.Client(aten.unix_address, timeout=900) as c:
        t0 = time.monotonic()
        r = c.register(os.path.join(ATEN, "leaky_relu.json"))
        wall_s = time.monotonic() - t0
        assert r.compiled[0].cache_hit == ""
        x = np.linspace(-3, 3, 1001, dtype=np.float32).reshape(7, 143)
        np.testing.assert_allclose(c.op("aten_leaky_relu")(x), leaky(x), rtol=1e-6)
    assert len(aten.profile_pchs()) == 1
    assert aten.namespace_pchs() == []
    print("ATen header-only kernel: %.1f s wall, %.1f s compile"
          % (wall_s, r.compiled[0].compile_ms / 1000))


def test_aten_compile_errors_name_the_users_file(aten):
    with open(os.path.join(ATEN, "leaky_relu.json")) as f:
        spec = json.load(f)
    spec["name"] = "aten_broken"
    spec["implementations"][0]["source"] = (
        '#include <string.h>\n#include <torch/extension.h>\n#include "ms_ext.h"\n'
        'extern "C" int LeakyRelu(int n, void** p, int* nd, int64_t** s, const char** d,\n'
        '                         void* st, void* e) {\n  return torch::no_such_op();\n}\n')
    spec["implementations"][0]["source_file"] = "my_relu.cc"
    with opjit.Client(aten.unix_address, timeout=900) as c:
        with pytest.raises(opjit.InvalidArgument) as e:
            c.register(spec, base_dir=ATEN)
    assert e.value.reason == "COMPILE_FAILED"
    assert "my_relu.cc:6:17: error: no member named 'no_such_op'" in str(e.value), str(e.value)


def test_a_namespace_the_policy_leaves_out_is_refused_with_what_to_ask_for(aten):
    with opjit.Client(aten.unix_address, namespace="other", timeout=60) as c:
        with pytest.raises(opjit.PermissionDenied) as e:
            c.register(os.path.join(SEED003, "leaky_relu.json"))
        with pytest.raises(opjit.PermissionDenied):
            c.compile('#include <torch/extension.h>\n', libraries=["libc10.so"])
    msg = str(e.value)
    assert 'toolchain profile "aten"' in msg and "[toolchains.aten] namespaces" in msg, msg
    assert "/usr" not in msg, msg


def test_a_daemon_without_the_profile_says_how_to_enable_it():
    d = AtenDaemon("[compiler]\nprofiles = []\n")
    try:
        with opjit.Client(d.unix_address, timeout=60) as c:
            with pytest.raises(opjit.FailedPrecondition) as e:
                c.register(os.path.join(SEED003, "leaky_relu.json"))
        msg = str(e.value)
        assert 'profiles = ["aten"]' in msg and "/usr" not in msg, msg
    finally:
        d.close()
