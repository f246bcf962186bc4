"""Several server addresses: parsing, health, failover and affinity routing.

A Client given several addresses (a list, or a comma-separated string such
as ``$OPJIT_SERVER="unix:/run/a.sock,10.0.0.2:7878"``) keeps one
:class:`Endpoint` per address: its own gRPC channel and its own
:class:`opjit._transport.Transport` (regions, prepared handles and fast
channels belong to the daemon that made them, so they never move).

* ``routing="failover"`` (the default): calls go to the current endpoint,
  at first the first one that answers a health check
  (``grpc.health.v1.Health/Check``, ``health_timeout`` seconds). When a
  call fails with UNAVAILABLE from the transport (no daemon answered; a
  daemon's own UNAVAILABLE carries a reason and is never retried), the
  endpoint is marked down for a while and the call moves on to the next
  one, if it is safe to repeat: reads, compiles, forwards (a kernel's
  outputs are a function of its inputs), gradchecks, verifies, benchmarks. Calls that change
  server state (register, delete, cache clear, backward on a context) are
  sent only to an endpoint that just passed a health check, and are not
  repeated elsewhere once sent.
* ``routing="affinity"``: op calls (forward, gradcheck, verify, bench) go to the endpoint
  that ranks highest for their (namespace, op name) by rendezvous hashing,
  so each op keeps landing on the daemon whose kernel is warm, and adding
  a daemon moves only the ops it now ranks first for. When that endpoint
  is down the call falls through to the next in that op's ranking. Other
  calls route as in failover mode.

Shared memory and the fast path need the daemon on this host: with several
addresses an endpoint uses them only when its address is a unix socket; a
TCP endpoint sends tensors inline. A single address behaves as before
(shared memory over loopback TCP too).

The rendezvous score is FNV-1a 64 of ``namespace \\0 op \\0 address`` put
through the splitmix64 finalizer; the C++ client computes the same, so both
route an op to the same daemon.
"""

import threading
import time

import grpc

ROUTING_MODES = ("failover", "affinity")
DOWN_FOR_S = 2.0   # an endpoint that failed is skipped this long (unless all are down)

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


def split_addresses(addr):
    """A list of addresses from a list/tuple or a comma-separated string."""
    if isinstance(addr, (list, tuple)):
        items = []
        for a in addr:
            items += split_addresses(a)
        return items
    return [a.strip() for a in str(addr).split(",") if a.strip()]


def rendezvous_score(namespace, op, address):
    """The affinity score of `address` for (namespace, op): higher wins."""
    h = _FNV_OFFSET
    for b in ("%s\0%s\0%s" % (namespace or "default", op, address)).encode():
        h = ((h ^ b) * _FNV_PRIME) & _MASK
    # splitmix64's finalizer: FNV alone spreads nearby strings poorly.
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK
    return h ^ (h >> 31)


def rendezvous_order(namespace, op, addresses):
    """`addresses` ranked for (namespace, op), best first."""
    return sorted(addresses, key=lambda a: rendezvous_score(namespace, op, a), reverse=True)


def is_transport_unavailable(err):
    """True for UNAVAILABLE that no daemon sent (every daemon error carries a
    machine-readable reason; gRPC's own connection failures carry none)."""
    return err.code == grpc.StatusCode.UNAVAILABLE and not err.reason


class Endpoint:
    """One address: its channel, stubs and transport, and whether it answers.

    `stubs` is a dict of the generated stubs ("server", "registry",
    "compiler", "memory", "executor", "evaluator"); `transport` its Transport.
    """

    def __init__(self, address, raw_channel, channel, stubs, transport):
        self.address = address
        self.raw_channel = raw_channel
        self.channel = channel
        self.stubs = stubs
        self.transport = transport
        self.healthy = False      # passed a health check or a call since it last failed
        self.down_until = 0.0     # monotonic time before which it is skipped
        self._health = channel.unary_unary("/grpc.health.v1.Health/Check")

    def check(self, timeout):
        """A health check: True when the daemon answers SERVING in time."""
        try:
            # HealthCheckRequest{service: ""} is the empty message; the
            # answer's field 1 (status) is 1 for SERVING.
            resp = self._health(b"", timeout=timeout)
        except grpc.RpcError:
            self.mark_down()
            return False
        ok = resp == b"\x08\x01"
        if ok:
            self.healthy = True
            self.down_until = 0.0
        else:
            self.mark_down()
        return ok

    def mark_down(self):
        self.healthy = False
        self.down_until = time.monotonic() + DOWN_FOR_S

    def close(self):
        self.transport.close()
        self.channel.close()


