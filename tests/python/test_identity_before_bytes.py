"""Identity before bytes (issue 41, hole 7): a unix peer whose uid maps to no
principal is recognised when its connection is accepted, before it sends a
byte, and served by a gRPC server whose largest message is 64 KiB
(kGuestMaxMessageBytes in server/rpc/grpc_server.h). Its 300 MB message is
refused without being decoded; before, it was decoded in full before the
handler refused the caller (+0.7 GB VmHWM for one message).
"""

import os
import subprocess
import tempfile

import grpc
import pytest

from opjit.v1 import op_pb2, registry_pb2, registry_pb2_grpc

from conftest import TempDaemon, principal_toml, vm_hwm_kb

BIG = 300 << 20

# Run as nobody (uid 65534, mapped to no principal): sends `n` messages of
# argv[2] bytes at once, prints each call's code and message on one line.
SENDER = r"""
import sys, threading, grpc
from opjit.v1 import op_pb2, registry_pb2, registry_pb2_grpc
addr, size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
out = []
def one():
    stub = registry_pb2_grpc.RegistryStub(grpc.insecure_channel(addr, options=opts))
    req = registry_pb2.RegisterOpRequest(op=op_pb2.OpDef(namespace="shared", name="big",
                                                         doc="x" * size))
    try:
        stub.RegisterOp(req, timeout=60)
        out.append("OK -")
    except grpc.RpcError as e:
        out.append("%s %s" % (e.code().name, (e.details() or "").replace("\n", " ")))
ts = [threading.Thread(target=one) for _ in range(n)]
[t.start() for t in ts]
[t.join() for t in ts]
print("\n".join(out))
"""


class GuestDaemon(TempDaemon):
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="opjit-ibb-")
        os.chmod(self.dir, 0o755)  # nobody reaches the socket
        self.spawn('socket_mode = "0666"\n' +
                   principal_toml("alice", "user", ["alice"], "tok-alice-0123456789"),
                   dir=self.dir)


def rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def send_as_nobody(d, size, n=1):
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        "/usr/bin/python3", "-c", SENDER, d.unix_address, str(size), str(n)],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    return [line.split(" ", 1) for line in r.stdout.splitlines()]


@pytest.fixture(scope="module")
def d():
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as nobody")
    daemon = GuestDaemon()
    yield daemon
    daemon.close()


def test_an_unmapped_uid_is_told_why_with_a_small_message(d):
    [(code, msg)] = send_as_nobody(d, 1000)
    assert code == "UNAUTHENTICATED", msg
    assert "uid 65534 is not mapped to a principal" in msg
    assert d.dir not in msg


def test_a_big_message_from_an_unmapped_uid_is_refused_undecoded(d):
    pid = d.proc.pid
    hwm0, rss0 = vm_hwm_kb(pid), rss_kb(pid)
    results = send_as_nobody(d, BIG, n=int(os.environ.get("OPJIT_IBB_N", "1")))
    hwm1, rss1 = vm_hwm_kb(pid), rss_kb(pid)
    print("VmHWM %d -> %d KiB, RSS %d -> %d KiB" % (hwm0, hwm1, rss0, rss1), results)
    for code, msg in results:
        assert code in ("RESOURCE_EXHAUSTED", "UNAUTHENTICATED"), msg
        assert d.dir not in msg
    # Before: +700 MB for one message (the bytes, then the decoded string).
    assert hwm1 - hwm0 < 200 << 10, (hwm0, hwm1)
    assert rss1 - rss0 < 100 << 10, (rss0, rss1)


def test_the_daemons_own_uid_still_sends_big_messages(d):
    """Above the guest limit, on the same socket: the daemon's uid is admin."""
    stub = registry_pb2_grpc.RegistryStub(grpc.insecure_channel(
        d.unix_address, options=[("grpc.max_send_message_length", -1)]))
    req = registry_pb2.RegisterOpRequest(op=op_pb2.OpDef(namespace="shared", name="big",
                                                         doc="x" * (2 << 20)))
    with pytest.raises(grpc.RpcError) as e:
        stub.RegisterOp(req, timeout=60)
    # Decoded and judged by the handler (an op with no implementation), not
    # refused for its size.
    assert e.value.code() != grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
