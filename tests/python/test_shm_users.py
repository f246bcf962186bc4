"""Shared memory between a daemon and a client of ANOTHER user, as under the
systemd unit (opjitd runs as its own user, clients as theirs).

opjitd runs here as nobody (setpriv), the client as uid 65000, and a third
uid 65001 plays someone else on the host. The daemon's regions and fast
channel rings are owned by nobody with mode 0600 plus a POSIX ACL entry for
exactly the calling client's uid (SO_PEERCRED), so:

* the client maps them (shm tensors, zero copies, and the fast path);
* the third uid cannot open them at all.

Runs against two access setups: the embedded default (no [[principal]]:
every caller of the unix socket is the local admin, as with the stock
systemd config) and a [[principal]] mapping uid 65000 to a "user" of one
namespace. Needs root (to switch uids) and a /dev/shm with ACL support.
"""

import json
import os
import pwd
import shutil
import signal
import struct
import subprocess
import tempfile
import time

import pytest

from conftest import EXAMPLES, opjitd_binary

CLIENT_UID = 65000
STRANGER_UID = 65001
NOBODY = pwd.getpwnam("nobody")
ACL_XATTR = "system.posix_acl_access"


def _acl_entries(raw):
    version, = struct.unpack_from("<I", raw)
    assert version == 2 and (len(raw) - 4) % 8 == 0, raw
    return [struct.unpack_from("<HHI", raw, at) for at in range(4, len(raw), 8)]


def _shm_acl_supported():
    path = "/dev/shm/opjit-acl-probe-%d" % os.getpid()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.setxattr(fd, ACL_XATTR, struct.pack("<IHHIHHIHHIHHIHHI", 2, 1, 6, 0xffffffff,
                                               2, 6, CLIENT_UID, 4, 0, 0xffffffff,
                                               0x10, 6, 0xffffffff, 0x20, 0, 0xffffffff))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="switching uids needs root"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is missing"),
]


def as_uid(uid, gid=None):
    return ["setpriv", "--reuid=%d" % uid, "--regid=%d" % (uid if gid is None else gid),
            "--clear-groups"]