class Router:
    """Picks endpoints for calls and moves on when one is gone (see the module
    docstring). Thread-safe."""

    def __init__(self, endpoints, routing="failover", health_timeout=1.0):
        self.endpoints = endpoints
        self.routing = routing
        self.health_timeout = health_timeout
        self._by_address = {ep.address: ep for ep in endpoints}
        self._current = 0
        self._lock = threading.Lock()

    @property
    def current(self):
        return self.endpoints[self._current]

    def order(self, key=None):
        """Endpoints in the order a call tries them: the op's rendezvous
        ranking (affinity with a key), else from the current one on.
        Endpoints marked down go last."""
        if key is not None and self.routing == "affinity":
            eps = [self._by_address[a] for a in
                   rendezvous_order(key[0], key[1], [e.address for e in self.endpoints])]
        else:
            k = self._current
            eps = self.endpoints[k:] + self.endpoints[:k]
        now = time.monotonic()
        return [e for e in eps if e.down_until <= now] + [e for e in eps if e.down_until > now]

    def _settle(self, ep, key):
        """Failover mode: the endpoint that answered becomes the current one."""
        if key is None or self.routing != "affinity":
            with self._lock:
                self._current = self.endpoints.index(ep)

    def call(self, fn, *, idempotent, key=None):
        """fn(endpoint) on the first endpoint that takes it; see the module
        docstring for when a failed call moves on. Raises the last error."""
        from opjit.errors import OpjitError, Unavailable
        last = None
        for ep in self.order(key):
            if not ep.healthy and not ep.check(self.health_timeout):
                last = Unavailable("no opjitd answered a health check at %s" % ep.address)
                continue
            try:
                result = fn(ep)
            except OpjitError as err:
                if not is_transport_unavailable(err):
                    raise
                ep.mark_down()
                if not idempotent:
                    raise
                last = err
                continue
            self._settle(ep, key)
            return result
        if last is None:  # pragma: no cover (there is always an endpoint)
            last = Unavailable("no server address")
        addresses = ", ".join(e.address for e in self.endpoints)
        raise Unavailable("no opjitd answered at any of %s (last: %s)"
                          % (addresses, getattr(last, "message", last)),
                          details=getattr(last, "details", None)) from None

    def wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while True:
            for ep in self.order():
                if ep.check(min(self.health_timeout, max(deadline - time.monotonic(), 0.05))):
                    self._settle(ep, None)
                    return ep
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


class RoutedSession:
    """Session's surface (opjit._transport.Session) over several endpoints:
    op calls routed by the Router; a backward context stays with the
    endpoint whose forward kept it."""

    __slots__ = ("_router", "namespace", "_contexts", "_lock")

    def __init__(self, router, namespace):
        self._router = router
        self.namespace = namespace
        self._contexts = {}   # context_id -> Endpoint
        self._lock = threading.Lock()

    def _key(self, op):
        return (self.namespace, op)

    def forward(self, op, groups, attrs=None, version=0, target=None, requires_grad=None,
                keep_output_bytes=False):
        ns = self.namespace
        box = []

        def run(ep):
            fwd = ep.transport.forward(ns, op, version, target, groups, attrs or {}, requires_grad,
                                       keep_output_bytes)
            box.append(ep)
            return fwd

        fwd = self._router.call(run, idempotent=True, key=self._key(op))
        if fwd.context_id:
            with self._lock:
                self._contexts[fwd.context_id] = box[-1]
        return fwd

    def prepare_call(self, op, groups, attrs=None, version=0, target=None,
                     keep_output_bytes=False):
        """A PreparedCall on the endpoint the router picks now (it stays there)."""
        return self._router.call(
            lambda ep: ep.transport.prepare_call(self.namespace, op, version, target, groups,
                                                 attrs or {}, keep_output_bytes),
            idempotent=True, key=self._key(op))

    def _owner(self, context_id, pop=False):
        with self._lock:
            ep = self._contexts.pop(context_id, None) if pop else self._contexts.get(context_id)
        return ep if ep is not None else self._router.current

    def backward(self, context_id, grads, retain_context=False, grad_bytes=0,
                 keep_output_bytes=False, create_graph=False):
        ep = self._owner(context_id, pop=not retain_context)
        out = ep.transport.backward(self.namespace, context_id, grads, retain_context,
                                    grad_bytes, keep_output_bytes, create_graph)
        if getattr(out, "context_id", ""):
            with self._lock:  # the bprop's context lives where the forward's did
                self._contexts[out.context_id] = ep
        return out

    def gradcheck(self, request):
        return self._router.call(lambda ep: ep.transport.gradcheck(request), idempotent=True,
                                 key=self._key(request.op))

    def verify(self, request):
        return self._router.call(lambda ep: ep.transport.verify(request), idempotent=True,
                                 key=self._key(request.candidate.op))

    def benchmark(self, request):
        return self._router.call(lambda ep: ep.transport.benchmark(request), idempotent=True,
                                 key=self._key(request.op.op))

    def fast_channel_open(self):
        """Several addresses: calls take no fast channel, and the daemons keep
        backward contexts (opjit.op.ClientOpNode is not used)."""
        return False

    def count(self, what):
        calls = self._router.current.transport.calls
        calls[what] = calls.get(what, 0) + 1

    def release_context_later(self, context_id):
        self._owner(context_id, pop=True).transport.forget_context(self.namespace, context_id)
