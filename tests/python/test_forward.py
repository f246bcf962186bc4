"""Forward calls: numpy in and out, shared memory and inline transport, attrs, dtypes."""

import gc
import threading

import numpy as np
import pytest

import opjit
from opjit._proto import memory_pb2
from opjit.client import is_local_address

X = np.array([[0.0, -0.1], [-0.2, 1.0]], np.float32)


def leaky(x, alpha=0.01):
    return np.where(x > 0, x, alpha * x)


def test_leaky_relu_float32(client, examples_registered):
    y = client.op("leaky_relu")(X)
    assert y.dtype == np.float32 and y.shape == (2, 2)
    np.testing.assert_allclose(y, [[0.0, -0.001], [-0.002, 1.0]], rtol=1e-6)


def test_leaky_relu_float16_and_attr(client, examples_registered):
    x = np.linspace(-2, 2, 11).astype(np.float16)
    y = client.op("leaky_relu")(x, alpha=0.1)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y, leaky(x.astype(np.float32), 0.1), atol=1e-3)
    # An int for a float attr is typed by the op's declaration.
    np.testing.assert_allclose(client.op("leaky_relu")(X, alpha=1), X)
    np.testing.assert_allclose(client.op("leaky_relu")(X, attrs={"alpha": 0.5}), leaky(X, 0.5))


def test_keyword_inputs_and_unknown_keyword(client, examples_registered):
    op = client.op("leaky_relu")
    np.testing.assert_allclose(op(x=X), leaky(X))
    with pytest.raises(opjit.InvalidArgument) as e:
        op(X, beta=1.0)
    assert "beta" in e.value.message
    with pytest.raises(opjit.InvalidArgument):
        op()
    with pytest.raises(opjit.InvalidArgument):
        op(X, alpha="fast")


def test_dtype_errors(client, examples_registered):
    op = client.op("leaky_relu")
    with pytest.raises(opjit.InvalidArgument) as e:
        op(np.ones(3, np.int32))
    assert "int32" in e.value.message
    with pytest.raises(opjit.InvalidArgument) as e:
        op(np.ones(3, np.complex64))
    assert "complex64" in e.value.message


def test_int_and_float64_ops(client, examples_registered):
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    np.testing.assert_allclose(client.op("reduce_sum")(x, axis=1), x.sum(axis=1))
    np.testing.assert_allclose(client.op("reduce_sum")(x.astype(np.float32), axis=0),
                               x.sum(axis=0))
    # An int op, compiled from inline source.
    src = r'''
    #include <cstdint>
    extern "C" int AddOne(int nparam, void** params, int* ndims, int64_t** shapes,
                          const char** dtypes, void* stream, void* extra) {
      int64_t n = 1;
      for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
      const int32_t* x = static_cast<const int32_t*>(params[0]);
      int32_t* y = static_cast<int32_t*>(params[1]);
      for (int64_t i = 0; i < n; ++i) y[i] = x[i] + 1;
      return 0;
    }'''
    client.register(opjit.CustomRegOp("add_one_i32").input(0, "x").output(0, "y")
                    .dtype_format(opjit.DataType.I32_Default, opjit.DataType.I32_Default)
                    .target("CPU").impl(source=src, entry="AddOne"))
    x = np.arange(-3, 3, dtype=np.int32)
    y = client.op("add_one_i32")(x)
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, x + 1)


def test_multi_output_dynamic_optional(client, examples_registered):
    a = np.array([1.0, 2.0, 3.0], np.float32)
    b = np.array([4.0, 5.0, 6.0], np.float32)
    s, p, q = client.op("arith3")(a, b)
    np.testing.assert_allclose(s, a + b)
    np.testing.assert_allclose(p, a * b)
    np.testing.assert_allclose(q, a / b)
    np.testing.assert_allclose(client.op("add_n")([a, b, a]), a + b + a)
    np.testing.assert_allclose(client.op("add_n")(a), a)
    sb = client.op("scale_bias")
    np.testing.assert_allclose(sb(a), 2 * a)
    np.testing.assert_allclose(sb(a, None, scale=3.0), 3 * a)
    np.testing.assert_allclose(sb(a, b=b), 2 * a + b)


