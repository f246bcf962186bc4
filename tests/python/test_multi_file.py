"""Multi-file kernels (issue 29 item 6): a kernel's extra files travel with its source.

kernels/examples/multi_file/poly.json lists poly_coeffs.h, detail/eval.h and a second
translation unit, poly_eval.cc, beside poly.cc. The compiler sees them in memory, for
that compile only: a header changed alone is a new content hash and a new compile, a
missing one is a clear error, two ops with a same-named header each see their own,
and every limit on them is refused with INVALID_ARGUMENT (reason INVALID_SPEC). GPU:
an NVRTC compile and an nvcc (aot .cu) compile with a header; they only compile here
(a launch needs a GPU, which test_gpu.py covers).
"""
import json
import os
import shutil

import numpy as np
import pytest

import opjit
from opjit.client import default_file_name
from opjit.regop import CustomRegOp, DataType

from conftest import EXAMPLES

MULTI = os.path.join(EXAMPLES, "multi_file")
F32 = DataType.F32_Default


def read(name):
    with open(os.path.join(MULTI, name), encoding="utf-8") as f:
        return f.read()


def poly_spec(name, coeffs=None, drop=()):
    """poly.json as a dict with its files inline (coeffs: poly_coeffs.h's text)."""
    with open(os.path.join(MULTI, "poly.json")) as f:
        spec = json.load(f)
    spec["name"] = name
    impl = spec["implementations"][0]
    impl["source"] = read(impl.pop("source_file"))
    files = {"poly_coeffs.h": coeffs if coeffs is not None else read("poly_coeffs.h"),
             "detail/eval.h": read("detail/eval.h"), "poly_eval.cc": read("poly_eval.cc")}
    impl["files"] = [{"name": n, "content": c} for n, c in files.items() if n not in drop]
    return spec


X = np.array([-2.0, -1.0, 0.0, 0.5, 3.0], dtype=np.float32)


def test_example_spec_registers_and_computes(client):
    # The spec file as written: "files": ["poly_coeffs.h", {"path": "detail/eval.h"},
    # "poly_eval.cc"], read relative to the spec.
    resp = client.register(os.path.join(MULTI, "poly.json"))
    names = [f.name for f in resp.record.op.implementations[0].files]
    assert names == ["poly_coeffs.h", "detail/eval.h", "poly_eval.cc"]
    y = client.op("poly")(X)
    np.testing.assert_allclose(y, X * X + 2 * X + 3, rtol=1e-6)
    # The stored definition keeps each file's name and content, never a path;
    # listings without sources leave the contents out, the names stay.
    stored = [o for o in client.ops(with_sources=True) if o.op.name == "poly"][0]
    f = stored.op.implementations[0].files[0]
    assert (f.name, f.content, f.path) == ("poly_coeffs.h", read("poly_coeffs.h"), "")
    listed = [o for o in client.ops() if o.op.name == "poly"][0]
    assert [(f.name, f.content) for f in listed.op.implementations[0].files][:1] == [
        ("poly_coeffs.h", "")]


def test_changing_only_a_header_is_a_new_hash_and_a_recompile(client):
    first = client.register(poly_spec("poly_edit"))
    np.testing.assert_allclose(client.op("poly_edit")(X), X * X + 2 * X + 3, rtol=1e-6)
    edited = read("poly_coeffs.h").replace("kPolyC = 3.0f", "kPolyC = 7.0f")
    second = client.register(poly_spec("poly_edit", coeffs=edited))
    assert second.record.content_hash != first.record.content_hash
    assert second.record.version == first.record.version + 1
    # The new header's numbers: the kernel was compiled again, not taken from the cache.
    np.testing.assert_allclose(client.op("poly_edit")(X), X * X + 2 * X + 7, rtol=1e-6)
    # The same files again: the same hash (no new version).
    again = client.register(poly_spec("poly_edit", coeffs=edited))
    assert again.record.content_hash == second.record.content_hash


def test_a_missing_header_fails_clearly(client, daemon):
    with pytest.raises(opjit.InvalidArgument) as e:
        client.register(poly_spec("poly_missing", drop=("poly_coeffs.h",)))
    msg = str(e.value)
    assert "'poly_coeffs.h' file not found" in msg, msg
    assert "/opjit-src" not in msg and daemon.state_dir not in msg, msg


