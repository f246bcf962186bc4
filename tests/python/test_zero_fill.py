"""Outputs and workspaces never carry earlier bytes (issue 27, item 5).

The "Why" of the issue: an op that writes nothing, called after an op that
filled a same-size output with 1234.5, returned 1024 of 1024 values equal to
1234.5, inline and in shm, within one namespace (which several principals may
share). Here alice and bob share namespace "lab" on a daemon of the test's
own with one executor per namespace, so every call of the namespace runs in
the same executor and lands on the same arena bytes:

* `z27_fill` (A) fills its 1024-float output with 1234.5;
* `z27_none` (B) writes nothing to its output of the same size;
* `z27_ws` (W) asks for a 4096-byte workspace in Init, copies what its
  workspace holds into its output, then fills the workspace with 1234.5 (a
  freed workspace is the next call's on the same heap).

B's output and W's must be all zeros, on every transport: inline (through
the executor's arena, A by alice then B by bob), in a region at a fixed
offset over gRPC (a pool executor), and over the fast channel; and with the
kernels run in the daemon ([exec] isolation = "in-daemon"). Each reuse is
checked to hit the very bytes A wrote, so a test that stopped reaching them
fails rather than passes. And the executor's arena keeps nothing of a call
once it is answered: a kernel that reads past its own inline tensors finds
zeros, not the input bob sent before. The daemon started with the
benchmark's switch OPJIT_BENCH_NO_ZERO_FILL=1 shows the reproduction: there
B returns 1234.5 and the over-reading kernel finds bob's 7777.

The per-call opt-out, ForwardRequest.keep_output_bytes (``keep_output_bytes=True``
in the client): an output in the caller's own region (or on its fast
channel) keeps the bytes that memory held, which only the caller could put
there; inline outputs and workspaces are zeroed all the same, and another
principal cannot name the region at all, so it never gets anyone else's
bytes this way.
"""

import contextlib

import gc
import mmap
import os

import grpc
import numpy as np
import pytest

import opjit
from opjit.v1 import exec_pb2, exec_pb2_grpc, memory_pb2, memory_pb2_grpc

from conftest import TempDaemon, principal_toml, unary_kernel, unary_spec, wait_for

NS = "lab"
N = 1024
TOKENS = {"alice": "alice-token-z27-0123456789", "bob": "bob-token-z27-0123456789"}

NONE = r"""#include <cstdint>
extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  return 0;  // writes nothing
}
"""

WORKSPACE = r"""#include <cstdint>
#include <cstring>
#include <vector>
#include "custom_aot_extra.h"
extern "C" int KInit(int* nd, int64_t** s, const char** d, AotExtra* extra) {
  extra->SetWorkSpace(std::vector<size_t>{4096});
  return 0;
}
extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  if (n != 3) return 1;
  float* y = static_cast<float*>(p[1]);
  float* ws = static_cast<float*>(p[2]);
  std::memcpy(y, ws, 4096);  // what the workspace held when the kernel started
  for (int i = 0; i < 1024; ++i) ws[i] = 1234.5f;  // and leave it dirty
  return 0;
}
"""


# A buggy kernel that reads past its own tensors: 16 floats in, and it
# copies the 4 KiB that follow its 4 KiB output into that output. Inline, its
# tensors sit at the start of its executor's arena, so it reads bytes no call
# of its own put there.
PEEK = r"""#include <cstdint>
#include <cstring>
extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  char* y = static_cast<char*>(p[1]);
  std::memcpy(y, y + 4096, 4096);
  return 0;
}
"""


def specs():
    peek = unary_spec("z27_peek", PEEK, namespace=NS)
    peek["output_rules"] = [{"kind": "explicit", "shape": [N], "dtype": "float32"}]
    return [unary_spec("z27_fill", unary_kernel("* 0.0f + 1234.5f"), namespace=NS),
            unary_spec("z27_none", NONE, namespace=NS),
            unary_spec("z27_ws", WORKSPACE, namespace=NS), peek]


