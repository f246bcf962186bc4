"""The same-host fast path: prepared handles and the shared-memory channel.

Each test compares the fast path with the gRPC path on a real opjitd: the
same results, the same exception classes and reasons, and recovery from a
stale handle, a crashed kernel and a deadline. The last test SIGKILLs a
client in the middle of a call and checks that its regions, shm objects,
handles and channel are all gone once its lease lapses.
"""

import os
import re
import signal
import subprocess
import tempfile
import textwrap
import time
import urllib.request

import numpy as np
import pytest

import opjit
from opjit._proto import exec_pb2, memory_pb2
from opjit.errors import error_from_status

from conftest import SPIN_KERNEL, Daemon, TempDaemon, opjitd_binary

F32 = opjit.DataType.F32_Default

ADD_SRC = r'''
#include <cstdint>
extern "C" int FastAdd(int nparam, void** params, int* ndims, int64_t** shapes,
                       const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] + STEP;
  return 0;
}
'''

# Traps (SIGILL) when x[0] < 0, else y = 2x.
CRASH_SRC = r'''
#include <cstdint>
extern "C" int FastCrash(int nparam, void** params, int* ndims, int64_t** shapes,
                         const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  if (n > 0 && x[0] < 0) __builtin_trap();
  for (int64_t i = 0; i < n; ++i) y[i] = 2 * x[i];
  return 0;
}
'''


def unary(name, src, entry):
    return (opjit.CustomRegOp(name).input(0, "x").output(0, "y").dtype_format(F32, F32)
            .target("CPU").impl(source=src, entry=entry).output_rule("same_as", input=0))


def add_op(step):
    return unary("fast_add", ADD_SRC.replace("STEP", "%.1ff" % step), "FastAdd")


@pytest.fixture(scope="module")
def fast_ops(daemon, examples_registered):
    with opjit.Client(daemon.unix_address, timeout=120) as c:
        c.register(add_op(1.0))
        c.register(unary("fast_crash", CRASH_SRC, "FastCrash"))
        c.register(unary("fast_spin", SPIN_KERNEL, "K"))
    return True


@pytest.fixture
def fast(daemon, fast_ops):
    c = opjit.Client(daemon.unix_address, timeout=120, fast="on")
    yield c
    c.close()


@pytest.fixture
def slow(daemon, fast_ops):
    c = opjit.Client(daemon.unix_address, timeout=120, fast="off")
    yield c
    c.close()


def used_fast(client, before):
    return client.call_counts()["fast"] > before["fast"]


# A stand-in executor for the channel protocol alone (no daemon): serves
# `count` calls on the channel at argv[1] and answers each with kernel_ms =
# the first tensor's offset, or STALE_HANDLE for any handle but 7. Mode
# "close": sets the header's closed flag instead of answering (after taking
# the call when argv[3] is "running", before when it is "submitted").
STUB_EXECUTOR = textwrap.dedent(r'''
    import ctypes, mmap, os, struct, sys
    from opjit import _fast as F
    fd = os.open(sys.argv[1], os.O_RDWR)
    mm = mmap.mmap(fd, 0)
    os.close(fd)
    count, mode = int(sys.argv[2]), sys.argv[3]
    sc = F._syscall()
    wake = lambda w: sc(F._SYS_FUTEX, ctypes.c_void_p(ctypes.addressof(w)), F._FUTEX_WAKE,
                        ctypes.c_long(64), None, None, F._ZERO)
    closed = ctypes.c_uint32.from_buffer(mm, F.H_CLOSED)
    states = [ctypes.c_uint32.from_buffer(mm, F.HEADER_BYTES + i * F.SLOT_BYTES)
              for i in range(8)]
    served = 0
    while served < count:
        for i, st in enumerate(states):
            if st.value != F.SUBMITTED:
                continue
            base = F.HEADER_BYTES + i * F.SLOT_BYTES
            if mode != "ok":
                if mode == "running":
                    st.value = F.RUNNING
                closed.value = 1
                for s in states:
                    wake(s)
                sys.exit(0)
            st.value = F.RUNNING
            n, _, handle, seq, deadline = struct.unpack_from("<IIQQq", mm, base + F.S_N_TENSORS)
            refs = struct.unpack_from("<%dQ" % (2 * n), mm, base + F.S_TENSORS)
            if handle == 7:
                struct.pack_into("<iId", mm, base + F.S_CODE, 0, 0, float(refs[1]))
            else:
                msg = b"unknown handle %d" % handle
                struct.pack_into("<iId", mm, base + F.S_CODE, 9, len(msg), 0.0)
                mm[base + F.S_REASON:base + F.S_REASON + 12] = b"STALE_HANDLE"
                mm[base + F.S_MESSAGE:base + F.S_MESSAGE + len(msg)] = msg
            st.value = F.DONE
            wake(st)
            served += 1
''')


