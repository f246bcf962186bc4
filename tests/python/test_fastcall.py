"""opjit._fastcall, the compiled fast-channel call, against the pure-Python one.

The same calls (Op calls and Op.prepare's PreparedCalls) run in two child
processes, one with the extension and one with OPJIT_PURE_PYTHON=1, and must
give the same results and the same exceptions: a kernel that fails, a crash,
a deadline, a channel closed under the call, a daemon gone. The rest runs in
this process on whichever path it has (ctest runs the file both ways):
PreparedCall's contract, the channel against a stub executor (the GIL
released while a call waits, refs checked), and that the extension is used
whenever it was built.
"""

import glob
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import opjit
from opjit import _fast
from opjit._proto import exec_pb2

from conftest import EXAMPLES, SPIN_KERNEL, TempDaemon, unary_kernel, unary_spec

PURE = os.environ.get("OPJIT_PURE_PYTHON", "") not in ("", "0")
BUILT = bool(glob.glob(os.path.join(os.path.dirname(_fast.__file__), "_fastcall*.so")))
needs_channel = pytest.mark.skipif(not _fast.supported(),
                                   reason="the fast channel is x86-64 Linux only")



# fc_fail returns 3 from the kernel; fc_crash traps on x[0] < 0; fc_spin
# busy-waits x[0] seconds.
SAME = {"output_rules": [{"kind": "same_as", "input": 0}]}
OPS = [
    unary_spec("fc_add", unary_kernel("+ 1.0f"), **SAME),
    unary_spec("fc_fail", unary_kernel("* 1.0f", "if (k > 0) return 3;"), **SAME),
    unary_spec("fc_crash", unary_kernel("* 2.0f", "if (k > 0 && x[0] < 0) __builtin_trap();"),
               **SAME),
    unary_spec("fc_spin", SPIN_KERNEL, **SAME),
]


def register_ops(client):
    for spec in OPS:
        client.register(spec)
    for name in ("leaky_relu", "arith3", "add_n", "scale_bias", "reduce_sum"):
        client.register(os.path.join(EXAMPLES, name + ".json"))


@pytest.fixture(scope="module")
def fc_ops(daemon, examples_registered):
    with opjit.Client(daemon.unix_address, timeout=120) as c:
        for spec in OPS:
            c.register(spec)
    return True


# ---- the same calls on both paths, in child processes ---------------------------------------