def test_shm_outputs_are_views_kept_alive(client, examples_registered):
    assert client.transport == "shm"
    op = client.op("leaky_relu")
    y = op(X)
    assert not y.flags.owndata
    before = client.shm_stats()
    assert before["blocks"] >= 1 and before["regions"] >= 1
    view = y[1:]  # derived views keep the block allocated
    del y
    gc.collect()
    assert client.shm_stats()["blocks"] == before["blocks"]
    z = op(X * 2)  # must not land on view's bytes
    np.testing.assert_allclose(view, leaky(X)[1:])
    np.testing.assert_allclose(z, leaky(X * 2))
    del view, z
    gc.collect()
    assert client.shm_stats()["blocks"] == 0


def test_outputs_as_inputs_zero_copy(client, examples_registered):
    op = client.op("leaky_relu")
    x = client.empty((4, 3), np.float32)
    x[...] = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    assert client.shm_stats()["blocks"] == 1
    y = op(x, alpha=0.5)
    y2 = op(y, alpha=0.5)  # an output fed back in travels by reference
    np.testing.assert_allclose(y2, leaky(leaky(x, 0.5), 0.5), rtol=1e-6)
    xc = client.asarray([1.0, -1.0], dtype=np.float32)
    np.testing.assert_allclose(op(xc), [1.0, -0.01])


def test_noncontiguous_and_byteswapped_inputs(client, examples_registered):
    op = client.op("leaky_relu")
    x = np.linspace(-3, 3, 20, dtype=np.float32).reshape(4, 5)
    np.testing.assert_allclose(op(x[:, ::2]), leaky(x[:, ::2]), rtol=1e-6)
    np.testing.assert_allclose(op(x.T), leaky(x.T), rtol=1e-6)
    big = x.astype(">f4")
    np.testing.assert_allclose(op(big), leaky(x), rtol=1e-6)
    with pytest.raises(opjit.InvalidArgument):
        op([[-1.0, 1.0]])  # a list becomes float64, which leaky_relu does not take
    np.testing.assert_allclose(op(np.array([[-1.0, 1.0]], np.float32)), [[-0.01, 1.0]])


def test_large_tensor_grows_pool(daemon, examples_registered):
    with opjit.Client(daemon.unix_address, region_bytes=1 << 20, timeout=120) as c:
        x = np.random.default_rng(0).standard_normal(3_000_000).astype(np.float32)
        y = c.op("leaky_relu")(x)
        np.testing.assert_allclose(y, leaky(x), rtol=1e-6)
        assert c.shm_stats()["bytes"] >= 2 * x.nbytes


def test_copy_outputs(daemon, examples_registered):
    with opjit.Client(daemon.unix_address, copy_outputs=True) as c:
        y = c.op("leaky_relu")(X)
        assert y.flags.owndata
        gc.collect()
        assert c.shm_stats()["blocks"] == 0


def test_concurrent_calls(client, examples_registered):
    op = client.op("leaky_relu")
    errors = []

    def work(seed):
        try:
            rng = np.random.default_rng(seed)
            for _ in range(20):
                x = rng.standard_normal(1000).astype(np.float32)
                np.testing.assert_allclose(op(x, alpha=0.2), leaky(x, 0.2), rtol=1e-6)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_inline_over_tcp(inline_client, examples_registered):
    assert inline_client.transport == "inline"
    y = inline_client.op("leaky_relu")(X, alpha=0.2)
    np.testing.assert_allclose(y, leaky(X, 0.2), rtol=1e-6)
    assert y.flags.writeable
    s, p, q = inline_client.op("arith3")(X, X + 2)
    np.testing.assert_allclose(p, X * (X + 2), rtol=1e-6)
    assert inline_client.shm_stats()["regions"] == 0