@pytest.mark.parametrize("mode", ["ok", "running", "submitted"])
def test_channel_protocol_against_a_stub_executor(mode, monkeypatch):
    """The client's half of proto/opjit/wire/fast_channel.h, against a Python
    executor: replies, errors, 8 slots shared by 12 threads, and a channel
    closed with a call running (a crash) or not yet taken (retry)."""
    from opjit import _fast
    import struct
    import threading
    if not _fast.supported():
        pytest.skip("the fast channel is x86-64 Linux only")
    monkeypatch.setattr(_fast, "_DEAD_GRACE_NS", 200_000_000)
    key = "opjit-test-stub-%d-%s" % (os.getpid(), mode)
    path = "/dev/shm/" + key
    size = _fast.HEADER_BYTES + 8 * _fast.SLOT_BYTES
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(0)
        f.write(struct.pack("<IIIIII", _fast.MAGIC, _fast.VERSION, 8, _fast.SLOT_BYTES, 64, 0))
    calls = 2 + 12 * 50
    stub = subprocess.Popen(["/usr/bin/python3", "-c", STUB_EXECUTOR, path, str(calls), mode])
    try:
        info = exec_pb2.OpenChannelResponse(shm_key="/" + key, byte_size=size, slots=8,
                                            max_tensors=64, spin_us=20, worker_pid=stub.pid)
        ch = _fast.FastChannel(info)
        if mode == "running":
            r = ch.call(7, [1, 64, 1, 128])
            assert r.code == 10 and r.reason == "KERNEL_CRASHED"  # ABORTED, as gRPC says
            assert ch.closed
            with pytest.raises(_fast.ChannelClosed):
                ch.call(7, [1, 64, 1, 128])
            return
        if mode == "submitted":
            with pytest.raises(_fast.ChannelClosed):
                ch.call(7, [1, 64, 1, 128])
            return
        r = ch.call(7, [1, 4096, 1, 128])
        assert (r.code, r.reason, r.kernel_ms) == (0, "", 4096.0)
        r = ch.call(8, [1, 0])
        e = error_from_status(r.code, r.message, reason=r.reason)
        assert isinstance(e, opjit.FailedPrecondition) and e.reason == "STALE_HANDLE"
        assert e.message == "unknown handle 8"
        wrong = []

        def work(k):
            for j in range(50):
                off = 64 * (k * 50 + j)
                if ch.call(7, [1, off, 1, 0]).kernel_ms != off:
                    wrong.append(off)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not wrong
        assert stub.wait(30) == 0
        ch.close()
    finally:
        if stub.poll() is None:
            stub.kill()
        stub.wait()
        os.unlink(path)


def test_fast_mode_from_env_and_argument(daemon, monkeypatch):
    monkeypatch.setenv("OPJIT_FAST", "0")
    with opjit.Client(daemon.unix_address) as c:
        assert c.fast == "off"
    monkeypatch.setenv("OPJIT_FAST", "1")
    with opjit.Client(daemon.unix_address) as c:
        assert c.fast == "on"
    with opjit.Client(daemon.unix_address, fast="auto") as c:
        assert c.fast == "auto"
    with pytest.raises(opjit.InvalidArgument):
        opjit.Client(daemon.unix_address, fast="sometimes")
    # A remote server never gets a channel, whatever the mode.
    with opjit.Client("10.255.255.1:7878", fast="on") as c:
        assert not c.fast_path_active()


def test_results_equal_grpc(fast, slow):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 33)).astype(np.float32)
    a, b = (rng.standard_normal(17).astype(np.float32) for _ in range(2))
    calls = [
        ("leaky_relu", (x,), {"alpha": 0.2}),
        ("leaky_relu", (x.astype(np.float16),), {}),
        ("arith3", (a, b), {}),                        # three outputs
        ("add_n", ([a, b, a],), {}),                    # a dynamic input
        ("scale_bias", (a, None), {"scale": 3.0}),      # an absent optional input
        ("scale_bias", (a, b), {"scale": 0.5}),
        ("reduce_sum", (x,), {"axis": 1}),              # an output shape of its own
        ("fast_add", (np.zeros((0,), np.float32),), {}),  # empty tensors
    ]
    for name, args, kw in calls:
        before = fast.call_counts()
        got = fast.op(name)(*args, **kw)
        want = slow.op(name)(*args, **kw)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        assert len(got) == len(want), name
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, name
            np.testing.assert_array_equal(g, w, err_msg=name)
        assert used_fast(fast, before), name
    assert slow.call_counts()["fast"] == 0 and slow.call_counts()["handle"] == 0