CHILD = textwrap.dedent(r'''
    import json, os, signal, sys
    import numpy as np
    import opjit
    from opjit import _fast

    address, daemon_pid = sys.argv[1], int(sys.argv[2])
    out = {"extension": _fast.EXTENSION is not None, "cases": {}}

    def run(name, fn):
        try:
            v = fn()
            vals = v if isinstance(v, tuple) else (v,)
            out["cases"][name] = {"ok": [[str(a.dtype), list(a.shape), a.tolist()] for a in vals]}
        except opjit.OpjitError as e:
            out["cases"][name] = {"error": [type(e).__name__, e.code.name, e.reason]}

    c = opjit.Client(address, timeout=60, fast="on")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    a, b = (rng.standard_normal(9).astype(np.float32) for _ in range(2))
    calls = [("leaky_relu", (x,), {"alpha": 0.2}), ("arith3", (a, b), {}),
             ("add_n", ([a, b, a],), {}), ("scale_bias", (a, None), {"scale": 3.0}),
             ("reduce_sum", (x,), {"axis": 1}), ("fc_add", (np.zeros((0,), np.float32),), {}),
             ("fc_fail", (a,), {})]
    prepared = {}
    for name, args, kw in calls:
        op = c.op(name)
        run("op " + name, lambda: op(*args, **kw))
        p = prepared[name] = op.prepare(*args, **kw)
        run("prepared " + name, p)
        for g in p.inputs:        # new values in place, then again
            for arr in g:
                arr *= -2
        run("prepared again " + name, p)
        out["cases"]["path " + name] = {"ok": p.path}

    crash = c.op("fc_crash").prepare(np.array([-1.0, 2.0], np.float32))
    run("prepared crash", crash)
    crash.inputs[0][0][0] = 1.0
    run("prepared after crash", crash)

    # The channel closed under a prepared call: reopened, the call runs.
    c._transport.channel(c.namespace).close()
    run("prepared after close", prepared["leaky_relu"])
    ch = c._transport.channel(c.namespace)
    ch.close()
    try:
        ch.call(1, [0, 0])
        out["cases"]["closed channel call"] = {"ok": "ran"}
    except _fast.ChannelClosed:
        out["cases"]["closed channel call"] = {"error": "ChannelClosed"}

    with opjit.Client(address, timeout=1.0, fast="on") as d:
        run("op deadline", lambda: d.op("fc_spin")(np.array([20.0], np.float32)))
        spin = d.op("fc_spin").prepare(np.array([20.0], np.float32))
        run("prepared deadline", spin)
        spin.inputs[0][0][0] = 0.0
        run("prepared after deadline", spin)
        out["cases"]["deadline client calls"] = {"ok": d.call_counts()}
    out["cases"]["calls"] = {"ok": c.call_counts()}

    if daemon_pid:  # the daemon is gone: a prepared call and an Op call fail alike
        import struct, threading, time
        leaky = prepared["leaky_relu"]
        # Killed while a call waits on its executor: the call fails at once,
        # naming the daemon (not the executor, not after its grace).
        spin = c.op("fc_spin").prepare(np.array([30.0], np.float32))
        ch = c._transport.channel(c.namespace)
        answered = []
        def mid_call():
            try:
                spin()
                answered.append((time.monotonic(), "ok"))
            except opjit.OpjitError as e:
                answered.append((time.monotonic(), [type(e).__name__, e.code.name, e.reason,
                                                    e.message]))
        t = threading.Thread(target=mid_call)
        t.start()
        until = time.monotonic() + 60
        while time.monotonic() < until and not any(
                struct.unpack_from("<I", ch._mm, _fast.HEADER_BYTES + i * _fast.SLOT_BYTES)[0]
                == _fast.RUNNING for i in range(ch.n_slots)):
            time.sleep(0.002)
        killed = time.monotonic()
        os.kill(daemon_pid, signal.SIGKILL)
        t.join(60)
        when, err = answered[0]
        out["cases"]["prepared daemon killed mid-call"] = {"error": err}
        out["mid-call latency s"] = when - killed
        run("prepared daemon gone", leaky)
        run("op daemon gone", lambda: c.op("leaky_relu")(x))
    print(json.dumps(out))
''')


def run_child(address, pure, daemon_pid=0):
    env = dict(os.environ, OPJIT_FAST="on", OPJIT_PURE_PYTHON="1" if pure else "0")
    p = subprocess.run([sys.executable, "-c", CHILD, address, str(daemon_pid)], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300)
    assert p.returncode == 0, p.stderr.decode(errors="replace")[-3000:]
    return json.loads(p.stdout.decode().strip().splitlines()[-1])


@needs_channel
def test_both_paths_give_the_same_results_and_errors(daemon, fc_ops):
    if not BUILT:
        pytest.skip("opjit._fastcall is not built here (the pure-Python path alone)")
    ext = run_child(daemon.unix_address, pure=False)
    pure = run_child(daemon.unix_address, pure=True)
    assert ext["extension"] and not pure["extension"]
    assert ext["cases"].keys() == pure["cases"].keys()
    for name in ext["cases"]:
        if name in ("calls", "deadline client calls"):
            continue
        assert ext["cases"][name] == pure["cases"][name], name
    cases = ext["cases"]
    for name in ("leaky_relu", "arith3", "add_n", "scale_bias", "reduce_sum", "fc_add"):
        assert cases["path " + name] == {"ok": "fast"}, name
        assert cases["prepared " + name] == cases["op " + name], name
        assert "ok" in cases["prepared again " + name], name
    # A kernel's own error, a crash, a deadline: as Op calls raise them.
    assert cases["prepared fc_fail"] == cases["op fc_fail"]
    assert cases["prepared fc_fail"]["error"][1:] == ["ABORTED", "KERNEL_FAILED"]
    assert cases["prepared crash"]["error"][2] == "KERNEL_CRASHED"
    assert cases["prepared after crash"] == {"ok": [["float32", [2], [2.0, 4.0]]]}
    assert cases["prepared deadline"] == cases["op deadline"]
    assert cases["prepared deadline"]["error"][0] == "DeadlineExceeded"
    assert cases["prepared after deadline"] == {"ok": [["float32", [1], [0.0]]]}
    assert cases["prepared after close"] == cases["prepared again leaky_relu"]
    assert cases["closed channel call"] == {"error": "ChannelClosed"}
    # Every call of both clients went over the channel.
    for side in (ext, pure):
        assert side["cases"]["calls"]["ok"]["grpc"] == 0, side["cases"]["calls"]
        assert side["cases"]["calls"]["ok"]["handle"] == 0, side["cases"]["calls"]
        assert side["cases"]["deadline client calls"]["ok"]["fast"] >= 1


