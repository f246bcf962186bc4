"""The opjit client: registry, compiler, tensors and calls over gRPC."""

import atexit
import ipaddress
import json
import os
import posixpath
import socket
import time
import uuid
import warnings
import weakref

import grpc
import numpy as np
from google.protobuf import json_format

from opjit._proto import (compile_pb2, compile_pb2_grpc, evaluate_pb2_grpc, exec_pb2_grpc,
                          memory_pb2_grpc, op_pb2, registry_pb2, registry_pb2_grpc, server_pb2,
                          server_pb2_grpc)
from opjit import _routing
from opjit._shm import ShmUnavailable
from opjit._transport import Session, ShmUnavailableError, Transport
from opjit.errors import InvalidArgument, NotFound, Unavailable, error_from_rpc
from opjit.op import Op, split_name

__all__ = ["Client", "ShmUnavailableError", "default_address", "normalize_address",
           "is_local_address", "load_spec", "OpjitWarning"]

# The client's own message limits, either way: the server's max_message_mb
# decides what it takes; this only has to be at least that (gRPC's hard
# limit is 2 GiB).
_MAX_MESSAGE = 1 << 30


from opjit.errors import OpjitWarning, StopGradientGradWarning  # noqa: E402,F401  (re-exported)


def default_address():
    """$OPJIT_SERVER, else the daemon's default socket (as opjitd and the CLI pick it).

    $OPJIT_SERVER may name several servers, comma-separated; each is normalized.
    """
    addr = os.environ.get("OPJIT_SERVER")
    if addr:
        return ",".join(normalize_address(a) for a in _routing.split_addresses(addr))
    state = os.environ.get("OPJIT_STATE_DIR") or os.path.join(os.path.expanduser("~"), ".opjit")
    own = os.path.join(state, "opjitd.sock")
    # The system daemon (deploy/systemd) when the user runs none of their own.
    if not os.path.exists(own) and not os.environ.get("OPJIT_STATE_DIR") and \
            os.path.exists(SYSTEM_SOCKET):
        return "unix:" + SYSTEM_SOCKET
    return "unix:" + own


# Where the packaged systemd unit's opjitd listens.
SYSTEM_SOCKET = "/run/opjit/opjitd.sock"


def normalize_address(addr):
    """Bare paths become unix: addresses; host:port and unix: stay as they are."""
    addr = str(addr)
    if addr.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return addr
    if addr.startswith(("/", "./", "../", "~")) or addr.endswith(".sock"):
        return "unix:" + os.path.expanduser(addr)
    return addr