def test_fast_outputs_are_views_and_chain_without_copies(fast):
    add = fast.op("fast_add")
    x = fast.asarray(np.arange(8, dtype=np.float32))
    y = add(x)
    z = add(y)                       # y lives in the pool: passed by reference
    np.testing.assert_array_equal(z, np.arange(8, dtype=np.float32) + 2)
    before = fast.shm_stats()["blocks"]
    del y, z
    assert fast.shm_stats()["blocks"] < before  # the outputs' blocks are freed with their views


def test_concurrent_fast_calls(fast):
    import threading
    add = fast.op("fast_add")
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(50):
            v = rng.standard_normal(int(rng.integers(1, 300))).astype(np.float32)
            try:
                np.testing.assert_array_equal(add(v), v + 1)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]  # > 8 slots
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert fast.call_counts()["fast"] >= 600


def test_requires_grad_runs_on_the_channel_and_backward_too(fast, backward_supported):
    x = opjit.tensor(np.array([1.0, 4.0, 9.0], np.float32), requires_grad=True)
    before = fast.call_counts()
    y = fast.op("square")(x)
    # The forward is a plain channel call: the client keeps what the bprop reads.
    after = fast.call_counts()
    assert after["fast"] == before["fast"] + 1 and after["handle"] == before["handle"], after
    y.backward(np.ones(3, np.float32))
    np.testing.assert_allclose(x.grad, [2, 8, 18])
    # The backward is the bprop's call on the channel, no Backward RPC.
    after = fast.call_counts()
    assert after["fast"] == before["fast"] + 2, after
    assert after["backward"] == before["backward"], after
    assert after["client_backward"] == before["client_backward"] + 1, after
    np.testing.assert_allclose(fast.op("square")(np.array([3.0], np.float32)), [9.0])
    assert used_fast(fast, before)


def test_stale_handle_is_transparent(daemon, fast):
    add = fast.op("fast_add")
    x = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(add(x), x + 1)
    with opjit.Client(daemon.unix_address) as admin:
        v2 = admin.register(add_op(2.0)).record.version
    deleted = False
    try:
        before = fast.call_counts()
        np.testing.assert_array_equal(add(x), x + 2)  # STALE_HANDLE: prepared again, retried
        assert used_fast(fast, before)
        with opjit.Client(daemon.unix_address) as admin:
            admin.delete("fast_add", version=v2)
            deleted = True
        np.testing.assert_array_equal(add(x), x + 1)  # stale again: back to version 1
        assert fast.call_counts()["fast"] == before["fast"] + 2
    finally:
        if not deleted:
            with opjit.Client(daemon.unix_address) as admin:
                admin.delete("fast_add", version=v2)


def _prepared(client, name):
    return next(p for p in client._transport._prepared.values() if p.key[1] == name)