@needs_channel
def test_the_results_match_grpc(daemon, fc_ops):
    """This process's path (either) against the same calls over gRPC."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 7)).astype(np.float32)
    with opjit.Client(daemon.unix_address, timeout=60, fast="on") as f, \
            opjit.Client(daemon.unix_address, timeout=60, fast="off") as g:
        for name, args, kw in (("leaky_relu", (x,), {"alpha": 0.3}),
                               ("arith3", (x[0], x[1]), {}),
                               ("scale_bias", (x[0], x[1]), {"scale": 0.5})):
            p = f.op(name).prepare(*args, **kw)
            for _ in range(3):
                got = p()
                want = g.op(name)(*args, **kw)
                got = got if isinstance(got, tuple) else (got,)
                want = want if isinstance(want, tuple) else (want,)
                for u, w in zip(got, want):
                    np.testing.assert_array_equal(u, w, err_msg=name)
                for group in p.inputs:
                    for arr in group:
                        arr += 1.0
                args = tuple(arr + 1.0 for arr in args)
            assert p.path == "fast"


@needs_channel
def test_daemon_gone_fails_alike_on_both_paths():
    if not BUILT:
        pytest.skip("opjit._fastcall is not built here (the pure-Python path alone)")
    results = []
    for pure in (False, True):
        d = TempDaemon()
        d.spawn(None, prefix="opjit-fc-", serving=True)
        try:
            with opjit.Client(d.unix_address, timeout=60) as admin:
                register_ops(admin)
            results.append(run_child(d.unix_address, pure, daemon_pid=d.proc.pid))
            results[-1]["daemon_pid"] = d.proc.pid
        finally:
            d.close()
    ext, pure = results
    for name in ("prepared daemon gone", "op daemon gone"):
        assert ext["cases"][name] == pure["cases"][name], name
        assert "error" in ext["cases"][name], ext["cases"][name]
    assert ext["cases"]["prepared daemon gone"]["error"][0] == "Unavailable"
    name = "prepared daemon killed mid-call"
    for side in (ext, pure):
        err = side["cases"][name]["error"]
        assert err[:3] == ["Unavailable", "UNAVAILABLE", "DAEMON_EXITED"], err
        assert err[3].startswith("opjitd (pid %d) exited" % side["daemon_pid"]), err
        assert "executor" not in err[3], err
        # A generous bound (no timed claim): before, 2-3 s and ABORTED.
        assert side["mid-call latency s"] < 5.0, side["mid-call latency s"]
    print("daemon killed mid-call, answered after: extension %.0f ms, pure Python %.0f ms"
          % (ext["mid-call latency s"] * 1e3, pure["mid-call latency s"] * 1e3))


# ---- in this process: whichever path it has --------------------------------------------------

def test_the_extension_is_used_when_built():
    """With _fastcall*.so next to _fast.py and OPJIT_PURE_PYTHON unset, every
    channel and prepared call runs in C++; with it set, none does."""
    expect = os.environ.get("OPJIT_EXPECT_EXTENSION") == "1"
    if not BUILT:
        assert not expect, "the build has opjit._fastcall, but it is not next to _fast.py"
        pytest.skip("opjit._fastcall is not built here (the pure-Python path alone)")
    if PURE:
        assert _fast.EXTENSION is None
        assert _fast.FastChannel is _fast.PyFastChannel and _fast.Call is _fast.PyCall
        return
    if not _fast.supported():
        pytest.skip("the fast channel is x86-64 Linux only")
    from opjit import _fastcall
    assert _fast.EXTENSION is _fastcall
    assert _fast.FastChannel is _fast.ExtFastChannel
    assert _fast.Call is _fastcall.Call
    assert issubclass(opjit.PreparedCall, _fastcall.Call)


@needs_channel
def test_prepared_call_contract(daemon, fc_ops):
    with opjit.Client(daemon.unix_address, timeout=60, fast="on") as c:
        add = c.op("fc_add")
        plain = np.arange(6, dtype=np.float32)
        p = add.prepare(plain)
        assert isinstance(p, opjit.PreparedCall) and p.path == "fast"
        assert p.inputs[0][0] is not plain  # copied into shared memory once
        shm = c.asarray(plain)
        q = add.prepare(shm)
        assert q.inputs[0][0] is shm        # already there: used as it is
        before = c.call_counts()["fast"]
        y = q()
        np.testing.assert_array_equal(y, plain + 1)
        shm[:] = 10
        assert q() is y and q.outputs == (y,)  # the same output array, overwritten
        np.testing.assert_array_equal(y, np.full(6, 11, np.float32))
        assert q.kernel_ms >= 0
        assert c.call_counts()["fast"] == before + 2
        with pytest.raises(TypeError):
            q(shm)
        with pytest.raises(opjit.InvalidArgument):
            add.prepare(shm, requires_grad=True)
        # Several outputs: a tuple, the same one every call.
        arith = c.op("arith3").prepare(np.ones(3, np.float32), np.full(3, 2, np.float32))
        r = arith()
        assert isinstance(r, tuple) and len(r) == 3 and arith() is r


@needs_channel
def test_prepared_call_survives_a_changed_op(daemon, fc_ops):
    with opjit.Client(daemon.unix_address, timeout=60, fast="on") as c:
        c.register(unary_spec("fc_stale", unary_kernel("+ 1.0f"), **SAME))
        p = c.op("fc_stale").prepare(np.zeros(4, np.float32))
        np.testing.assert_array_equal(p(), np.ones(4, np.float32))
        c.register(unary_spec("fc_stale", unary_kernel("+ 2.0f"), **SAME))  # the handle goes stale
        np.testing.assert_array_equal(p(), np.full(4, 2, np.float32))
        assert p.path == "fast"


@needs_channel
def test_prepared_call_without_the_fast_path(daemon, fc_ops):
    with opjit.Client(daemon.unix_address, timeout=60, fast="off") as c:
        p = c.op("fc_add").prepare(np.arange(3, dtype=np.float32))
        assert p.path == "forward"
        y = p()
        np.testing.assert_array_equal(y, [1, 2, 3])
        p.inputs[0][0][:] = 5
        assert p() is y  # from the second call on, copied into the same array
        np.testing.assert_array_equal(y, [6, 6, 6])
        with pytest.raises(opjit.Aborted):
            c.op("fc_fail").prepare(np.ones(2, np.float32))()
        assert c.call_counts()["fast"] == 0


@needs_channel
def test_prepared_calls_from_many_threads(daemon, fc_ops):
    """12 threads (more than the 8 slots), a prepared call each."""
    with opjit.Client(daemon.unix_address, timeout=60, fast="on") as c:
        add = c.op("fc_add")
        errors = []

        def work(k):
            p = add.prepare(np.full(5, k, np.float32))
            for j in range(200):
                p.inputs[0][0][:] = k + j
                try:
                    np.testing.assert_array_equal(p(), np.full(5, k + j + 1, np.float32))
                except Exception as e:  # pragma: no cover - reported below
                    errors.append(e)
                    return

        threads = [threading.Thread(target=work, args=(k,)) for k in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        assert c.call_counts()["fast"] >= 12 * 200


# ---- the channel alone, against a stub executor ------------------------------------------------

# Serves one call on the channel at argv[1] after argv[2] seconds: kernel_ms
# = the first tensor's offset.
SLOW_STUB = textwrap.dedent(r'''
    import ctypes, mmap, os, struct, sys, time
    from opjit import _fast as F
    fd = os.open(sys.argv[1], os.O_RDWR)
    mm = mmap.mmap(fd, 0)
    os.close(fd)
    states = [ctypes.c_uint32.from_buffer(mm, F.HEADER_BYTES + i * F.SLOT_BYTES) for i in range(8)]
    sc = F._syscall()
    while True:
        for i, st in enumerate(states):
            if st.value == F.SUBMITTED:
                st.value = F.RUNNING
                time.sleep(float(sys.argv[2]))
                base = F.HEADER_BYTES + i * F.SLOT_BYTES
                off = struct.unpack_from("<Q", mm, base + F.S_TENSORS + 8)[0]
                struct.pack_into("<iId", mm, base + F.S_CODE, 0, 0, float(off))
                st.value = F.DONE
                sc(F._SYS_FUTEX, ctypes.c_void_p(ctypes.addressof(st)), F._FUTEX_WAKE,
                   ctypes.c_long(1), None, None, F._ZERO)
                sys.exit(0)
''')

CHANNELS = [pytest.param("PyFastChannel", id="pure"),
            pytest.param("ExtFastChannel", id="extension",
                         marks=pytest.mark.skipif(_fast.EXTENSION is None,
                                                  reason="opjit._fastcall is not in use"))]


@pytest.fixture
def stub_ring(request):
    """(path, OpenChannelResponse) of a fresh 8-slot ring in /dev/shm."""
    key = "opjit-test-fc-%d-%s" % (os.getpid(), request.node.name.replace("/", "_")[-40:])
    path = "/dev/shm/" + key
    size = _fast.HEADER_BYTES + 8 * _fast.SLOT_BYTES
    with open(path, "wb") as f:
        f.truncate(size)
        f.write(struct.pack("<IIIIII", _fast.MAGIC, _fast.VERSION, 8, _fast.SLOT_BYTES, 64, 0))
    info = exec_pb2.OpenChannelResponse(shm_key="/" + key, byte_size=size, slots=8,
                                        max_tensors=64, spin_us=20)
    yield path, info
    os.unlink(path)


@needs_channel
@pytest.mark.parametrize("kind", CHANNELS)
def test_a_waiting_call_releases_the_gil(kind, stub_ring):
    path, info = stub_ring
    stub = subprocess.Popen([sys.executable, "-c", SLOW_STUB, path, "0.3"])
    try:
        info.worker_pid = stub.pid
        ch = getattr(_fast, kind)(info)
        ticks = [0]
        stop = threading.Event()

        def count():
            while not stop.is_set():
                ticks[0] += 1

        t = threading.Thread(target=count)
        t.start()
        try:
            time.sleep(0.01)
            before = ticks[0]
            r = ch.call(7, [1, 4096, 1, 0])
            during = ticks[0] - before
        finally:
            stop.set()
            t.join()
        assert (r.code, r.kernel_ms) == (0, 4096.0)
        assert during > 1000, "another thread barely ran during a 0.3 s call (%d)" % during
        ch.close()
    finally:
        if stub.poll() is None:
            stub.kill()
        stub.wait()


@needs_channel
@pytest.mark.parametrize("kind", CHANNELS)
def test_bad_refs_and_a_closed_channel(kind, stub_ring):
    _, info = stub_ring
    ch = getattr(_fast, kind)(info)
    with pytest.raises(_fast.ChannelError):
        ch.call(7, [1, 0] * 65)  # more tensors than a slot takes
    call_type = _fast.EXTENSION.Call if kind == "ExtFastChannel" else _fast.PyCall
    call = call_type()
    with pytest.raises(_fast.ChannelError):
        call.bind(ch.native, 7, [1, 0] * 65)
    if kind == "ExtFastChannel":
        with pytest.raises(ValueError):
            ch.call(7, [1, 0, 1])
        with pytest.raises(TypeError):
            ch.call(7, [1, "x"])
        # A buffer that cannot be a ring: refused before any call.
        Channel = _fast.EXTENSION.Channel
        exc = (_fast.ChannelClosed, _fast.ChannelError)
        with pytest.raises(ValueError):
            Channel(bytearray(4096), 8, 64, 0, 0, *exc)   # too small for 8 slots
        with pytest.raises(ValueError):
            Channel(bytearray(1 << 16), 0, 64, 0, 0, *exc)  # no slot
        with pytest.raises(BufferError):
            Channel(b"\0" * (1 << 16), 8, 64, 0, 0, *exc)  # read-only
    ch.close()
    assert ch.closed
    with pytest.raises(_fast.ChannelClosed):
        ch.call(7, [1, 0])

    class Recorder(call_type):
        def _slow(self, code, reason, message):
            return ("slow", code, reason, message)

    rec = Recorder()
    assert rec() == ("slow", None, "", "")  # unbound
    rec.bind(ch.native, 7, [1, 0])
    assert rec() == ("slow", -1, "", "the fast channel is closed")
