"""Access control, end to end: a real opjitd with principals, tokens, TLS and
quotas, driven by the real Python client and raw gRPC stubs.

Principals (see PRINCIPALS below): alice (user of "alice"), bob (user of
"bob"), carol (reader of "alice"), root-admin (admin), and "nobody" (uid
65534, a user of "shared", identified by SO_PEERCRED on the unix socket).
TCP is TLS with a CA made here by openssl; client certificates are optional
on one daemon and required on another.
"""

import os
import subprocess
import tempfile

import grpc
import numpy as np
import pytest

import opjit
from opjit.v1 import (compile_pb2, compile_pb2_grpc, error_pb2, exec_pb2, exec_pb2_grpc,
                      memory_pb2, memory_pb2_grpc, op_pb2, registry_pb2, registry_pb2_grpc)

from conftest import TempDaemon, principal_toml, unary_kernel, unary_spec

TOKENS = {"alice": "tok-alice-0123456789", "bob": "tok-bob-0123456789",
          "carol": "tok-carol-0123456789", "admin": "tok-admin-0123456789"}


def spec(name, body, ns, doc=""):
    return unary_spec(name, unary_kernel(body), namespace=ns, doc=doc)


def principals_toml():
    return "\n".join([
        principal_toml("alice", "user", ["alice"], TOKENS["alice"]),
        principal_toml("bob", "user", ["bob"], TOKENS["bob"]),
        principal_toml("carol", "reader", ["alice"], TOKENS["carol"]),
        principal_toml("root-admin", "admin", token=TOKENS["admin"]),
        principal_toml("nobody", "user", ["shared"], uids=[65534]),
    ])


def make_pki(d):
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate."""
    def run(*args):
        subprocess.run(["openssl"] + list(args), check=True, capture_output=True, cwd=d)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=opjit-test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=%s" % (
            "localhost" if name == "server" else "alice"), "-keyout", name + ".key",
            "-out", name + ".csr")
        run("x509", "-req", "-in", name + ".csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", name + ".pem")
    return {k: os.path.join(d, k) for k in ("ca.pem", "server.pem", "server.key", "client.pem",
                                           "client.key")}


class AuthDaemon(TempDaemon):
    def __init__(self, extra="", require_client_cert=False):
        # World-traversable, so that a client running as nobody reaches the socket.
        self.dir = tempfile.mkdtemp(prefix="opjit-acl-")
        os.chmod(self.dir, 0o755)
        self.pki = make_pki(self.dir)
        self.spawn('socket_mode = "0666"\n' + principals_toml() +
                   '[tls]\ncert = "%s"\nkey = "%s"\nclient_ca = "%s"\nrequire_client_cert = %s\n'
                   % (self.pki["server.pem"], self.pki["server.key"], self.pki["ca.pem"],
                      "true" if require_client_cert else "false") + extra,
                   dir=self.dir, tcp=True)
        self.port = self.tcp_address.rsplit(":", 1)[1]

    def client(self, who=None, namespace="", cert=False, **kw):
        """A client over TLS with `who`'s token (None: no token)."""
        return opjit.Client("localhost:" + self.port, namespace=namespace, timeout=60,
                            token=TOKENS[who] if who else "", tls_ca=self.pki["ca.pem"],
                            tls_cert=self.pki["client.pem"] if cert else None,
                            tls_key=self.pki["client.key"] if cert else None, **kw)

    def channel(self, who=None):
        creds = grpc.ssl_channel_credentials(root_certificates=open(self.pki["ca.pem"], "rb").read())
        ch = grpc.secure_channel("localhost:" + self.port, creds)
        md = [("authorization", "Bearer " + TOKENS[who])] if who else []
        return ch, md




@pytest.fixture(scope="module")
def d():
    daemon = AuthDaemon()
    yield daemon
    assert daemon.proc.poll() is None, "opjitd died:\n" + daemon.read_log()
    daemon.close()


@pytest.fixture(scope="module")
def alice_op(d):
    with d.client("alice", "alice") as c:
        c.register(spec("scale", "* 2.0f", "alice"))
    return True