def test_bad_regions_and_bounds_are_refused_like_grpc(daemon, fast):
    """Raw channel calls with refs the client would never write: the executor
    bounds-checks every tensor and maps only the caller's own regions."""
    x = np.arange(4, dtype=np.float32)
    fast.op("fast_add")(x)
    t = fast._transport
    ns = fast.namespace
    prep = _prepared(fast, "fast_add")
    ch = t.channel(ns)
    region = t.pool(ns)._regions[0]
    assert region.id != 0 and ch is not None

    def fast_error(refs, handle=prep.handle):
        r = ch.call(handle, refs)
        assert r.code != 0, refs
        return error_from_status(r.code, r.message, reason=r.reason)

    def grpc_error(in_region, in_off, out_region, out_off):
        req = exec_pb2.ForwardRequest(namespace=ns, handle=prep.handle, client_id=fast.client_id)
        req.inputs.add().tensors.add(dtype="float32", shape=[4],
                                     shm=exec_pb2.ShmRef(region=in_region, offset=in_off))
        req.outputs.add().shm.CopyFrom(exec_pb2.ShmRef(region=out_region, offset=out_off))
        try:
            fast._executor.Forward(req, timeout=30)
        except Exception as e:
            return opjit.errors.error_from_rpc(e)
        pytest.fail("gRPC accepted a bad placement")

    # An output past the end of the region.
    e = fast_error([region.id, 0, region.id, region.size - 4])
    g = grpc_error(region.name, 0, region.name, region.size - 4)
    assert type(e) is type(g) and e.reason == g.reason == "REGION_TOO_SMALL"
    assert isinstance(e, opjit.InvalidArgument)
    # An input offset past the end.
    e = fast_error([region.id, region.size + 64, region.id, 0])
    assert isinstance(e, opjit.InvalidArgument)
    # A region id that does not exist.
    e = fast_error([987654321, 0, region.id, 64])
    g = grpc_error("no-such-region", 0, region.name, 64)
    assert type(e) is type(g) and e.reason == g.reason == "REGION_NOT_REGISTERED"
    # Another client's region: its id works only on its own channel.
    with opjit.Client(daemon.unix_address, fast="on") as other:
        theirs = other.asarray(x)
        their_region = other._transport.pool(other.namespace).locate(theirs)[0]
        e = fast_error([their_region.id, 0, region.id, 64])
        assert e.reason == "REGION_NOT_REGISTERED" and isinstance(e, opjit.NotFound)
        np.testing.assert_array_equal(theirs, x)  # untouched
        # ...and another client's handle is unknown to this one.
        other.op("fast_add")(x)
        e = fast_error([region.id, 0, region.id, 64], handle=_prepared(other, "fast_add").handle)
        assert e.reason == "STALE_HANDLE" and isinstance(e, opjit.FailedPrecondition)
    # A handle nobody prepared.
    e = fast_error([region.id, 0, region.id, 64], handle=(1 << 62) + 12345)
    assert e.reason == "STALE_HANDLE"
    # The channel still works.
    np.testing.assert_array_equal(fast.op("fast_add")(x), x + 1)


def test_crash_raises_like_grpc_and_the_next_call_works(fast, slow):
    crash = fast.op("fast_crash")
    bad = np.array([-1.0, 2.0], np.float32)
    with pytest.raises(opjit.OpjitError) as on_fast:
        crash(bad)
    with pytest.raises(opjit.OpjitError) as on_grpc:
        slow.op("fast_crash")(bad)
    assert type(on_fast.value) is type(on_grpc.value)
    assert on_fast.value.code == on_grpc.value.code
    assert on_fast.value.reason == on_grpc.value.reason == "KERNEL_CRASHED"
    before = fast.call_counts()
    np.testing.assert_array_equal(crash(np.array([1.0, 2.0], np.float32)), [2.0, 4.0])
    assert used_fast(fast, before)


def test_deadline(daemon, fast_ops):
    spin = np.array([20.0], np.float32)
    with opjit.Client(daemon.unix_address, timeout=1.0, fast="on") as c:
        t0 = time.monotonic()
        with pytest.raises(opjit.DeadlineExceeded):
            c.op("fast_spin")(spin)
        assert time.monotonic() - t0 < 10
        before = c.call_counts()
        np.testing.assert_array_equal(c.op("fast_spin")(np.array([0.0], np.float32)), [0.0])
        assert used_fast(c, before)
    with opjit.Client(daemon.unix_address, timeout=1.0, fast="off") as c:
        with pytest.raises(opjit.DeadlineExceeded):
            c.op("fast_spin")(spin)


def test_close_releases_handles_and_channel(daemon, fast_ops):
    c = opjit.Client(daemon.unix_address, fast="on")
    y = c.op("fast_add")(np.ones(3, np.float32))
    assert c.fast_path_active()
    listed = c._memory.ListRegions(memory_pb2.ListRegionsRequest(namespace="default"))
    keys = [r.shm_key for r in listed.regions if r.client_id == c.client_id]
    assert len(keys) >= 2  # the pool's region and the channel
    c.close()
    np.testing.assert_array_equal(y, [2, 2, 2])  # views outlive the client
    with opjit.Client(daemon.unix_address) as other:
        listed = other._memory.ListRegions(memory_pb2.ListRegionsRequest(namespace="default"))
        assert not [r for r in listed.regions if r.client_id == c.client_id]
    for k in keys:
        assert not os.path.exists("/dev/shm/" + k.lstrip("/"))


CHILD = textwrap.dedent(r'''
    import sys
    import numpy as np
    import opjit
    c = opjit.Client(sys.argv[1], lease_ms=int(sys.argv[2]), fast="on", timeout=120)
    spin = c.op("fast_spin")
    spin(np.array([0.0], np.float32))   # prepares the handle, opens the channel
    assert c.call_counts()["fast"] == 1
    print(c.client_id, flush=True)
    spin(np.array([60.0], np.float32))  # killed in here
''')


