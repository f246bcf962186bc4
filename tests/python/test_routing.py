"""Several server addresses in the Python client: a dead address skipped,
failover when a daemon is killed mid-run, affinity routing, and inline
tensors of a few MiB over TCP. Each test starts its own daemons (three,
each with its own state directory, on a unix socket and 127.0.0.1:0).

Which daemon ran a call shows in its result: every daemon registers the
same op names with a kernel that writes that daemon's own mark.
"""

import os
import shutil
import signal
import tempfile

import numpy as np
import pytest

import opjit
from opjit import _routing

from conftest import EXAMPLES, Daemon, opjitd_binary

F32 = opjit.DataType.F32_Default

MARK_SRC = r'''
#include <cstdint>
extern "C" int Mark(int nparam, void** params, int* ndims, int64_t** shapes,
                    const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] + MARK;
  return 0;
}
'''


def mark_op(name, mark):
    return (opjit.CustomRegOp(name).input(0, "x").output(0, "y").dtype_format(F32, F32)
            .target("CPU").impl(source=MARK_SRC.replace("MARK", "%d.0f" % mark), entry="Mark")
            .output_rule("same_as", input=0))


@pytest.fixture
def daemons():
    started = []
    try:
        for _ in range(3):
            d = Daemon(opjitd_binary(), tempfile.mkdtemp(prefix="opjit-rt-"))
            started.append(d)
            d.start()
        yield started
    finally:
        for d in started:
            d.stop()
            shutil.rmtree(d.state_dir, ignore_errors=True)


def register_everywhere(daemons, names):
    """Registers each op on every daemon; daemon i's kernel adds 1000 * (i + 1)."""
    for i, d in enumerate(daemons):
        with opjit.Client(d.unix_address, timeout=120) as c:
            for name in names:
                c.register(mark_op(name, 1000 * (i + 1)))


def which(y, x):
    """The daemon (its index) that computed y = x + 1000 * (index + 1)."""
    marks = np.unique(y - x)
    assert len(marks) == 1, marks
    return int(round(marks[0] / 1000)) - 1


def dead_address():
    # A free port nobody listens on (bound then closed), so connects are refused.
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return "127.0.0.1:%d" % port


def test_addresses_parse_from_a_list_or_a_comma_string(monkeypatch):
    assert _routing.split_addresses(" /a.sock, 127.0.0.1:1,,") == ["/a.sock", "127.0.0.1:1"]
    monkeypatch.setenv("OPJIT_SERVER", "/a.sock,127.0.0.1:1")
    assert opjit.default_address() == "unix:/a.sock,127.0.0.1:1"
    c = opjit.Client(timeout=1)
    try:
        assert c.addresses == ["unix:/a.sock", "127.0.0.1:1"]
        assert c.address == "unix:/a.sock"
    finally:
        c.close()
    with pytest.raises(opjit.InvalidArgument):
        opjit.Client(["127.0.0.1:1", "127.0.0.1:2"], routing="random")


def test_rendezvous_is_stable_spreads_and_matches_the_cpp_client():
    # The C++ client's routing_it_test pins these same values.
    assert _routing.rendezvous_score("", "leaky_relu", "unix:/tmp/a.sock") == 8430931691908382791
    assert _routing.rendezvous_score("ns1", "op", "127.0.0.1:7878") == 7069246995912207172
    three = ["h1:1", "h2:1", "h3:1"]
    firsts = [_routing.rendezvous_order("ns", "op%d" % i, three)[0] for i in range(300)]
    assert all(firsts.count(h) > 60 for h in three)
    moved = [i for i in range(300) if _routing.rendezvous_order("ns", "op%d" % i, three + ["h4:1"])[0]
             != firsts[i]]
    # Adding a daemon moves about a quarter of the ops, each onto the new one.
    assert 40 < len(moved) < 120
    assert all(_routing.rendezvous_order("ns", "op%d" % i, three + ["h4:1"])[0] == "h4:1"
               for i in moved)


