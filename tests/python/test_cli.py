"""The opjit CLI against the session's opjitd: which compiler a .cu file gets
(nvcc for MindSpore aot files with host code, NVRTC for device code), the
hint when NVRTC meets host code anyway, `run --target gpu`, per-command
flags, and registration warnings.

GPU compiles need the CUDA toolkit in /usr/local/cuda (NVRTC; nvcc for the
aot files), not a GPU; tests skip, saying so, where it is missing. `run
--target gpu` runs the kernel where the daemon has a GPU and checks the
error otherwise.
"""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from conftest import EXAMPLES, opjitd_binary

CUDA = "/usr/local/cuda"
HAVE_NVRTC = os.path.exists(os.path.join(CUDA, "include", "nvrtc.h"))
HAVE_NVCC = os.access(os.path.join(CUDA, "bin", "nvcc"), os.X_OK)
needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC, reason="no CUDA toolkit in /usr/local/cuda (NVRTC)")
needs_nvcc = pytest.mark.skipif(not HAVE_NVCC, reason="no nvcc in /usr/local/cuda/bin")

# MindSpore's aot form: a __global__ kernel and an extern "C" entry that
# launches it with <<<>>>.
MINDSPORE_AOT_CU = r'''
#include <cstdint>
#include "custom_aot_extra.h"

// Not a launch: k<<<1, 1>>>() in a comment.
__global__ void CliAddKernel(const float* x, const float* y, float* out, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];
}

extern "C" int CustomCliAdd(int nparam, void** params, int* ndims, int64_t** shapes,
                            const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  CliAddKernel<<<(n + 255) / 256, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const float*>(params[0]), static_cast<const float*>(params[1]),
      static_cast<float*>(params[2]), n);
  return cudaGetLastError() == cudaSuccess ? 0 : 2;
}
'''

# Device code only, as NVRTC takes it.
DEVICE_ONLY_CU = r'''
// A host launcher would read: cli_saxpy<<<grid, 256>>>(a, x, y, n);
extern "C" __global__ void cli_saxpy(float a, const float* x, float* y, long long n) {
  long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
'''


def opjit_cli():
    path = os.path.join(os.path.dirname(opjitd_binary()), "opjit")
    if not os.access(path, os.X_OK):
        pytest.fail("opjit not found at %s (build the `opjit` target)" % path)
    return path


def cli(daemon, *args, timeout=300):
    return subprocess.run([opjit_cli(), "--server", daemon.unix_address] + list(args),
                          capture_output=True, text=True, timeout=timeout)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@needs_nvcc