def test_sigkill_mid_call_leaks_nothing():
    """A client SIGKILLed in the middle of a fast call: once its lease lapses,
    no region, shm object, handle or channel of it remains."""
    state = tempfile.mkdtemp(prefix="opjit-fk-")
    d = Daemon(opjitd_binary(), state)
    d.start()
    try:
        with opjit.Client(d.unix_address, timeout=120) as admin:
            admin.register(unary("fast_spin", SPIN_KERNEL, "K"))
        env = dict(os.environ, OPJIT_FAST="on")
        child = subprocess.Popen(["/usr/bin/python3", "-c", CHILD, d.unix_address, "1000"],
                                 stdout=subprocess.PIPE, env=env)
        try:
            client_id = child.stdout.readline().decode().strip()
            assert client_id.startswith("py-"), "the child did not start its call"
            with opjit.Client(d.unix_address, timeout=30, fast="off") as admin:
                listed = admin._memory.ListRegions(memory_pb2.ListRegionsRequest(
                    namespace="default"))
                keys = [r.shm_key for r in listed.regions if r.client_id == client_id]
                assert len(keys) >= 2, "expected the pool region and the channel"
                info = admin.info()
                fields = info.DESCRIPTOR.fields_by_name
                assert "handles" in fields and "channels" in fields, \
                    "ServerInfo has no handles/channels counters"
                assert info.handles >= 1 and info.channels >= 1
                time.sleep(0.5)  # well inside the 60 s kernel
                child.send_signal(signal.SIGKILL)
                child.wait(10)
                deadline = time.monotonic() + 30
                while True:
                    listed = admin._memory.ListRegions(memory_pb2.ListRegionsRequest(
                        namespace="default"))
                    mine = [r for r in listed.regions if r.client_id == client_id]
                    left = [k for k in keys if os.path.exists("/dev/shm/" + k.lstrip("/"))]
                    info = admin.info()
                    if not mine and not left and info.handles == 0 and info.channels == 0:
                        break
                    if time.monotonic() > deadline:
                        pytest.fail("30 s after the SIGKILL: regions %s, shm objects %s, "
                                    "handles %d, channels %d remain"
                                    % ([r.name for r in mine], left, info.handles, info.channels))
                    time.sleep(0.2)
                # The daemon is healthy and serves the next client's fast path.
                with opjit.Client(d.unix_address, fast="on") as c:
                    np.testing.assert_array_equal(
                        c.op("fast_spin")(np.array([0.0], np.float32)), [0.0])
                    assert c.call_counts()["fast"] == 1
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            child.stdout.close()
    finally:
        d.stop()
        import shutil
        shutil.rmtree(state, ignore_errors=True)


def test_server_info_counts_handles_and_channels(daemon, fast_ops):
    with opjit.Client(daemon.unix_address, fast="off") as admin:
        info = admin.info()
        if "handles" not in info.DESCRIPTOR.fields_by_name:
            pytest.fail("ServerInfo has no handles/channels counters")
        base_h, base_c = info.handles, info.channels
        with opjit.Client(daemon.unix_address, fast="on") as c:
            c.op("fast_add")(np.ones(2, np.float32))
            info = admin.info()
            assert info.handles >= base_h + 1 and info.channels >= base_c + 1
        info = admin.info()
        assert info.handles == base_h and info.channels == base_c


# ---- quota and metrics on the channel ---------------------------------------------------------

class MeteredDaemon(TempDaemon):
    """A daemon of its own with a metrics endpoint and `config` added."""

    def __init__(self, config):
        self.spawn('[metrics]\nlisten = "127.0.0.1:0"\n' + config, prefix="opjit-fm-")
        path = os.path.join(self.state, "metrics_endpoint")
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(path) as f:
            self.metrics = f.read().strip()

    def samples(self):
        """[(name, {label: value}, value)] of one scrape."""
        text = urllib.request.urlopen("http://%s/metrics" % self.metrics, timeout=10).read().decode()
        out = []
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            out.append((name, dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels)), float(value)))
        return out

    def value(self, name, **labels):
        return sum(v for n, l, v in self.samples()
                   if n == name and all(l.get(k) == w for k, w in labels.items()))

    def wait_value(self, want, name, **labels):
        """The series' value once it reaches `want` (channels report at least
        once a second), or what it was after 10 s."""
        deadline = time.monotonic() + 10
        while True:
            got = self.value(name, **labels)
            if got >= want or time.monotonic() > deadline:
                return got
            time.sleep(0.05)