def test_auto_uses_shm_over_loopback_tcp(daemon, examples_registered):
    with opjit.Client(daemon.tcp_address) as c:
        np.testing.assert_allclose(c.op("leaky_relu")(X), leaky(X), rtol=1e-6)
        assert c.transport == "shm"


def test_remote_addresses_go_inline():
    assert is_local_address("unix:/tmp/x.sock")
    assert is_local_address("127.0.0.1:7878")
    assert is_local_address("localhost:7878")
    assert is_local_address("[::1]:7878")
    assert not is_local_address("10.1.2.3:7878")
    assert not is_local_address("gpu-box.lab:7878")
    c = opjit.Client("10.255.255.1:7878")
    assert c.transport == "inline"
    c.close()


def test_fallback_when_mapping_fails(daemon, examples_registered, monkeypatch):
    import opjit._shm as shm

    def refuse(*a, **k):
        raise PermissionError("simulated: another host's /dev/shm")

    monkeypatch.setattr(shm.os, "open", refuse)
    with opjit.Client(daemon.unix_address) as c:
        y = c.op("leaky_relu")(X)
        np.testing.assert_allclose(y, leaky(X), rtol=1e-6)
        assert c.transport == "inline"
        assert "simulated" in c.shm_fallback_reason
        regions = c._memory.ListRegions(memory_pb2.ListRegionsRequest(namespace="default"))
        assert not [r for r in regions.regions if r.client_id == c.client_id]


def test_transport_shm_required_raises(daemon, examples_registered, monkeypatch):
    import opjit._shm as shm
    monkeypatch.setattr(shm.os, "open", lambda *a, **k: (_ for _ in ()).throw(OSError("no")))
    with opjit.Client(daemon.unix_address, transport="shm") as c:
        with pytest.raises(opjit.ShmUnavailableError):
            c.op("leaky_relu")(X)


def test_close_releases_regions_but_views_survive(daemon, examples_registered):
    c = opjit.Client(daemon.unix_address)
    y = c.op("leaky_relu")(X)
    listed = c._memory.ListRegions(memory_pb2.ListRegionsRequest(namespace="default"))
    mine = [r for r in listed.regions if r.client_id == c.client_id]
    assert mine and mine[0].lease_expires_unix_ms > 0
    with opjit.Client(daemon.unix_address) as other:
        c.close()
        listed = other._memory.ListRegions(memory_pb2.ListRegionsRequest(namespace="default"))
        assert not [r for r in listed.regions if r.client_id == c.client_id]
    np.testing.assert_allclose(y, leaky(X), rtol=1e-6)  # the mapping outlives the region


def test_lease_renewal_thread(daemon, examples_registered):
    with opjit.Client(daemon.unix_address, lease_ms=300) as c:
        c.op("leaky_relu")(X)
        import time
        first = [r.lease_expires_unix_ms for r in c._memory.ListRegions(
            memory_pb2.ListRegionsRequest(namespace="default")).regions
            if r.client_id == c.client_id][0]
        deadline = time.monotonic() + 5
        later = first
        while later <= first and time.monotonic() < deadline:
            time.sleep(0.05)
            later = [r.lease_expires_unix_ms for r in c._memory.ListRegions(
                memory_pb2.ListRegionsRequest(namespace="default")).regions
                if r.client_id == c.client_id][0]
        assert later > first
        np.testing.assert_allclose(c.op("leaky_relu")(X), leaky(X), rtol=1e-6)


def test_kernel_error_surfaces(client):
    src = r'''
    #include <cstdint>
    extern "C" int Fail(int, void**, int*, int64_t**, const char**, void*, void*) { return 7; }'''
    client.register(opjit.CustomRegOp("always_fails").input(0, "x").output(0, "y")
                    .dtype_format(opjit.DataType.F32_Default, opjit.DataType.F32_Default)
                    .target("CPU").impl(source=src, entry="Fail"))
    with pytest.raises(opjit.OpjitError) as e:
        client.op("always_fails")(X)
    assert "7" in e.value.message
    gc.collect()
    assert client.shm_stats()["blocks"] == 0  # nothing leaked by the failed call
