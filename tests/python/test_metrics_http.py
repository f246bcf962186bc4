"""/metrics while clients hold connections open and send nothing (issue 26, item 7).

The exporter used to be a single-threaded server that read one connection at
a time: each connection that sent only a request line held it for about 2 s,
so 16 of them delayed a scrape by about 30 s. Each test here starts its own
opjitd with [metrics] listen = "127.0.0.1:0", opens idle connections to it
(only part of a request head, never the blank line that ends it) and times a
real scrape, which must answer valid Prometheus text within SCRAPE_BOUND_S.

Connections come from other loopback addresses (127.0.0.2, ...) where a test
needs to tell them from the scraper's (the per-address limit). `-s` prints
the measured times.
"""

import socket
import time
import urllib.request

import pytest

from conftest import TempDaemon, health

# The issue asks for at most 1 s of delay; the bound is looser so that a
# loaded machine (the sanitizer run, make -j) does not fail it. The old server
# took about 29 s with 16 idle connections.
SCRAPE_BOUND_S = 3.0
# What the exporter allows (server/metrics/http_exporter.h, Options):
HEAD_TIMEOUT_S = 2.0  # read_timeout_ms, from accept to the end of the head
PER_ADDRESS_LIMIT = 32  # max_connections_per_address
TOTAL_LIMIT = 128  # max_connections

PARTIAL_HEADS = (b"GET /metrics HTTP/1.1\r\n",  # a request line and nothing more
                 b"GET /metr")  # not even a whole request line


class MetricsDaemon(TempDaemon):
    def __init__(self):
        self.spawn('[metrics]\nlisten = "127.0.0.1:0"\n', prefix="opjit-mh-", serving=True)
        host, port = self.metrics_address().rsplit(":", 1)
        self.metrics = (host, int(port))


@pytest.fixture
def md():
    d = MetricsDaemon()
    yield d
    d.close()


def hold(daemon, n, source="127.0.0.1"):
    """`n` connections from `source`, each sent part of a request head."""
    socks = []
    for i in range(n):
        s = socket.socket()
        s.settimeout(10)
        s.bind((source, 0))
        s.connect(daemon.metrics)
        try:
            s.sendall(PARTIAL_HEADS[i % len(PARTIAL_HEADS)])
        except OSError:  # already refused and reset: it holds nothing
            pass
        socks.append(s)
    return socks


def close_all(socks):
    for s in socks:
        s.close()


def scrape(daemon, timeout=20):
    """(seconds, body) of GET /metrics; asserts a 200 with the Prometheus type."""
    url = "http://%s:%d/metrics" % daemon.metrics
    start = time.monotonic()
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read().decode()
        status, ctype = r.status, r.headers.get("Content-Type")
    took = time.monotonic() - start
    assert status == 200
    assert ctype == "text/plain; version=0.0.4; charset=utf-8"
    return took, body


def assert_prometheus_text(body):
    from prometheus_client.parser import text_string_to_metric_families
    names = {f.name for f in text_string_to_metric_families(body)}
    assert {"opjit_serving", "opjit_registry_store_up"} <= names, sorted(names)


def closed_by_server(s):
    """Whether the server has closed `s` (EOF or reset), without waiting."""
    try:
        return s.recv(4096, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def assert_healthy(daemon):
    assert daemon.proc.poll() is None, daemon.read_log()[-3000:]
    assert health(daemon.unix_address) == "SERVING"
    took, body = scrape(daemon)
    assert_prometheus_text(body)
    assert took < SCRAPE_BOUND_S, took


def test_sixteen_idle_connections_do_not_delay_a_scrape(md):
    scrape(md)  # warm: the first render
    socks = hold(md, 16)
    try:
        took, body = scrape(md)
        print("scrape with 16 idle connections held: %.3f s" % took)
        assert_prometheus_text(body)
        assert took < SCRAPE_BOUND_S, "a scrape took %.1f s behind 16 idle connections" % took
        # Several in a row, still behind the same 16.
        for _ in range(5):
            took, _ = scrape(md)
            assert took < SCRAPE_BOUND_S, took
    finally:
        close_all(socks)
    assert_healthy(md)


def test_one_address_cannot_take_every_connection(md):
    n = 2 * PER_ADDRESS_LIMIT
    socks = hold(md, n, source="127.0.0.2")
    try:
        took, body = scrape(md)  # from 127.0.0.1
        print("scrape with %d idle connections from another address: %.3f s" % (n, took))
        assert_prometheus_text(body)
        assert took < SCRAPE_BOUND_S, took
        # Those past the per-address limit were closed as soon as they were
        # accepted (all were, before the scrape queued behind them), not at
        # the head timeout.
        closed = [False] * n
        deadline = time.monotonic() + 1.0
        while sum(closed) < n - PER_ADDRESS_LIMIT and time.monotonic() < deadline:
            closed = [c or closed_by_server(s) for c, s in zip(closed, socks)]
            time.sleep(0.02)
        assert sum(closed) >= n - PER_ADDRESS_LIMIT, sum(closed)
    finally:
        close_all(socks)
    assert_healthy(md)


def test_more_idle_connections_than_the_limit_only_wait_for_the_head_timeout(md):
    # From ten addresses, none past its own limit: together past the total.
    per = 16
    sources = ["127.0.0.%d" % i for i in range(2, 12)]
    assert per * len(sources) > TOTAL_LIMIT
    socks = []
    try:
        for src in sources:
            socks += hold(md, per, source=src)
        took, body = scrape(md)
        print("scrape with %d idle connections (past the limit of %d): %.3f s"
              % (len(socks), TOTAL_LIMIT, took))
        assert_prometheus_text(body)
        # It may wait in the listen queue until the head timeout frees
        # connections, no longer.
        assert took < HEAD_TIMEOUT_S + 8, took
    finally:
        close_all(socks)
    assert_healthy(md)


def test_an_idle_connection_is_closed_after_the_head_timeout(md):
    for head in PARTIAL_HEADS + (b"",):
        s = socket.create_connection(md.metrics, timeout=30)
        try:
            start = time.monotonic()
            if head:
                s.sendall(head)
            try:
                got = s.recv(4096)
            except ConnectionResetError:
                got = b""
            waited = time.monotonic() - start
        finally:
            s.close()
        print("idle connection (sent %r) closed after %.3f s" % (head, waited))
        assert got == b"", got  # closed without a response
        assert HEAD_TIMEOUT_S / 2 <= waited < HEAD_TIMEOUT_S + 8, waited
    assert_healthy(md)


def test_a_client_that_drips_its_head_is_cut_off_at_the_head_timeout(md):
    # One byte every 0.3 s: never idle long, but never done either.
    s = socket.create_connection(md.metrics, timeout=30)
    head = b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 200
    start = time.monotonic()
    cut = None
    try:
        for i in range(len(head)):
            try:
                s.sendall(head[i:i + 1])
            except OSError:
                cut = time.monotonic() - start
                break
            if closed_by_server(s):
                cut = time.monotonic() - start
                break
            time.sleep(0.3)
    finally:
        s.close()
    print("dripping client cut off after %s s" % cut)
    assert cut is not None, "a client sending one byte every 0.3 s was never cut off"
    assert cut < HEAD_TIMEOUT_S + 8, cut
    assert_healthy(md)