class Lab(TempDaemon):
    """alice and bob, users of namespace "lab"; one executor per namespace."""

    def __init__(self, isolation="process", env=None):
        config = ('[exec]\nisolation = "%s"\nworkers = 1\n' % isolation
                  + principal_toml("alice", "user", [NS], TOKENS["alice"])
                  + principal_toml("bob", "user", [NS], TOKENS["bob"]))
        old = dict(os.environ)
        os.environ.update(env or {})
        try:
            self.spawn(config, prefix="opjit-z27-", tcp=True, serving=False)
        finally:
            os.environ.clear()
            os.environ.update(old)
        wait_for(self.answers_alice, 60, "opjitd to answer")
        with self.client("alice") as c:
            for s in specs():
                c.register(s)

    def answers_alice(self):
        if self.proc.poll() is not None:
            raise RuntimeError("opjitd exited:\n" + self.read_log())
        try:
            with self.client("alice") as c:
                c.info()
            return True
        except opjit.OpjitError:
            return False

    def client(self, who, **kw):
        """A client of `who`: inline over TCP, or kw (transport, fast) on the unix socket."""
        if kw:
            return opjit.Client(self.unix_address, namespace=NS, token=TOKENS[who], timeout=60,
                                **kw)
        return opjit.Client(self.tcp_address, namespace=NS, token=TOKENS[who],
                            transport="inline", timeout=60)

    def stubs(self, who):
        ch = grpc.insecure_channel(self.unix_address)
        md = [("authorization", "Bearer " + TOKENS[who])]
        return memory_pb2_grpc.MemoryStub(ch), exec_pb2_grpc.ExecutorStub(ch), md


def x():
    return np.arange(N, dtype=np.float32)


@pytest.fixture(scope="module", params=["process", "in-daemon"])
def lab(request):
    d = Lab(request.param)
    d.isolation = request.param
    yield d
    d.close()


def inline_reuse(lab):
    """A by alice, then B by bob, inline: B's output."""
    with lab.client("alice") as a, lab.client("bob") as b:
        filled = a.op("z27_fill")(x())
        assert np.all(np.asarray(filled) == 1234.5)
        return np.array(b.op("z27_none")(x()))


@contextlib.contextmanager
def own_region(lab, who, name):
    """A region of `who`'s (2 * N floats: the output at 0, the input x()
    after it), mapped here: yields (executor stub, metadata, mapping)."""
    mem, ex, md = lab.stubs(who)
    client_id = "z27-" + who
    info = mem.CreateRegion(memory_pb2.CreateRegionRequest(
        namespace=NS, name=name, byte_size=2 * 4 * N, client_id=client_id), timeout=10,
        metadata=md)
    try:
        fd = os.open("/dev/shm" + info.shm_key, os.O_RDWR)
        with mmap.mmap(fd, 2 * 4 * N) as m:
            os.close(fd)
            m[4 * N:] = x().tobytes()
            yield ex, md, m
    finally:
        mem.ReleaseClient(memory_pb2.ReleaseClientRequest(namespace=NS, client_id=client_id),
                          timeout=10, metadata=md)


def shm_call(ex, md, op, region, keep=False):
    """`op` over gRPC with its input at 4 * N and its output at offset 0 of `region`."""
    req = exec_pb2.ForwardRequest(namespace=NS, op=op, keep_output_bytes=keep)
    t = req.inputs.add().tensors.add()
    t.dtype, t.shm.region, t.shm.offset = "float32", region, 4 * N
    t.shape.append(N)
    out = req.outputs.add().shm
    out.region, out.offset = region, 0
    resp = ex.Forward(req, timeout=30, metadata=md)
    assert resp.outputs[0].shm.offset == 0, resp
    return resp


