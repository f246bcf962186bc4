#!/usr/bin/env bash
# `make test-gpu`: every GPU test, on a machine with a GPU. Fails loudly,
# before running anything, where there is no GPU; and with
# OPJIT_REQUIRE_GPU=1 a test that finds none fails instead of skipping.
#
#   tests/gpu/run.sh BUILD_DIR
#
# What runs:
#   gpu_test      NVRTC (CUBIN, PTX, name expressions, the sandbox's limits),
#                 nvcc (MindSpore aot .cu to a shared object), cubin checks,
#                 launch specs, the driver wrappers (against a stand-in libcuda)
#   gpu_exec_test launches on the device: NVRTC CUBIN with a launch spec, PTX
#                 JIT-compiled by the driver, device memory, out-of-memory,
#                 an nvcc-built aot kernel
#   gpu_it_test   a real opjitd: NVRTC compiles cached across restarts, nvcc,
#                 launch specs validated at registration, a GPU call
#   python_gpu    GPU ops from the Python client (shm and inline)
set -euo pipefail
BUILD=${1:?usage: tests/gpu/run.sh BUILD_DIR}

die() { echo "test-gpu: $*" >&2; exit 1; }

[ -e /usr/local/cuda/include/nvrtc.h ] || die "no CUDA toolkit in /usr/local/cuda (NVRTC, nvcc)"
have_device=0
for d in /dev/nvidia0 /dev/nvidia[0-9]*; do [ -e "$d" ] && have_device=1; done
[ "$have_device" = 1 ] || die "no GPU on this machine (no /dev/nvidia*): run this on a machine with an NVIDIA GPU"
/usr/bin/python3 - <<'PY' || die "a GPU device node exists, but the CUDA driver (libcuda.so.1) cannot be loaded or finds no device"
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    print("libcuda.so.1:", e, file=sys.stderr); sys.exit(1)
if cuda.cuInit(0) != 0:
    print("cuInit failed", file=sys.stderr); sys.exit(1)
n = ctypes.c_int(0)
cuda.cuDeviceGetCount(ctypes.byref(n))
print("test-gpu: %d CUDA device(s)" % n.value)
sys.exit(0 if n.value > 0 else 1)
PY
command -v nvidia-smi >/dev/null && nvidia-smi -L || true

export OPJIT_REQUIRE_GPU=1
fail=0
for t in gpu_test gpu_it_test gpu_exec_test; do
  echo "== $t"
  # --gtest_fail_if_no_test is not in Debian's gtest; a skip is caught below.
  out=$("$BUILD/bin/$t" 2>&1) || { echo "$out"; echo "test-gpu: $t FAILED"; fail=1; continue; }
  echo "$out" | tail -3
  if echo "$out" | grep -q '\[  SKIPPED \]'; then
    echo "$out" | grep '\[  SKIPPED \]'
    echo "test-gpu: $t skipped tests on a GPU machine"; fail=1
  fi
done
echo "== python_gpu"
# With OPJIT_REQUIRE_GPU=1 the suite fails, not skips, where it finds no GPU.
ctest --test-dir "$BUILD" --output-on-failure -R '^python_gpu$' || fail=1
[ "$fail" = 0 ] || die "GPU tests failed (see above)"
echo "test-gpu: all GPU tests passed"