def test_two_ops_with_a_same_named_header_each_see_their_own(client):
    src = read("poly.cc")
    for name, c in (("poly_c5", "5.0f"), ("poly_c9", "9.0f")):
        coeffs = read("poly_coeffs.h").replace("kPolyC = 3.0f", "kPolyC = " + c)
        client.register(poly_spec(name, coeffs=coeffs))
    np.testing.assert_allclose(client.op("poly_c5")(X), X * X + 2 * X + 5, rtol=1e-6)
    np.testing.assert_allclose(client.op("poly_c9")(X), X * X + 2 * X + 9, rtol=1e-6)
    assert src  # both compiled the same poly.cc
    # A kernel without files does not see either op's header.
    spec = poly_spec("poly_nofiles")
    spec["implementations"][0]["files"] = []
    with pytest.raises(opjit.InvalidArgument, match="'detail/eval.h' file not found"):
        client.register(spec)


def test_builder_and_spec_file_forms(client, tmp_path):
    # CustomRegOp.impl(files=...): paths (relative to base_dir), dicts, and a mapping.
    shutil.copytree(MULTI, tmp_path / "k")
    op = (CustomRegOp("poly_built").input(0, "x").output(0, "y").dtype_format(F32, F32)
          .output_rule("same_as", input=0).target("CPU").impl(source_file="poly.cc", entry="Poly",
                              files=["poly_coeffs.h", "detail/eval.h",
                                     {"name": "poly_eval.cc", "content": read("poly_eval.cc")}]))
    client.register(op, base_dir=str(tmp_path / "k"))
    np.testing.assert_allclose(client.op("poly_built")(X), X * X + 2 * X + 3, rtol=1e-6)
    op = (CustomRegOp("poly_mapped").input(0, "x").output(0, "y").dtype_format(F32, F32)
          .output_rule("same_as", input=0).target("CPU").impl(source=read("poly.cc"), entry="Poly",
                              files={"poly_coeffs.h": read("poly_coeffs.h").replace("3.0f", "1.0f"),
                                     "detail/eval.h": read("detail/eval.h"),
                                     "poly_eval.cc": read("poly_eval.cc")}))
    client.register(op)
    np.testing.assert_allclose(client.op("poly_mapped")(X), X * X + 2 * X + 1, rtol=1e-6)
    # A path that climbs out of the spec's directory is named by its base name.
    (tmp_path / "spec").mkdir()
    spec = json.loads((tmp_path / "k" / "poly.json").read_text())
    spec["name"] = "poly_outside"
    spec["implementations"][0]["source_file"] = "../k/poly.cc"
    spec["implementations"][0]["files"] = ["../k/poly_coeffs.h",
                                           {"path": "../k/detail/eval.h", "name": "detail/eval.h"},
                                           "../k/poly_eval.cc"]
    (tmp_path / "spec" / "poly.json").write_text(json.dumps(spec))
    resp = client.register(str(tmp_path / "spec" / "poly.json"))
    assert [f.name for f in resp.record.op.implementations[0].files] == [
        "poly_coeffs.h", "detail/eval.h", "poly_eval.cc"]
    assert default_file_name("./detail//x.h") == "detail/x.h"
    assert default_file_name("/abs/x.h") == "x.h"
    # A path that is not there: NotFound naming the field, before any RPC.
    spec["implementations"][0]["files"] = ["nothere.h"]
    with pytest.raises(opjit.NotFound, match=r"implementations\[0\]\.files\[0\]\.path"):
        client.register(spec, base_dir=str(tmp_path))


def _refused(client, edit, target="CPU"):
    spec = poly_spec("poly_limits")
    impl = spec["implementations"][0]
    if target == "GPU":
        impl.update(target="GPU", language="cuda",
                    launch={"grid": ["1"], "block": ["1"], "args": ["x", "y"]})
    edit(impl["files"])
    with pytest.raises(opjit.InvalidArgument) as e:
        client.register(spec)
    assert e.value.reason == "INVALID_SPEC", e.value
    return str(e.value)