def is_local_address(addr):
    """True when the server can share this host's /dev/shm: a unix socket or loopback TCP."""
    if addr.startswith(("unix:", "unix-abstract:")):
        return True
    host = addr
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if host.startswith(prefix):
            host = host[len(prefix):]
    if host.startswith("["):
        host = host[1:host.find("]")]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _AuthInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds "authorization: Bearer <token>" to every call (also over plaintext
    unix sockets, where gRPC's call credentials are not allowed)."""

    def __init__(self, token):
        self._md = ("authorization", "Bearer " + token)

    def _details(self, d):
        md = list(d.metadata or ()) + [self._md]
        return _CallDetails(d.method, d.timeout, md, d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def _read(path):
    if not path:
        return None
    with open(os.path.expanduser(path), "rb") as f:
        return f.read()


# How often a progress callback hears from a call that is still waiting.
PROGRESS_INTERVAL_S = 1.0


def _call(fn, request, timeout=None, progress=None, started=None):
    """fn(request); with `progress`, through fn.future(), calling
    progress(elapsed_seconds) about once a second while the call waits and
    once when it ends (`started`: the time.monotonic() elapsed counts from)."""
    try:
        if progress is None:
            return fn(request, timeout=timeout)
        return _call_with_progress(fn, request, timeout, progress,
                                   time.monotonic() if started is None else started)
    except grpc.RpcError as e:
        raise error_from_rpc(e) from None


def _call_with_progress(fn, request, timeout, progress, started):
    if not callable(progress):
        raise InvalidArgument("progress must be callable (it is called with the elapsed "
                              "seconds)")
    future = fn.future(request, timeout=timeout)
    try:
        while True:
            # Wake on the next whole interval since `started`: 1 s, 2 s, ...
            elapsed = time.monotonic() - started
            wait = PROGRESS_INTERVAL_S - (elapsed % PROGRESS_INTERVAL_S)
            try:
                result = future.result(timeout=wait)
                break
            except grpc.FutureTimeoutError:
                progress(time.monotonic() - started)
    except grpc.RpcError:
        progress(time.monotonic() - started)
        raise
    except BaseException:
        # The callback raised (or KeyboardInterrupt): the call is given up.
        future.cancel()
        raise
    progress(time.monotonic() - started)
    return result


def load_spec(spec, base_dir=None, name=None):
    """An opjit.v1.OpDef from a dict, a JSON file path, JSON text, a builder or an OpDef,
    or a list of those (MindSpore's ``reg_info`` list), merged into one op
    (opjit.regop.merge_op_defs).

    ``source_file`` of each implementation is read (relative to ``base_dir``,
    else the spec file's directory, else the current directory) into
    ``source``, as the CLI does. ``name`` ("op" or "ns/op") names the op; an
    op without a name takes its implementation's entry
    (opjit.regop.resolve_name).
    """
    from opjit.regop import merge_op_defs, resolve_name
    if isinstance(spec, (list, tuple)):
        op = merge_op_defs([_load_one(s, base_dir) for s in spec])
    else:
        op = _load_one(spec, base_dir)
    return resolve_name(op, name)


def _load_one(spec, base_dir=None):
    if isinstance(spec, op_pb2.OpDef):
        op = op_pb2.OpDef()
        op.CopyFrom(spec)
    else:
        if hasattr(spec, "get_op_info"):
            spec = spec.get_op_info()
        if isinstance(spec, (str, os.PathLike)) and not str(spec).lstrip().startswith("{"):
            path = os.fspath(spec)
            try:
                with open(path, "r", encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise NotFound("cannot read spec %s: %s" % (path, e.strerror)) from None
            if base_dir is None:
                base_dir = os.path.dirname(os.path.abspath(path))
            spec = text
        if isinstance(spec, (str, bytes)):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise InvalidArgument("spec is not valid JSON: %s" % e) from None
        if not isinstance(spec, dict):
            raise InvalidArgument("a spec is a dict, a JSON file path, a CustomRegOp or an OpDef; "
                                  "got %s" % type(spec).__name__)
        spec = _expand_file_shorthand(spec)
        op = op_pb2.OpDef()
        try:
            json_format.ParseDict(spec, op, ignore_unknown_fields=False)
        except json_format.ParseError as e:
            raise InvalidArgument("spec is not a valid opjit.v1.OpDef: %s" % e) from None
    base = base_dir if base_dir is not None else os.getcwd()
    for i, impl in enumerate(op.implementations):
        _read_extra_files(impl, base, "implementations[%d]" % i)
        # With source given, source_file only names it (for diagnostics).
        if not impl.source_file or impl.source:
            continue
        path = impl.source_file
        if not os.path.isabs(path):
            path = os.path.join(base, path)
        try:
            with open(path, "r", encoding="utf-8") as f:
                impl.source = f.read()
        except OSError:
            raise NotFound("implementations[%d].source_file: cannot read %s" % (i, path)) from None
        # The base name stays: the server's diagnostics call the source by it.
        impl.source_file = os.path.basename(path)
    return op


def _expand_file_shorthand(spec):
    """The spec dict with ``"files": ["helper.h"]`` made ``[{"path": "helper.h"}]``."""
    impls = spec.get("implementations")
    if not isinstance(impls, list) or not any(
            isinstance(i, dict) and isinstance(i.get("files"), list) and
            any(isinstance(f, (str, os.PathLike)) for f in i["files"]) for i in impls):
        return spec
    spec = dict(spec)
    spec["implementations"] = [
        dict(i, files=[{"path": os.fspath(f)} if isinstance(f, (str, os.PathLike)) else f
                       for f in i["files"]])
        if isinstance(i, dict) and isinstance(i.get("files"), list) else i
        for i in impls]
    return spec


def default_file_name(path):
    """The name an extra file read from `path` goes by: the path as written, made
    plain ("./a//b.h" -> "a/b.h"), or its base name when it is absolute or climbs
    out of the spec's directory with "..". Kernels include it by that name."""
    p = os.fspath(path).replace(os.sep, "/")
    norm = posixpath.normpath(p)
    if posixpath.isabs(norm) or norm == ".." or norm.startswith("../"):
        return posixpath.basename(norm)
    return norm


def _read_extra_files(impl, base, field):
    """Reads each extra file given by ``path`` (relative to `base`) into ``content``;
    the server never opens a path."""
    for k, f in enumerate(impl.files):
        if not f.path:
            continue
        if not f.name:
            f.name = default_file_name(f.path)
        if not f.content:
            path = f.path if os.path.isabs(f.path) else os.path.join(base, f.path)
            try:
                with open(path, "r", encoding="utf-8") as fh:
                    f.content = fh.read()
            except OSError:
                raise NotFound("%s.files[%d].path: cannot read %s" % (field, k, path)) from None
        f.ClearField("path")


class Client:
    """A connection to opjitd.

    Args:
      addr: "unix:/path.sock", a bare socket path, or "host:port"; or several
        of them, as a list or a comma-separated string (see `routing`).
        Default: $OPJIT_SERVER (which may be such a list), else
        unix:$OPJIT_STATE_DIR/opjitd.sock, else unix:~/.opjit/opjitd.sock.
      namespace: the namespace for ops and regions ("" = the server's "default").
      transport: "auto" (shared memory when the server is on this host and a
        region can be created and mapped, else inline bytes), "shm" (shared
        memory or an error), or "inline".
      timeout: seconds per call (None: no deadline).
      copy_outputs: return outputs as private copies instead of views over the
        shared memory (views are the default; they are zero-copy and keep their
        block allocated while alive).
      region_bytes: size of each shared-memory region (grown when a call needs more).
      lease_ms: lease asked for the regions; a daemon thread renews it.
      token: bearer token sent as "authorization: Bearer <token>" on every
        call. Default: $OPJIT_TOKEN (none when unset). A unix-socket caller
        needs none where the operator mapped its uid to a principal.
      tls_ca: PEM file of the CA that signed the server's certificate: TCP
        goes over TLS. Default: $OPJIT_TLS_CA. tls_cert / tls_key: a client
        certificate, for servers that ask for one.
      tls_server_name: the name to check the server's certificate against
        (default: the host of `addr`).
      fast: the same-host fast path for op calls: "auto" (use it when the
        server is on this host, tensors travel in shared memory and the server
        offers a channel; fall back to gRPC silently otherwise), "on" (as
        auto, but a server on this host that refuses the channel is an
        error: for tests), or "off" (every call over gRPC). Default:
        $OPJIT_FAST ("1"/"on", "0"/"off", "auto"), else "auto".
      spin_us: how long a fast call spins on its reply before it sleeps on a
        futex (default: the server's advice, OpenChannelResponse.spin_us).
      routing: with several addresses, "failover" (calls go to the first
        daemon that answers a health check, and move on to the next when it
        stops answering, for calls safe to repeat) or "affinity" (op calls go
        to the daemon that ranks first for their namespace and op name by
        rendezvous hashing, so a kernel stays warm on one daemon; failover
        within that ranking). See opjit._routing. With several addresses,
        shared memory and the fast path are used only on unix-socket
        addresses; TCP addresses get inline tensors. Ignored with one address.
      health_timeout: seconds a health check may take before its daemon counts
        as down (several addresses only).

    Thread-safe; one Client per process is enough. Use as a context manager or
    call close(); at interpreter exit open clients are closed.
    """

    def __init__(self, addr=None, namespace="", transport="auto", timeout=None,
                 copy_outputs=False, region_bytes=16 << 20, lease_ms=60000, token=None,
                 tls_ca=None, tls_cert=None, tls_key=None, tls_server_name=None, fast=None,
                 spin_us=None, routing="failover", health_timeout=1.0):
        if transport not in ("auto", "shm", "inline"):
            raise InvalidArgument('transport must be "auto", "shm" or "inline"')
        if routing not in _routing.ROUTING_MODES:
            raise InvalidArgument('routing must be "failover" or "affinity"; got %r' % (routing,))
        addresses = [normalize_address(a)
                     for a in _routing.split_addresses(addr if addr else default_address())]
        if not addresses:
            raise InvalidArgument("no server address given")
        self.addresses = addresses
        self.routing = routing
        self.namespace = namespace or ""
        self.client_id = "py-%s-%d-%s" % (
            "".join(c if c.isalnum() else "-" for c in socket.gethostname())[:32], os.getpid(),
            uuid.uuid4().hex[:12])
        tls_ca = tls_ca if tls_ca is not None else os.environ.get("OPJIT_TLS_CA")
        token = token if token is not None else os.environ.get("OPJIT_TOKEN")
        several = len(addresses) > 1
        endpoints = []
        for address in addresses:
            options = [
                ("grpc.max_send_message_length", _MAX_MESSAGE),
                ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ]
            if tls_ca and not address.startswith(("unix:", "unix-abstract:")):
                creds = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca),
                                                     private_key=_read(tls_key),
                                                     certificate_chain=_read(tls_cert))
                if tls_server_name:
                    options.append(("grpc.ssl_target_name_override", tls_server_name))
                raw = grpc.secure_channel(address, creds, options=options)
            else:
                raw = grpc.insecure_channel(address, options=options)
            channel = grpc.intercept_channel(raw, _AuthInterceptor(token)) if token else raw
            stubs = {
                "server": server_pb2_grpc.ServerStub(channel),
                "registry": registry_pb2_grpc.RegistryStub(channel),
                "compiler": compile_pb2_grpc.CompilerStub(channel),
                "memory": memory_pb2_grpc.MemoryStub(channel),
                "executor": exec_pb2_grpc.ExecutorStub(channel),
                "evaluator": evaluate_pb2_grpc.EvaluatorStub(channel),
            }
            # One address: shared memory wherever this host's /dev/shm is the
            # server's (loopback TCP too). Several: only on unix sockets, so
            # a region never has to follow a call to another daemon.
            local = (address.startswith(("unix:", "unix-abstract:")) if several
                     else is_local_address(address))
            transport_ = Transport(
                stubs["executor"], stubs["memory"], self.client_id, transport=transport,
                local=local, fast=fast, spin_us=spin_us, lease_ms=lease_ms,
                region_bytes=region_bytes, timeout=timeout, copy_outputs=copy_outputs,
                raw_forward=channel.unary_unary("/opjit.v1.Executor/Forward"),
                evaluator=stubs["evaluator"])
            endpoints.append(_routing.Endpoint(address, raw, channel, stubs, transport_))
        self._router = _routing.Router(endpoints, routing=routing, health_timeout=health_timeout)
        self._several = several
        self._closed = False
        _live_clients.add(self)

    # The current endpoint's channel, stubs and transport (with one address:
    # the only one).
    address = property(lambda self: self._router.current.address,
                       doc="The address calls go to now (the first, with one address).")
    _raw_channel = property(lambda self: self._router.current.raw_channel)
    _channel = property(lambda self: self._router.current.channel)
    _server = property(lambda self: self._router.current.stubs["server"])
    _registry = property(lambda self: self._router.current.stubs["registry"])
    _compiler = property(lambda self: self._router.current.stubs["compiler"])
    _memory = property(lambda self: self._router.current.stubs["memory"])
    _executor = property(lambda self: self._router.current.stubs["executor"])
    _transport = property(lambda self: self._router.current.transport)

    def _rpc(self, stub, method, request, idempotent=True, progress=None):
        """stub.method(request) on the current endpoint; with several
        addresses, through the router (failover where safe). `progress`: see
        _call (elapsed time counts from here, across failovers)."""
        started = time.monotonic()
        if not self._several:
            return _call(getattr(self._router.current.stubs[stub], method), request,
                         self.timeout, progress, started)
        return self._router.call(
            lambda ep: _call(getattr(ep.stubs[stub], method), request, self.timeout, progress,
                             started),
            idempotent=idempotent)

    def preferred_addresses(self, op, namespace=None):
        """The addresses in the order an op call of `op` tries them under
        routing="affinity" (its rendezvous ranking), best first."""
        ns = self.namespace if namespace is None else namespace
        return _routing.rendezvous_order(ns, op, self.addresses)

    # ---- lifecycle --------------------------------------------------------------

    def close(self):
        """Closes the fast channel, releases this client's handles and regions
        (ReleaseHandles, ReleaseClient) and closes the gRPC channel.

        Output arrays that are still alive stay valid (their mapping is kept).
        """
        if self._closed:
            return
        self._closed = True
        for ep in self._router.endpoints:
            ep.close()
        _live_clients.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        if self._several:
            return "opjit.Client(%r, routing=%r)" % (self.addresses, self.routing)
        return "opjit.Client(%r, transport=%r, fast=%r)" % (self.address, self.transport,
                                                             self.fast)

    @property
    def timeout(self):
        """Seconds per call (None: no deadline); also the fast path's deadline."""
        return self._transport.timeout

    @timeout.setter
    def timeout(self, value):
        for ep in self._router.endpoints:
            ep.transport.timeout = value

    @property
    def copy_outputs(self):
        """Return outputs as private copies instead of views over shared memory."""
        return self._transport.copy_outputs

    @copy_outputs.setter
    def copy_outputs(self, value):
        for ep in self._router.endpoints:
            ep.transport.copy_outputs = bool(value)

    @property
    def transport(self):
        """"shm" or "inline": what tensors use now."""
        return "inline" if self._transport.shm_failure else "shm"

    @property
    def shm_fallback_reason(self):
        """Why shared memory is not used (None when it is)."""
        return self._transport.shm_failure

    @property
    def fast(self):
        """The fast-path mode: "auto", "on" or "off"."""
        return self._transport.fast_mode

    def fast_path_active(self, namespace=None):
        """True when op calls of `namespace` (default: the client's) can go
        over a fast channel now (it opens the channel if need be)."""
        ns = self.namespace if namespace is None else namespace
        if self._transport.pool(ns) is None:
            return False
        try:
            return self._transport.channel(ns) is not None
        except ShmUnavailable as e:  # this /dev/shm is not the server's
            self._transport.shm_failed(str(e))
            return False

    def call_counts(self):
        """Forwards so far by path: {"fast": channel calls (Op.prepare's calls
        too), "handle": prepared calls over gRPC, "grpc": plain gRPC calls}
        (summed over the addresses)."""
        out = {}
        for ep in self._router.endpoints:
            for k, v in ep.transport.call_counts().items():
                out[k] = out.get(k, 0) + v
        return out

    def session(self, namespace=None):
        """The call surface of `namespace` (default: the client's) that
        opjit.Op uses: forward, backward, gradcheck, verify, benchmark and
        context release, over whichever transport applies (see
        opjit._transport; with several addresses, routed as opjit._routing
        says)."""
        ns = self.namespace if namespace is None else namespace
        if self._several:
            return _routing.RoutedSession(self._router, ns)
        return Session(self._transport, ns)

    def wait_ready(self, timeout=10.0):
        """Blocks until the server answers (Unavailable after `timeout` seconds).
        With several addresses: until one of them answers a health check (it
        becomes the current one)."""
        if self._several:
            if self._router.wait_ready(timeout) is None:
                raise Unavailable("no opjitd answered on any of %s within %.1f s"
                                  % (", ".join(self.addresses), timeout))
            return self
        try:
            grpc.channel_ready_future(self._raw_channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable("no opjitd answered on %s within %.1f s"
                              % (self.address, timeout)) from None
        return self

    # ---- server, registry, compiler -----------------------------------------------

    def info(self):
        """opjit.v1.ServerInfo: version, CPU target, GPU availability, listen addresses."""
        return self._rpc("server", "GetServerInfo", server_pb2.GetServerInfoRequest())

    def register(self, spec, base_dir=None, progress=None, name=None):
        """Registers an op; returns opjit.v1.RegisterOpResponse (.record.version, .created).

        spec: a dict in protobuf's JSON mapping of OpDef (snake_case or
        lowerCamelCase keys), a path to a JSON spec file, a CustomRegOp
        builder, or an OpDef; or a list of those, merged into one op
        (MindSpore's ``reg_info`` list: an attr-only info adds its attrs to
        the inputs and outputs another one declares; see
        opjit.regop.merge_op_defs). ``source_file`` is read relative to `base_dir`
        (default: the spec file's directory, or the current directory).

        name: the op's name ("op" or "ns/op"), over the spec's. An op left
        unnamed (``CustomRegOp()``) is named after its implementation's entry,
        as MindSpore names a Custom op after its function.

        progress: a callable, called with the seconds elapsed (a float) about
        once a second while the server compiles the implementations, and once
        when the call ends (also when it fails). An exception it raises gives
        the call up (the server may still finish the registration) and
        propagates.

        Problems that do not stop the registration (a backward.op that names
        no registered op yet) come back in the response's ``.warnings`` and
        are each issued as an OpjitWarning (warnings.warn).
        """
        op = load_spec(spec, base_dir, name=name)
        if self.namespace and not op.namespace:
            op.namespace = self.namespace
        resp = self._rpc("registry", "RegisterOp", registry_pb2.RegisterOpRequest(op=op),
                         idempotent=False, progress=progress)
        for w in resp.warnings:
            warnings.warn("register %s/%s: %s" % (resp.record.op.namespace, resp.record.op.name, w),
                          OpjitWarning, stacklevel=2)
        return resp

    def compile(self, source, entry=None, language="c++", options=(), libraries=(),
                target="CPU", file_name=None, namespace=None, progress=None):
        """Compiles without registering; returns opjit.v1.CompileResponse.

        A compile error raises InvalidArgument with reason COMPILE_FAILED and
        .diagnostics (file, line, column, severity, text). The compile is
        charged to `namespace` (default: the client's).

        progress: a callable, called with the seconds elapsed (a float) about
        once a second while the compile runs, and once when the call ends
        (also when it fails); see register().
        """
        ns = self.namespace if namespace is None else namespace
        req = compile_pb2.CompileRequest(target=target, language=language, source=source,
                                         namespace=ns,
                                         entry=entry or "", file_name=file_name or "",
                                         compile_options=list(options), libraries=list(libraries))
        return self._rpc("compiler", "Compile", req, progress=progress)

    def cache_stats(self):
        return self._rpc("compiler", "GetCacheStats", compile_pb2.GetCacheStatsRequest())

    def ops(self, namespace=None, all_versions=False, with_sources=False):
        """A list of opjit.v1.OpRecord (latest versions unless all_versions)."""
        ns = self.namespace if namespace is None else namespace
        resp = self._rpc("registry", "ListOps", registry_pb2.ListOpsRequest(
            namespace=ns, all_versions=all_versions, with_sources=with_sources))
        return list(resp.ops)

    def describe(self, name, version=0):
        """opjit.v1.OpRecord of `name` ("ns/name" works); the latest unless `version`."""
        ns, n = split_name(name, self.namespace)
        return self._rpc("registry", "GetOp", registry_pb2.GetOpRequest(
            namespace=ns, name=n, version=version))

    def delete(self, name, version=0):
        """Deletes every version (or one); returns how many were removed."""
        ns, n = split_name(name, self.namespace)
        return self._rpc("registry", "DeleteOp", registry_pb2.DeleteOpRequest(
            namespace=ns, name=n, version=version), idempotent=False).deleted

    def clear_quarantine(self, name):
        """Admins: lifts the quarantine of every version of op `name` (a kernel
        whose executor crashed [exec] quarantine_after times in a row); returns
        how many of its kernels were quarantined. Registering the op again
        lifts it too."""
        ns, n = split_name(name, self.namespace)
        return self._rpc("registry", "ClearQuarantine", registry_pb2.ClearQuarantineRequest(
            namespace=ns, name=n)).lifted

    def op(self, name, version=0, target=None):
        """A callable for the registered op `name` (see Op)."""
        return Op(self, name, version=version, target=target)

    # ---- memory -------------------------------------------------------------------

    def empty(self, shape, dtype=np.float32):
        """An uninitialised array in this client's shared memory.

        Fill it in place and pass it to ops: it travels without any copy. With
        inline transport this is a plain np.empty.
        """
        return self._transport.empty(self.namespace, shape, dtype)

    def asarray(self, x, dtype=None):
        """A copy of `x` in shared memory (see empty())."""
        x = np.asarray(x, dtype=dtype)
        out = self.empty(x.shape, x.dtype)
        np.copyto(out, x)
        return out

    def shm_stats(self):
        """Regions, bytes and live blocks of this client's pools."""
        return self._transport.shm_stats()

    # ---- contexts -------------------------------------------------------------------

    def release_context(self, context_id, namespace=None):
        """Drops a backward context kept by a forward with requires_grad."""
        self._transport.release_context(self.namespace if namespace is None else namespace,
                                        context_id)

    def _flush_contexts(self):
        """Releases the contexts of graphs dropped without backward now (they
        are otherwise released by the next call or the lease thread)."""
        self._transport.flush_contexts()


_live_clients = weakref.WeakSet()


@atexit.register
def _close_all():
    for c in list(_live_clients):
        try:
            c.close()
        except Exception:
            pass