def test_mindspore_aot_cu_compiles_with_nvcc_without_aot_flag(daemon, tmp_path):
    src = write(tmp_path, "cli_add.cu", MINDSPORE_AOT_CU)
    r = cli(daemon, "compile", src, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["target"] == "GPU"
    assert out["ptx_arch"] == ""          # nvcc's shared object: no PTX
    assert out["lowered_names"] == {}
    assert int(out["binary_bytes"]) > 10000, out  # a shared object, not a CUBIN
    # The human form names the compiler.
    again = cli(daemon, "compile", src)
    assert again.returncode == 0, again.stderr
    assert "nvcc shared object" in again.stdout, again.stdout
    # --aot asks for what was chosen: the same cache entry.
    forced = cli(daemon, "compile", src, "--aot", "--json")
    assert forced.returncode == 0, forced.stderr
    forced = json.loads(forced.stdout)
    assert forced["cache_key"] == out["cache_key"]
    assert forced["cache_hit"] == "memory"


@needs_nvcc
def test_the_repositorys_aot_example_compiles_without_aot_flag(daemon):
    r = cli(daemon, "compile", os.path.join(EXAMPLES, "add_aot.cu"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ptx_arch"] == "" and int(out["binary_bytes"]) > 10000, out


@needs_nvrtc
def test_device_only_cu_still_goes_to_nvrtc(daemon, tmp_path):
    src = write(tmp_path, "cli_saxpy.cu", DEVICE_ONLY_CU)
    r = cli(daemon, "compile", src, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["target"] == "GPU"
    assert out["ptx_arch"].startswith("compute_"), out  # NVRTC's PTX
    human = cli(daemon, "compile", src)
    assert human.returncode == 0, human.stderr
    assert "NVRTC" in human.stdout, human.stdout
    # A template kernel's name expression comes back lowered.
    tmpl = cli(daemon, "compile", os.path.join(EXAMPLES, "scale_add.cu"),
               "--name-expr", "scale_add<float>", "--json")
    assert tmpl.returncode == 0, tmpl.stderr
    lowered = json.loads(tmpl.stdout)["lowered_names"]
    assert lowered["scale_add<float>"].startswith("_Z"), lowered


@needs_nvrtc
def test_nvrtc_on_host_code_says_how_to_use_nvcc(daemon, tmp_path):
    # Name expressions keep a job on NVRTC, which refuses the host code.
    src = write(tmp_path, "cli_launch.cu", MINDSPORE_AOT_CU.replace("#include <cstdint>\n", "")
                .replace("int64_t", "long long").replace('#include "custom_aot_extra.h"\n', ""))
    r = cli(daemon, "compile", src, "--name-expr", "CliAddKernel")
    assert r.returncode == 1
    assert "INVALID_ARGUMENT" in r.stderr
    assert "cli_launch.cu" in r.stderr  # the user's file name in the diagnostics
    assert "hint: this source has host code" in r.stderr, r.stderr
    assert "CustomCliAdd" in r.stderr
    assert "--aot" in r.stderr and '"launch"' in r.stderr, r.stderr
    assert "is opjitd running" not in r.stderr
    if HAVE_NVCC:
        forced = cli(daemon, "compile", src, "--name-expr", "CliAddKernel", "--aot", "--json")
        assert forced.returncode == 0, forced.stderr
        assert json.loads(forced.stdout)["ptx_arch"] == ""

    # An unannotated helper the detector does not count: NVRTC's own
    # complaint gets the hint too.
    helper = write(tmp_path, "cli_helper.cu", "static float sq(float v) { return v * v; }\n"
                   "__global__ void k(float* x) { x[0] = 1.0f; }\n")
    r = cli(daemon, "compile", helper)
    assert r.returncode == 1
    assert "hint: NVRTC compiles device code only" in r.stderr, r.stderr
    assert "-default-device" in r.stderr


def gpu_available(daemon):
    r = cli(daemon, "info", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["gpu"]["available"]


@needs_nvrtc
def test_run_target_gpu(daemon, tmp_path):
    # scale_add with its CPU and NVRTC implementations, under its own name.
    with open(os.path.join(EXAMPLES, "scale_add_gpu.json")) as f:
        spec = json.load(f)
    spec["name"] = "cli_scale_add"
    shutil.copy(os.path.join(EXAMPLES, "scale_add.cu"), tmp_path / "scale_add.cu")
    spec_path = write(tmp_path, "cli_scale_add.json", json.dumps(spec))
    reg = cli(daemon, "register", spec_path)
    assert reg.returncode == 0, reg.stderr
    x = np.arange(8, dtype=np.float32)
    b = np.ones(8, dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "b.npy", b)
    args = ["run", "cli_scale_add", "--in", str(tmp_path / "x.npy"), "--in", str(tmp_path / "b.npy"),
            "--attr", "alpha=2", "--out", str(tmp_path / "y.npy")]

    cpu = cli(daemon, *args, "--target", "cpu")
    assert cpu.returncode == 0, cpu.stderr
    assert "on CPU" in cpu.stdout
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), 2 * x + b)
    os.remove(tmp_path / "y.npy")

    for transport in ("shm", "inline"):
        gpu = cli(daemon, *args, "--target", "gpu", "--transport", transport)
        if gpu_available(daemon):
            assert gpu.returncode == 0, gpu.stderr
            assert "on GPU" in gpu.stdout
            np.testing.assert_allclose(np.load(tmp_path / "y.npy"), 2 * x + b)
        else:
            # No GPU here: the daemon's reason, and what to do, on stderr.
            assert gpu.returncode == 1, (gpu.stdout, gpu.stderr)
            assert "UNAVAILABLE" in gpu.stderr and "on GPU" in gpu.stderr, gpu.stderr
            assert "could not run on the GPU" in gpu.stderr
            assert "opjit info" in gpu.stderr
            assert "is opjitd running" not in gpu.stderr
            assert gpu.stdout == ""
            assert not os.path.exists(tmp_path / "y.npy")

    bad = cli(daemon, *args, "--target", "tpu")
    assert bad.returncode == 2
    assert "--target takes cpu or gpu" in bad.stderr
    bad = cli(daemon, "grad", "cli_scale_add", "--in", str(tmp_path / "x.npy"), "--target", "tpu")
    assert bad.returncode == 2
    assert "--target takes cpu or gpu" in bad.stderr


def test_flags_belong_to_their_command(daemon, tmp_path):
    r = cli(daemon, "ops", "--aot")
    assert r.returncode == 2
    assert "unknown option --aot for `ops` (it takes --namespace, --all-versions)" in r.stderr
    r = cli(daemon, "compile", "x.cu", "--target", "gpu")
    assert r.returncode == 2 and "unknown option --target for `compile`" in r.stderr
    r = cli(daemon, "gradcheck", "square", "--target", "gpu")
    assert r.returncode == 2 and "unknown option --target for `gradcheck`" in r.stderr
    r = cli(daemon, "info", "--version", "3")
    assert r.returncode == 2 and "(it takes none)" in r.stderr
    r = cli(daemon, "cache", "stats", "--memory-only")
    assert r.returncode == 2 and "--memory-only goes with `cache clear`" in r.stderr
    r = cli(daemon, "info", "extra")
    assert r.returncode == 2 and "info takes no arguments" in r.stderr
    r = cli(daemon, "frobnicate")
    assert r.returncode == 2 and "unknown command frobnicate" in r.stderr
    r = cli(daemon, "help")
    assert r.returncode == 0, r.stderr
    assert "run" in r.stdout and "gradcheck" in r.stdout
    # COMMAND --help lists that command's flags (test_cli_ops.py checks more).
    r = cli(daemon, "run", "--help")
    assert r.returncode == 0, r.stderr
    assert "opjit run [OPTIONS] OP" in r.stdout and "--target cpu|gpu" in r.stdout
    r = cli(daemon, "compile", "-h")
    assert r.returncode == 0, r.stderr
    assert "--aot" in r.stdout and "--target" not in r.stdout
    # --timeout=N works like --timeout N; --json goes before or after the command.
    r = subprocess.run([opjit_cli(), "--server=" + daemon.unix_address, "--timeout=30",
                        "ops", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)


def test_unreachable_server_hint_only_when_unreachable(tmp_path):
    r = subprocess.run([opjit_cli(), "--server", "unix:%s/none.sock" % tmp_path, "--timeout", "2",
                        "ops"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "is opjitd running" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr  # one line


def test_register_and_describe_print_warnings(daemon, tmp_path):
    # A backward op that is not registered (yet) is a warning, not an error.
    with open(os.path.join(EXAMPLES, "square.json")) as f:
        spec = json.load(f)
    spec["name"] = "cli_square_warned"
    spec["backward"]["op"] = "cli_square_grad_not_registered"
    for impl in spec["implementations"]:
        if "source_file" in impl:
            shutil.copy(os.path.join(EXAMPLES, impl["source_file"]), tmp_path / impl["source_file"])
    r = cli(daemon, "register", write(tmp_path, "warned.json", json.dumps(spec)))
    assert r.returncode == 0, r.stderr
    assert "warning: " in r.stderr, r.stderr
    assert "cli_square_grad_not_registered" in r.stderr
    assert r.stdout.startswith("registered default/cli_square_warned")
    # describe shows what the record says now, the same way.
    d = cli(daemon, "describe", "cli_square_warned")
    assert d.returncode == 0, d.stderr
    assert "warning: " in d.stderr and "cli_square_grad_not_registered" in d.stderr, d.stderr