def shm_reuse(lab, op="z27_none", keep=False):
    """A then `op` (with keep_output_bytes=`keep`), each with its output at
    offset 0 of one region of alice's, over gRPC: (the region's bytes after
    A, `op`'s output)."""
    with own_region(lab, "alice", "z27_out") as (ex, md, m):
        seen = []
        for name, k in (("z27_fill", False), (op, keep)):
            shm_call(ex, md, name, "z27_out", k)
            seen.append(np.frombuffer(m[:4 * N], np.float32).copy())
        return seen


def test_inline_output_of_another_principal_starts_zeroed(lab):
    y = inline_reuse(lab)
    assert y.shape == (N,)
    assert np.count_nonzero(y) == 0, "%d of %d values carried over: %s" % (
        np.count_nonzero(y), N, y[:4])


def test_shm_output_starts_zeroed(lab):
    after_fill, y = shm_reuse(lab)
    assert np.all(after_fill == 1234.5)  # A's bytes were there
    assert np.count_nonzero(y) == 0, "%d of %d values carried over: %s" % (
        np.count_nonzero(y), N, y[:4])


def test_workspaces_start_zeroed_on_every_call(lab):
    with lab.client("alice") as a, lab.client("bob") as b:
        for c in (a, b, a, b):
            w = np.array(c.op("z27_ws")(x()))
            assert np.count_nonzero(w) == 0, w[:4]
    for _ in range(2):
        _, w = shm_reuse(lab, "z27_ws")
        assert np.count_nonzero(w) == 0, w[:4]


def test_fast_channel_outputs_and_workspaces_start_zeroed(lab):
    if lab.isolation != "process":
        pytest.skip("fast channels need executor processes")
    with lab.client("alice", fast="on") as c:
        xs = c.asarray(x())
        pool = c._transport.pool(NS)
        filled = c.op("z27_fill")(xs)
        assert np.all(filled == 1234.5)
        at = pool.locate(filled)
        assert at is not None
        del filled
        gc.collect()
        y = c.op("z27_none")(xs)
        # The very block A filled (the pool hands the freed block out again).
        assert pool.locate(y) == at
        assert np.count_nonzero(y) == 0, "%d of %d values carried over: %s" % (
            np.count_nonzero(y), N, y[:4])
        del y
        for _ in range(3):
            w = c.op("z27_ws")(xs)
            assert np.count_nonzero(w) == 0, w[:4]
            del w
        counts = c.call_counts()
        assert counts.get("fast", 0) >= 5, counts


def arena_after(lab):
    """bob's inline call (2048 floats of 7777 in, 1234.5 out), then alice's
    z27_peek inline: what it found past its own tensors."""
    with lab.client("bob") as b, lab.client("alice") as a:
        assert np.all(np.asarray(b.op("z27_fill")(np.full(2 * N, 7777, np.float32))) == 1234.5)
        return np.array(a.op("z27_peek")(np.zeros(16, np.float32)))


def test_the_arena_keeps_nothing_of_an_earlier_call(lab):
    if lab.isolation != "process":
        pytest.skip("in-daemon, inline tensors are the request's own buffers (no arena)")
    y = arena_after(lab)
    assert y.shape == (N,)
    assert np.count_nonzero(y) == 0, "%d of %d values of bob's call: %s" % (
        np.count_nonzero(y), N, y[:4])


# ---- keep_output_bytes: the per-call opt-out ---------------------------------------


def test_keep_output_bytes_keeps_the_callers_own_shm_bytes(lab):
    after_fill, y = shm_reuse(lab, keep=True)
    assert np.all(after_fill == 1234.5)
    # The kernel wrote nothing: the region holds what alice's last call left.
    assert np.all(y == 1234.5), y[:4]
    # And without the option, the same call zeroes it again.
    _, y = shm_reuse(lab, keep=False)
    assert np.count_nonzero(y) == 0, y[:4]