class UserDaemon:
    """opjitd running as nobody, on a world-usable unix socket in a temp dir."""

    def __init__(self, principals):
        self.dir = tempfile.mkdtemp(prefix="opjit-users-")
        os.chmod(self.dir, 0o755)
        os.chown(self.dir, NOBODY.pw_uid, NOBODY.pw_gid)
        self.state = os.path.join(self.dir, "state")
        self.socket = os.path.join(self.dir, "s.sock")
        self.address = "unix:" + self.socket
        cfg = os.path.join(self.dir, "c.toml")
        with open(cfg, "w") as f:
            f.write('socket_mode = "0666"\n')
            if principals:
                f.write('[[principal]]\nname = "u65000"\nrole = "user"\nnamespaces = ["shm"]\n'
                        'uids = [%d]\n' % CLIENT_UID)
        self.namespace = "shm" if principals else ""
        self.log_path = os.path.join(self.dir, "log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            as_uid(NOBODY.pw_uid, NOBODY.pw_gid) +
            [opjitd_binary(), "--state-dir", self.state, "--config", cfg, "--listen", self.address],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(self.state, "endpoints")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("opjitd (as nobody) did not start:\n" + self.read_log())
            time.sleep(0.05)

    def read_log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def close(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module", params=["embedded_default", "principal"])
def user_daemon(request):
    if not _shm_acl_supported():
        pytest.skip("/dev/shm takes no POSIX ACLs: a client of another uid cannot share memory")
    d = UserDaemon(principals=request.param == "principal")
    yield d
    d.close()


# Runs as CLIENT_UID: leaky_relu on shm tensors (and, with fast on, over the
# fast channel), then reports what it saw and keeps its regions alive until
# the parent has probed them (one line on stdin).
CLIENT = r"""
import json, sys
import numpy as np
import opjit
from opjit.v1 import memory_pb2

addr, ns, spec, fast = sys.argv[1:5]
out = {}
with opjit.Client(addr, namespace=ns, timeout=120, transport="shm", fast=fast) as c:
    info = c.info()
    out["principal"], out["role"] = info.principal, info.role
    c.register(spec)
    op = c.op("leaky_relu")
    x = c.asarray(np.linspace(-4.0, 4.0, 4099, dtype=np.float32))  # a tensor in a daemon region
    y = op(x, alpha=0.25)
    want = np.where(x > 0, x, np.float32(0.25) * x)
    out["max_err"] = float(np.max(np.abs(np.asarray(y) - want)))
    e = c.empty((3, 5), np.float32)
    e[...] = -8.0
    out["empty"] = np.asarray(op(e, alpha=0.5)).ravel().tolist()
    for _ in range(20):
        y = op(x, alpha=0.25)
    out["max_err_repeat"] = float(np.max(np.abs(np.asarray(y) - want)))
    out["transport"], out["fallback"] = c.transport, c.shm_fallback_reason
    out["fast_active"] = c.fast_path_active()
    out["counts"] = c.call_counts()
    out["shm"] = c.shm_stats()
    regions = c._memory.ListRegions(memory_pb2.ListRegionsRequest(namespace=ns), timeout=30)
    out["keys"] = sorted(r.shm_key for r in regions.regions if r.client_id == c.client_id)
    print(json.dumps(out), flush=True)
    sys.stdin.readline()
"""

# Runs as STRANGER_UID: tries to open each key; prints the errno name per key.
STRANGER = r"""
import errno, os, sys
for key in sys.argv[1:]:
    for flags in (os.O_RDWR, os.O_RDONLY):
        try:
            os.close(os.open("/dev/shm/" + key.lstrip("/"), flags))
            print("OPENED")
        except OSError as e:
            print(errno.errorcode.get(e.errno, str(e.errno)))
"""


def client_env():
    env = {k: v for k, v in os.environ.items() if k not in ("OPJIT_FAST", "OPJIT_SERVER")}
    env["HOME"] = "/nonexistent"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@pytest.mark.parametrize("fast", ["on", "off"])
def test_client_of_another_uid_uses_the_daemons_shm(user_daemon, fast):
    spec = os.path.join(EXAMPLES, "leaky_relu.json")
    proc = subprocess.Popen(
        as_uid(CLIENT_UID) + ["/usr/bin/python3", "-c", CLIENT, user_daemon.address, user_daemon.namespace,
                              spec, fast],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=client_env())
    try:
        line = proc.stdout.readline()
        if not line:
            proc.stdin.close()
            proc.wait(60)
            pytest.fail("client (uid %d) failed:\n%s\n--- daemon log:\n%s"
                        % (CLIENT_UID, proc.stderr.read(), user_daemon.read_log()))
        out = json.loads(line)

        # The embedded default admits every local caller as the local admin;
        # with a [[principal]] for the uid, the caller is that user.
        if user_daemon.namespace:
            assert (out["principal"], out["role"]) == ("u65000", "user")
        else:
            assert (out["principal"], out["role"]) == ("local", "admin")

        # Shared memory really was used: no fallback to inline tensors.
        assert out["transport"] == "shm" and out["fallback"] is None, out
        assert out["shm"]["regions"] >= 1, out
        assert out["max_err"] == 0.0 and out["max_err_repeat"] == 0.0, out
        assert out["empty"] == [-4.0] * 15, out
        if fast == "on":
            assert out["fast_active"] is True, out
            assert out["counts"].get("fast", 0) >= 20, out
        else:
            assert out["fast_active"] is False and out["counts"].get("fast", 0) == 0, out

        # Every region of the client (with fast on: the channel's ring too) is
        # the daemon's object, 0600 + an ACL entry for exactly the client.
        keys = out["keys"]
        assert len(keys) >= (2 if fast == "on" else 1), out
        for key in keys:
            path = "/dev/shm/" + key.lstrip("/")
            st = os.stat(path)
            assert st.st_uid == NOBODY.pw_uid, (key, st)
            assert st.st_mode & 0o777 == 0o660, oct(st.st_mode)  # group bits = the ACL mask
            assert _acl_entries(os.getxattr(path, ACL_XATTR)) == [
                (0x01, 6, 0xffffffff), (0x02, 6, CLIENT_UID), (0x04, 0, 0xffffffff),
                (0x10, 6, 0xffffffff), (0x20, 0, 0xffffffff)], key

        # A third uid on the host cannot open any of them, read-only included.
        r = subprocess.run(as_uid(STRANGER_UID) + ["/usr/bin/python3", "-c", STRANGER] + keys,
                           capture_output=True, text=True, timeout=60, env=client_env())
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["EACCES"] * (2 * len(keys)), r.stdout
    finally:
        if proc.poll() is None:
            try:
                proc.stdin.write("\n")
                proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, proc.stderr.read()


def test_daemon_regions_of_a_same_uid_client_carry_no_acl(user_daemon):
    """A client running as the daemon's own user needs no grant: plain 0600."""
    spec = os.path.join(EXAMPLES, "leaky_relu.json")
    proc = subprocess.Popen(
        as_uid(NOBODY.pw_uid, NOBODY.pw_gid) + ["/usr/bin/python3", "-c", CLIENT, user_daemon.address,
                                                user_daemon.namespace, spec, "off"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=client_env())
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.poll() is not None else "no output"
        out = json.loads(line)
        assert out["transport"] == "shm" and out["max_err"] == 0.0, out
        for key in out["keys"]:
            path = "/dev/shm/" + key.lstrip("/")
            assert os.stat(path).st_mode & 0o777 == 0o600
            with pytest.raises(OSError):
                os.getxattr(path, ACL_XATTR)
    finally:
        if proc.poll() is None:
            proc.stdin.write("\n")
            proc.stdin.close()
            proc.wait(60)


# Runs as CLIENT_UID: creates two shm objects of its own, one granting the
# daemon's uid (ServerInfo.daemon_uid) by ACL as ShmMapping::Create(key, n,
# daemon_uid) does in the C++ client, one plain 0600, and registers both.
REGISTER = r"""
import os, struct, sys, grpc, opjit
from opjit.v1 import memory_pb2, memory_pb2_grpc
addr, ns = sys.argv[1:3]
with opjit.Client(addr, namespace=ns, timeout=30) as c:
    duid = c.info().daemon_uid
print(duid)
m = memory_pb2_grpc.MemoryStub(grpc.insecure_channel(addr))
for grant in (True, False):
    key = "/opjit-users-reg-%d-%d" % (os.getpid(), grant)
    fd = os.open("/dev/shm" + key, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 8192)
    if grant:
        os.setxattr(fd, "system.posix_acl_access", struct.pack(
            "<IHHIHHIHHIHHIHHI", 2, 1, 6, 0xffffffff, 2, 6, duid, 4, 0, 0xffffffff,
            0x10, 6, 0xffffffff, 0x20, 0, 0xffffffff))
    os.close(fd)
    try:
        m.RegisterRegion(memory_pb2.RegisterRegionRequest(
            namespace=ns, name=key[1:], shm_key=key, byte_size=8192, client_id="reg"), timeout=10)
        print("OK")
    except grpc.RpcError as e:
        print(e.code().name)
    finally:
        os.unlink("/dev/shm" + key)
"""


def test_register_region_of_another_uid_needs_the_daemon_granted(user_daemon):
    r = subprocess.run(as_uid(CLIENT_UID) + ["/usr/bin/python3", "-c", REGISTER,
                                             user_daemon.address, user_daemon.namespace],
                       capture_output=True, text=True, timeout=60, env=client_env())
    assert r.returncode == 0, r.stderr
    # The daemon (nobody) maps the object that grants it; the plain 0600 one it
    # cannot open, and says so.
    assert r.stdout.split() == [str(NOBODY.pw_uid), "OK", "PERMISSION_DENIED"], r.stdout + r.stderr