def reason_of(err):
    """The ErrorInfo reason of a raw grpc.RpcError."""
    for k, v in err.trailing_metadata() or ():
        if k == "grpc-status-details-bin":
            st = error_pb2.Status()
            st.ParseFromString(v)
            for a in st.details:
                if a.type_url.endswith("google.rpc.ErrorInfo"):
                    info = error_pb2.ErrorInfo()
                    info.ParseFromString(a.value)
                    return info.reason
    return ""


# ---- identity ------------------------------------------------------------------------------

def test_tcp_without_a_token_is_unauthenticated(d):
    with d.client(None, "alice") as c:
        with pytest.raises(opjit.Unauthenticated) as e:
            c.ops()
    assert e.value.reason == "UNAUTHENTICATED"


def test_a_wrong_token_is_unauthenticated(d):
    with opjit.Client("localhost:" + d.port, token="not-a-token", tls_ca=d.pki["ca.pem"],
                      timeout=30) as c:
        with pytest.raises(opjit.Unauthenticated):
            c.info()


def test_server_info_names_the_principal_and_hides_host_facts(d):
    with d.client("alice") as c:
        info = c.info()
    assert (info.principal, info.role, list(info.namespaces)) == ("alice", "user", ["alice"])
    assert info.authenticated
    assert info.state_dir == "" and info.pid == 0, "host facts are for admins only"
    with d.client("admin") as c:
        info = c.info()
    assert info.role == "admin" and info.state_dir == d.state


def test_unix_socket_owner_is_admin_without_a_token(d):
    # This test runs as root: the daemon's own uid (SO_PEERCRED).
    with opjit.Client(d.unix_address, timeout=30) as c:
        info = c.info()
    assert info.role == "admin" and info.principal == "local"


# ---- namespaces that hold -------------------------------------------------------------------

def test_user_registers_and_calls_in_its_namespace(d, alice_op):
    with d.client("alice", "alice", transport="inline") as c:
        np.testing.assert_allclose(c.op("scale")(np.ones(3, np.float32)), 2.0)