def test_channel_calls_are_counted_by_op_namespace_and_code():
    d = MeteredDaemon("[quota]\ncalls_per_second = 1000\n")
    try:
        n = 40
        with opjit.Client(d.unix_address, namespace="fm", timeout=60, fast="on") as c:
            c.register(add_op(1.0))
            f = c.op("fast_add")
            x = c.asarray(np.ones(16, np.float32))
            before = c.call_counts()
            for _ in range(n):
                np.testing.assert_array_equal(f(x), np.full(16, 2, np.float32))
            after = c.call_counts()
            assert after["fast"] - before.get("fast", 0) == n, after  # every one on the channel
            assert after.get("grpc", 0) == before.get("grpc", 0)
            assert after.get("handle", 0) == before.get("handle", 0)
        with opjit.Client(d.unix_address, namespace="fm", timeout=60, fast="off") as g:
            for _ in range(3):
                g.op("fast_add")(np.ones(4, np.float32))
        # A kernel that kills its executor: the calls that executor served
        # before are still counted (the daemon reads its count table after
        # its death), and the crash itself as the daemon answered it.
        with opjit.Client(d.unix_address, namespace="fm", timeout=60, fast="on") as c:
            c.register(unary("fast_crash", CRASH_SRC, "FastCrash"))
            crash = c.op("fast_crash")
            x = c.asarray(np.ones(4, np.float32))
            for _ in range(5):
                crash(x)
            x[0] = -1
            with pytest.raises(opjit.errors.Aborted):
                crash(x)
            assert c.call_counts()["fast"] >= 5  # the crash shows in the metrics below
        channel = dict(method="Forward", namespace="fm", op="fast_add", transport="channel")
        assert d.wait_value(n, "opjit_rpc_calls_total", code="OK", **channel) == n, d.samples()
        assert d.value("opjit_rpc_calls_total", method="Forward", namespace="fm", op="fast_add",
                       code="OK", transport="grpc") == 3
        assert d.value("opjit_channel_kernel_seconds_total", namespace="fm", op="fast_add") > 0
        crashed = dict(method="Forward", namespace="fm", op="fast_crash", transport="channel")
        assert d.wait_value(5, "opjit_rpc_calls_total", code="OK", **crashed) == 5
        assert d.wait_value(1, "opjit_rpc_calls_total", code="ABORTED", **crashed) == 1
    finally:
        d.close()


def test_channel_calls_are_under_calls_per_second():
    d = MeteredDaemon("[quota]\ncalls_per_second = 50\n")
    try:
        with opjit.Client(d.unix_address, namespace="fq", timeout=60, fast="on") as c:
            c.register(add_op(1.0))
            f = c.op("fast_add")
            x = c.asarray(np.ones(16, np.float32))
            g = opjit.Client(d.unix_address, namespace="fq", timeout=60, fast="off")
            g_add = g.op("fast_add")
            y = np.ones(4, np.float32)
            g_add(y)  # warm: the first gRPC call starts the namespace's pool executor
            before = c.call_counts().get("fast", 0)
            ok, t0 = 0, time.monotonic()
            with pytest.raises(opjit.errors.ResourceExhausted) as refused:
                while time.monotonic() - t0 < 3:
                    f(x)
                    ok += 1
            took = time.monotonic() - t0
            # gRPC in the same namespace finds the bucket empty too (a token
            # comes back every 20 ms: of a few quick calls, most are refused).
            grpc_refused = []
            for _ in range(5):
                try:
                    g_add(y)
                except opjit.errors.ResourceExhausted as e:
                    grpc_refused.append(e)
            g.close()
            assert refused.value.reason == "QUOTA_EXCEEDED"
            assert "calls_per_second (50)" in str(refused.value)
            assert took < 1 and 45 <= ok <= 50 + 50 * took + 2, (ok, took)
            assert c.call_counts()["fast"] - before >= ok  # they went over the channel
            assert len(grpc_refused) >= 3
            assert all(e.reason == "QUOTA_EXCEEDED" for e in grpc_refused)
        channel = dict(method="Forward", namespace="fq", op="fast_add", transport="channel")
        assert d.wait_value(ok, "opjit_rpc_calls_total", code="OK", **channel) == ok
        assert d.wait_value(1, "opjit_rpc_calls_total", code="RESOURCE_EXHAUSTED", **channel) >= 1
    finally:
        d.close()