def test_a_dead_first_address_is_skipped(daemons):
    register_everywhere(daemons, ["mark"])
    x = np.arange(8, dtype=np.float32)
    with opjit.Client([dead_address(), daemons[1].tcp_address, daemons[2].tcp_address],
                      timeout=60, health_timeout=0.5) as c:
        assert c.info().version
        assert c.address == daemons[1].tcp_address
        assert which(c.op("mark")(x), x) == 1
        assert c.transport == "inline"   # TCP with several addresses: inline tensors
    # Every address dead: Unavailable naming them.
    with opjit.Client([dead_address(), dead_address()], timeout=5, health_timeout=0.3) as c:
        with pytest.raises(opjit.Unavailable) as e:
            c.info()
        assert "no opjitd answered" in e.value.message


def test_failover_when_the_daemon_is_killed_mid_run(daemons):
    register_everywhere(daemons, ["mark"])
    x = np.arange(8, dtype=np.float32)
    addrs = ",".join(d.tcp_address for d in daemons)
    with opjit.Client(addrs, timeout=60, health_timeout=0.5) as c:
        op = c.op("mark")
        assert which(op(x), x) == 0
        daemons[0].proc.send_signal(signal.SIGKILL)
        daemons[0].proc.wait()
        # The next idempotent calls succeed on the next daemon.
        assert which(op(x), x) == 1
        assert c.address == daemons[1].tcp_address
        assert c.describe("mark").op.name == "mark"
        assert which(op(x), x) == 1


def test_a_daemons_own_error_is_not_retried_elsewhere(daemons):
    with opjit.Client(daemons[1].unix_address, timeout=60) as c:
        c.register(mark_op("only_on_1", 2000))
    with opjit.Client([daemons[0].tcp_address, daemons[1].tcp_address], timeout=60) as c:
        with pytest.raises(opjit.NotFound):
            c.session().forward("only_on_1", [[np.ones(4, np.float32)]])


def test_affinity_routes_an_op_to_one_daemon_and_spreads_ops(daemons):
    names = ["aff%d" % i for i in range(12)]
    register_everywhere(daemons, names)
    addrs = [d.tcp_address for d in daemons]
    x = np.arange(16, dtype=np.float32)
    used = set()
    with opjit.Client(addrs, routing="affinity", timeout=60) as c:
        sess = c.session()
        for name in names:
            want = addrs.index(c.preferred_addresses(name)[0])
            got = {which(sess.forward(name, [[x]]).outputs[0], x) for _ in range(3)}
            assert got == {want}, name
            used.add(want)
        assert len(used) >= 2, "12 ops all ranked one daemon first"

        # An op's preferred daemon dies: its calls fall through to its next choice.
        name = names[0]
        order = c.preferred_addresses(name)
        victim = daemons[addrs.index(order[0])]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        assert which(sess.forward(name, [[x]]).outputs[0], x) == addrs.index(order[1])


def test_inline_forward_of_a_few_mib_over_tcp(daemons):
    register_everywhere(daemons[:1], ["mark"])
    with opjit.Client([daemons[0].tcp_address, daemons[1].tcp_address], timeout=120) as c:
        x = np.random.default_rng(1).standard_normal(3 << 20 >> 2).astype(np.float32)  # 3 MiB
        y = c.op("mark")(x)
        assert y.dtype == np.float32 and y.shape == x.shape
        np.testing.assert_array_equal(y, x + np.float32(1000))
        assert y.flags.writeable
        assert c.call_counts()["grpc"] >= 1
    # The single-address inline path too (transport="inline" over TCP), with
    # a 2-D shape, and a dynamic input of several tensors (add_n).
    with opjit.Client(daemons[0].tcp_address, transport="inline", timeout=120) as c:
        x = np.arange(2 << 20, dtype=np.float32).reshape(1024, -1)
        y = c.op("mark")(x)
        assert y.shape == x.shape
        np.testing.assert_array_equal(y, x + np.float32(1000))
        c.register(os.path.join(EXAMPLES, "add_n.json"))
        parts = [np.full((256, 1024), k, np.float32) for k in (1, 2, 4)]
        np.testing.assert_array_equal(c.op("add_n")(parts), np.full((256, 1024), 7, np.float32))