def test_each_limit_is_refused(client):
    many = lambda fs: fs.extend({"name": "h%d.h" % i, "content": "//\n"} for i in range(62))
    assert "files: has 65 files; the limit is 64" in _refused(client, many)
    long_name = lambda fs: fs[0].update(name="a" * 256 + ".h")
    assert "files[0].name" in _refused(client, long_name)
    assert "the limit is 255" in _refused(client, long_name)
    for bad, what in (("../poly_coeffs.h", '".." path part'), ("/etc/passwd", "relative path"),
                      ("detail\\eval.h", "not a backslash"), ("x\x00.h", "NUL"),
                      ("./x.h", '"." path part'), ("a//b.h", "empty path part"),
                      ("", "must not be empty")):
        msg = _refused(client, lambda fs: fs[1].update(name=bad))
        assert "files[1].name" in msg and what in msg, (bad, msg)
    dup = lambda fs: fs[2].update(name="poly_coeffs.h")
    assert '"poly_coeffs.h" is also files[0]' in _refused(client, dup)
    big = lambda fs: fs[0].update(content=" " * (1 << 20))
    assert "bytes together; the limit is 1048576" in _refused(client, big)
    gpu_unit = lambda fs: fs.__setitem__(slice(None), [{"name": "more.cu", "content": "//\n"}])
    assert "is a translation unit" in _refused(client, gpu_unit, target="GPU")


NVRTC = os.path.exists("/usr/local/cuda/include/nvrtc.h")
NVCC = os.access("/usr/local/cuda/bin/nvcc", os.X_OK)


@pytest.mark.skipif(not NVRTC, reason="no CUDA toolkit (NVRTC) in /usr/local/cuda")
def test_nvrtc_compiles_with_a_header(client):
    # Registration compiles the GPU implementation (NVRTC); a launch needs a GPU.
    resp = client.register(os.path.join(MULTI, "poly_gpu.json"))
    assert [f.name for f in resp.record.op.implementations[0].files] == ["poly_coeffs.h"]
    with open(os.path.join(MULTI, "poly_gpu.json")) as f:
        spec = json.load(f)
    spec["name"] = "poly_gpu_missing"
    impl = spec["implementations"][0]
    impl["source"] = read(impl.pop("source_file"))
    impl["files"] = []
    with pytest.raises(opjit.InvalidArgument, match="poly_coeffs.h"):
        client.register(spec)


AOT_WITH_HEADER = r'''
#include <cstdint>
#include "add_op.cuh"

__global__ void AddK(const float* x, const float* y, float* out, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = AddOp(x[i], y[i]);
}

extern "C" int AddWithHeader(int nparam, void** params, int* ndims, int64_t** shapes,
                             const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  AddK<<<(n + 255) / 256, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const float*>(params[0]), static_cast<const float*>(params[1]),
      static_cast<float*>(params[2]), n);
  return cudaGetLastError() == cudaSuccess ? 0 : 2;
}
'''


@pytest.mark.skipif(not NVCC, reason="no nvcc in /usr/local/cuda/bin")
def test_nvcc_compiles_an_aot_kernel_with_a_header(client):
    spec = {"name": "add_with_header",
            "inputs": [{"index": 0, "name": "x"}, {"index": 1, "name": "y"}],
            "outputs": [{"index": 0, "name": "out"}],
            "dtype_formats": [{"dtypes": ["float32", "float32", "float32"]}],
            "implementations": [{"target": "GPU", "language": "cuda", "source": AOT_WITH_HEADER,
                                 "entry": "AddWithHeader",
                                 "files": [{"name": "add_op.cuh", "content":
                                            "#pragma once\n__device__ inline float "
                                            "AddOp(float a, float b) { return a + b; }\n"}]}],
            "output_rules": [{"kind": "same_as", "input": 0}]}
    client.register(spec)
    # nvcc saw the header through the compile's own directory: without it, it fails.
    spec["name"] = "add_without_header"
    spec["implementations"][0]["files"] = []
    with pytest.raises(opjit.InvalidArgument, match="add_op.cuh"):
        client.register(spec)