def test_keep_output_bytes_never_reaches_another_principals_bytes(lab):
    """bob keeps only bytes of his own region; alice's region, which holds
    her 1234.5, is not his to name (NOT_FOUND, as a missing region)."""
    with own_region(lab, "alice", "z27_a") as (ex_a, md_a, m_a), \
            own_region(lab, "bob", "z27_b") as (ex_b, md_b, m_b):
        shm_call(ex_a, md_a, "z27_fill", "z27_a")
        assert np.all(np.frombuffer(m_a[:4 * N], np.float32) == 1234.5)
        m_b[:4 * N] = np.full(N, 42.0, np.float32).tobytes()  # bob's own bytes
        shm_call(ex_b, md_b, "z27_none", "z27_b", keep=True)
        y = np.frombuffer(m_b[:4 * N], np.float32)
        assert np.all(y == 42.0), y[:4]
        with pytest.raises(grpc.RpcError) as e:
            shm_call(ex_b, md_b, "z27_none", "z27_a", keep=True)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        # alice's bytes are where she left them, untouched by bob's try.
        assert np.all(np.frombuffer(m_a[:4 * N], np.float32) == 1234.5)
        # Inline, bob's keep call after alice's fill gets zeros.
        with lab.client("alice") as a, lab.client("bob") as b:
            assert np.all(np.asarray(a.op("z27_fill")(x())) == 1234.5)
            y = np.array(b.op("z27_none")(x(), keep_output_bytes=True))
            assert np.count_nonzero(y) == 0, y[:4]


def test_keep_output_bytes_still_zeroes_inline_outputs_and_workspaces(lab):
    with lab.client("alice") as a, lab.client("bob") as b:
        for c in (a, b, a):
            assert np.all(np.asarray(c.op("z27_fill")(x(), keep_output_bytes=True)) == 1234.5)
            y = np.array(c.op("z27_none")(x(), keep_output_bytes=True))
            assert y.shape == (N,)
            assert np.count_nonzero(y) == 0, y[:4]
            w = np.array(c.op("z27_ws")(x(), keep_output_bytes=True))
            assert np.count_nonzero(w) == 0, w[:4]
    # A workspace behind an output kept in shm: the kernel copies all of its
    # workspace over its output, so the output shows the workspace zeroed.
    for _ in range(2):
        after_fill, w = shm_reuse(lab, "z27_ws", keep=True)
        assert np.all(after_fill == 1234.5)
        assert np.count_nonzero(w) == 0, w[:4]


def test_keep_output_bytes_on_the_fast_channel(lab):
    if lab.isolation != "process":
        pytest.skip("fast channels need executor processes")
    with lab.client("alice", fast="on") as c:
        xs = c.asarray(x())
        pool = c._transport.pool(NS)
        before = c.call_counts().get("fast", 0)
        filled = c.op("z27_fill")(xs)
        at = pool.locate(filled)
        assert at is not None
        del filled
        gc.collect()
        # The very block alice's fill left 1234.5 in: kept as it was.
        y = c.op("z27_none")(xs, keep_output_bytes=True)
        assert pool.locate(y) == at
        assert np.all(y == 1234.5), y[:4]
        del y
        gc.collect()
        # Without the option, the same block starts zeroed again.
        y = c.op("z27_none")(xs)
        assert pool.locate(y) == at
        assert np.count_nonzero(y) == 0, y[:4]
        del y
        # Workspaces start zeroed with the option too.
        for _ in range(2):
            w = c.op("z27_ws")(xs, keep_output_bytes=True)
            assert np.count_nonzero(w) == 0, w[:4]
            del w
        assert c.call_counts().get("fast", 0) - before >= 5, c.call_counts()


def test_without_zero_fill_the_reproduction_carries_bytes_over():
    """The benchmark's switch leaves outputs as they are: the reproduction
    of "Why" then returns A's bytes, which is what the tests above catch."""
    d = Lab("process", env={"OPJIT_BENCH_NO_ZERO_FILL": "1"})
    try:
        assert np.all(inline_reuse(d) == 1234.5)
        _, y = shm_reuse(d)
        assert np.all(y == 1234.5)
        assert np.count_nonzero(arena_after(d) == 7777) > 0
    finally:
        d.close()