def test_another_namespace_is_not_found_for_every_rpc(d, alice_op):
    """Bob names Alice's namespace in every RPC that takes one: all NOT_FOUND."""
    ch, md = d.channel("bob")
    reg, mem = registry_pb2_grpc.RegistryStub(ch), memory_pb2_grpc.MemoryStub(ch)
    ex, comp = exec_pb2_grpc.ExecutorStub(ch), compile_pb2_grpc.CompilerStub(ch)
    op = op_pb2.OpDef()
    from google.protobuf import json_format
    json_format.ParseDict(spec("scale", "* -1.0f", "alice"), op)
    calls = {
        "RegisterOp": lambda: reg.RegisterOp(registry_pb2.RegisterOpRequest(op=op), metadata=md),
        "GetOp": lambda: reg.GetOp(registry_pb2.GetOpRequest(namespace="alice", name="scale"),
                                   metadata=md),
        "ListOps": lambda: reg.ListOps(registry_pb2.ListOpsRequest(namespace="alice"), metadata=md),
        "DeleteOp": lambda: reg.DeleteOp(registry_pb2.DeleteOpRequest(namespace="alice",
                                                                      name="scale"), metadata=md),
        "Compile": lambda: comp.Compile(compile_pb2.CompileRequest(
            namespace="alice", source="int x;"), metadata=md),
        "CreateRegion": lambda: mem.CreateRegion(memory_pb2.CreateRegionRequest(
            namespace="alice", name="r", byte_size=64, client_id="b"), metadata=md),
        "RegisterRegion": lambda: mem.RegisterRegion(memory_pb2.RegisterRegionRequest(
            namespace="alice", name="r", shm_key="/x", byte_size=64, client_id="b"), metadata=md),
        "UnregisterRegion": lambda: mem.UnregisterRegion(memory_pb2.UnregisterRegionRequest(
            namespace="alice", name="r"), metadata=md),
        "ListRegions": lambda: mem.ListRegions(memory_pb2.ListRegionsRequest(namespace="alice"),
                                               metadata=md),
        "RenewLease": lambda: mem.RenewLease(memory_pb2.RenewLeaseRequest(
            namespace="alice", client_id="a", lease_ms=1), metadata=md),
        "ReleaseClient": lambda: mem.ReleaseClient(memory_pb2.ReleaseClientRequest(
            namespace="alice", client_id="a"), metadata=md),
        "Forward": lambda: ex.Forward(exec_pb2.ForwardRequest(namespace="alice", op="scale"),
                                      metadata=md),
        "Backward": lambda: ex.Backward(exec_pb2.BackwardRequest(namespace="alice",
                                                                 context_id="c"), metadata=md),
        "ReleaseContext": lambda: ex.ReleaseContext(exec_pb2.ReleaseContextRequest(
            namespace="alice", context_id="c"), metadata=md),
        "GradCheck": lambda: ex.GradCheck(exec_pb2.GradCheckRequest(namespace="alice", op="scale"),
                                          metadata=md),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.NOT_FOUND, (name, e.value.details())
        assert reason_of(e.value) == "NAMESPACE_NOT_FOUND", name
        assert "bob" not in e.value.details() and d.state not in e.value.details(), name
    # Alice's op is intact.
    with d.client("alice", "alice", transport="inline") as c:
        np.testing.assert_allclose(c.op("scale")(np.ones(2, np.float32)), 2.0)


def test_listing_all_namespaces_shows_only_ones_own(d, alice_op):
    with d.client("bob", "bob") as c:
        c.register(spec("bobs", "* 3.0f", "bob"))
        names = {(o.op.namespace, o.op.name) for o in c.ops(namespace="")}
    assert ("bob", "bobs") in names
    assert not any(ns == "alice" for ns, _ in names)


def test_reader_describes_and_calls_but_cannot_write(d, alice_op):
    with d.client("carol", "alice", transport="inline") as c:
        assert c.describe("scale").version >= 1
        np.testing.assert_allclose(c.op("scale")(np.ones(2, np.float32)), 2.0)
        with pytest.raises(opjit.PermissionDenied) as e:
            c.register(spec("scale", "* -1.0f", "alice"))
        assert e.value.reason == "PERMISSION_DENIED"
        assert e.value.metadata == {"role": "reader", "action": "write"}
        with pytest.raises(opjit.PermissionDenied):
            c.delete("scale")
        with pytest.raises(opjit.PermissionDenied):
            c.compile("int x;", namespace="alice")


def test_cache_operations_are_admin_only(d):
    with d.client("alice", "alice") as c:
        with pytest.raises(opjit.PermissionDenied):
            c.cache_stats()
        ch, md = d.channel("alice")
        with pytest.raises(grpc.RpcError) as e:
            compile_pb2_grpc.CompilerStub(ch).ClearCache(compile_pb2.ClearCacheRequest(),
                                                         metadata=md)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with d.client("admin") as c:
        assert c.cache_stats().compiles >= 1


def test_regions_belong_to_their_principal(d):
    """Carol (reader of alice) cannot use, list or release Alice's region by name."""
    ch_a, md_a = d.channel("alice")
    ch_c, md_c = d.channel("carol")
    mem_a, mem_c = memory_pb2_grpc.MemoryStub(ch_a), memory_pb2_grpc.MemoryStub(ch_c)
    info = mem_a.CreateRegion(memory_pb2.CreateRegionRequest(
        namespace="alice", name="secret", byte_size=64, client_id="a1"), metadata=md_a)
    assert info.client_id == "a1"
    listed = mem_c.ListRegions(memory_pb2.ListRegionsRequest(namespace="alice"), metadata=md_c)
    assert not listed.regions, "carol sees alice's regions and their shm keys"
    with pytest.raises(grpc.RpcError) as e:
        mem_c.UnregisterRegion(memory_pb2.UnregisterRegionRequest(namespace="alice",
                                                                 name="secret"), metadata=md_c)
    assert reason_of(e.value) == "REGION_NOT_REGISTERED"
    assert mem_c.ReleaseClient(memory_pb2.ReleaseClientRequest(
        namespace="alice", client_id="a1"), metadata=md_c).released == 0
    ex_c = exec_pb2_grpc.ExecutorStub(ch_c)
    req = exec_pb2.ForwardRequest(namespace="alice", op="scale")
    t = req.inputs.add().tensors.add()
    t.dtype = "float32"
    t.shape.append(4)
    t.shm.region = "secret"
    with pytest.raises(grpc.RpcError) as e:
        ex_c.Forward(req, metadata=md_c)
    assert reason_of(e.value) == "REGION_NOT_REGISTERED", e.value.details()
    assert mem_a.ReleaseClient(memory_pb2.ReleaseClientRequest(
        namespace="alice", client_id="a1"), metadata=md_a).released == 1


def test_only_an_admin_creates_namespaces_up_to_the_cap(d):
    with d.client("admin") as c:
        c.register(spec("x", "* 1.0f", "team-new"))
    with d.client("alice", "team-other") as c:
        with pytest.raises(opjit.NotFound):
            c.register(spec("x", "* 1.0f", "team-other"))


def test_a_name_no_namespace_can_have_is_refused_before_it_is_recorded(d):
    """A 100,000-character namespace (issue 26): refused with a short message,
    before access control records it (see the namespaces quota below)."""
    huge = "n" * 100_000
    with d.client("admin") as c:
        with pytest.raises(opjit.InvalidArgument) as e:
            c.register(spec("x", "* 1.0f", huge))
        assert e.value.reason == "INVALID_SPEC" and len(str(e.value)) < 2048
    with d.client("admin", huge) as other:
        with pytest.raises(opjit.NotFound) as e:
            other.op("x")(np.ones(2, np.float32))
        assert e.value.reason == "NAMESPACE_NOT_FOUND" and len(str(e.value)) < 2048
        assert "[a-z0-9_-]{1,64}" in str(e.value)


# ---- the unix socket: SO_PEERCRED and shm ownership ----------------------------------------

NOBODY = ("import sys, grpc, opjit\n"
          "from opjit.v1 import memory_pb2, memory_pb2_grpc\n"
          "c = opjit.Client(%r, namespace='shared', timeout=30)\n"
          "print(c.info().principal)\n"
          "m = memory_pb2_grpc.MemoryStub(grpc.insecure_channel(%r))\n"
          "for key in sys.argv[1:]:\n"
          "    try:\n"
          "        m.RegisterRegion(memory_pb2.RegisterRegionRequest(namespace='shared', name=key[1:],"
          " shm_key=key, byte_size=4096, client_id='n'), timeout=10); print('OK')\n"
          "    except grpc.RpcError as e: print(e.code().name)\n")


def test_register_region_checks_the_objects_owner(d):
    """A client running as nobody may register its own shm object, not root's."""
    root_key = "/opjit-acl-root-%d" % os.getpid()
    nobody_key = "/opjit-acl-nobody-%d" % os.getpid()
    fd = os.open("/dev/shm" + root_key, os.O_CREAT | os.O_RDWR, 0o666)  # even world-writable
    os.ftruncate(fd, 4096)
    os.write(fd, b"ROOT-SECRET")
    os.close(fd)
    fd = os.open("/dev/shm" + nobody_key, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    os.chown("/dev/shm" + nobody_key, 65534, 65534)
    try:
        env = dict(os.environ)
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            "/usr/bin/python3", "-c", NOBODY % (d.unix_address, d.unix_address),
                            root_key, nobody_key],
                           capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["nobody", "PERMISSION_DENIED", "OK"], r.stdout + r.stderr
    finally:
        os.unlink("/dev/shm" + root_key)
        os.unlink("/dev/shm" + nobody_key)


def test_register_region_needs_the_unix_socket_for_non_admins(d):
    ch, md = d.channel("alice")
    with pytest.raises(grpc.RpcError) as e:
        memory_pb2_grpc.MemoryStub(ch).RegisterRegion(memory_pb2.RegisterRegionRequest(
            namespace="alice", name="r", shm_key="/whatever", byte_size=64, client_id="a"),
            metadata=md)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


# ---- TLS --------------------------------------------------------------------------------------

def test_tls_with_and_without_a_client_certificate(d):
    with d.client("alice", cert=True) as c:
        assert c.info().principal == "alice"
    with d.client("alice", cert=False) as c:
        assert c.info().principal == "alice"
    # Plaintext against the TLS port fails.
    with opjit.Client(d.tcp_address, token=TOKENS["alice"], timeout=5) as c:
        with pytest.raises(opjit.Unavailable):
            c.info()


def test_a_required_client_certificate_is_enforced():
    strict = AuthDaemon(require_client_cert=True)
    try:
        with strict.client("alice", cert=True) as c:
            assert c.info().principal == "alice"
        with strict.client("alice", cert=False, ) as c:
            with pytest.raises(opjit.Unavailable):
                c.info()
    finally:
        strict.close()


# ---- quotas --------------------------------------------------------------------------------------

def test_quotas_name_the_quota_and_its_value():
    q = AuthDaemon('[quota]\nops = 2\nversions_per_op = 2\ncalls_per_second = 5\n'
                   'concurrent_compiles = 1\nnamespaces = 8\n[shm]\nquota_mb = 1\n'
                   '[autograd]\ncontext_mb = 1\n')
    try:
        with q.client("alice", "alice", transport="inline") as c:
            c.register(spec("a", "* 1.0f", "alice"))
            c.register(spec("a", "* 2.0f", "alice"))
            with pytest.raises(opjit.ResourceExhausted) as e:
                c.register(spec("a", "* 3.0f", "alice"))
            assert (e.value.reason, e.value.metadata["quota"], e.value.metadata["limit"]) == \
                ("QUOTA_EXCEEDED", "versions", "2")
            c.register(spec("b", "* 1.0f", "alice"))
            with pytest.raises(opjit.ResourceExhausted) as e:
                c.register(spec("c", "* 1.0f", "alice"))
            assert e.value.metadata["quota"] == "ops"
            f = c.op("b")
            with pytest.raises(opjit.ResourceExhausted) as e:
                for _ in range(50):
                    f(np.ones(2, np.float32))
            assert e.value.metadata["quota"] == "calls_per_second"
            assert "calls_per_second" in e.value.message and "5" in e.value.message
        ch, md = q.channel("alice")
        with pytest.raises(grpc.RpcError) as e:
            memory_pb2_grpc.MemoryStub(ch).CreateRegion(memory_pb2.CreateRegionRequest(
                namespace="alice", name="big", byte_size=2 << 20, client_id="a"), metadata=md)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert reason_of(e.value) == "QUOTA_EXCEEDED" and "shm_bytes" in e.value.details()
        # Namespaces: the admin may create up to the cap (8, with default, alice, bob,
        # shared and the admin's ones).
        with q.client("admin") as c:
            # Names no namespace can have (issue 26) are refused and take no
            # room: ten of them, then a real namespace still fits.
            for i in range(10):
                with pytest.raises(opjit.InvalidArgument):
                    c.register(spec("x", "* 1.0f", "%d" % i + "N" * 100_000))
            c.register(spec("x", "* 1.0f", "extra"))
            with pytest.raises(opjit.ResourceExhausted) as e:
                for i in range(10):
                    c.register(spec("x", "* 1.0f", "extra%d" % i))
            assert e.value.metadata["quota"] == "namespaces"
    finally:
        q.close()


def test_compile_quotas():
    q = AuthDaemon('[quota]\ncompile_seconds_per_minute = 0.001\n')
    try:
        with q.client("bob", "bob") as c:
            c.compile("int f() { return 1; }", namespace="bob")  # starts under the budget
            with pytest.raises(opjit.ResourceExhausted) as e:
                c.compile("int g() { return 2; }", namespace="bob")
            assert e.value.metadata["quota"] == "compile_seconds_per_minute"
        with q.client("alice", "alice") as c:  # another namespace is not charged
            c.compile("int h() { return 3; }", namespace="alice")
    finally:
        q.close()
