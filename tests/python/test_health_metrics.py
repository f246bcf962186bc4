"""grpc.health.v1 that tells the truth, and the Prometheus endpoint.

Health: the daemon runs from a private copy of the binaries, so that a test
can take a worker program away (workers cannot be started) and put it back;
and a file-size limit set on the running daemon with prlimit makes every
store write fail (EFBIG) until it is lifted. Each must flip grpc.health to
NOT_SERVING and back to SERVING.

Metrics: the endpoint is scraped by Debian's prometheus server started in a
temp dir on loopback, and the text is parsed with prometheus_client's parser.
With principals configured, a scrape needs a bearer token: an admin's sees
every series, a user's only its namespaces' series (issue 14).
"""

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest

import opjit

from conftest import (TempDaemon, free_port, health, opjitd_binary, principal_toml, token_sha,
                      unary_kernel, unary_spec)

SRC = unary_kernel("* 2.0f")
SPEC = unary_spec("twice", SRC)


class Daemon(TempDaemon):
    def __init__(self, config, copy_binaries=False):
        binary = opjitd_binary()
        root = tempfile.mkdtemp(prefix="opjit-hm-")
        if copy_binaries:
            bindir = os.path.join(root, "bin")
            os.mkdir(bindir)
            for name in ("opjitd", "opjit-exec-worker", "opjit-compile-worker", "opjit-gpu-sandbox"):
                src = os.path.join(os.path.dirname(binary), name)
                if os.path.exists(src):
                    shutil.copy2(src, bindir)
            binary = os.path.join(bindir, "opjitd")
        self.bindir = os.path.dirname(binary)
        self.spawn(config, binary, dir=root)

    def health(self):
        """SERVING / NOT_SERVING from grpc.health.v1.Health/Check (service "")."""
        return health(self.unix_address)

    def wait_health(self, want, timeout=30):
        deadline = time.monotonic() + timeout
        got = None
        while time.monotonic() < deadline:
            got = self.health()
            if got == want:
                return
            time.sleep(0.1)
        raise AssertionError("health stayed %s, wanted %s:\n%s" % (got, want, self.read_log()[-3000:]))




@pytest.fixture
def healthd():
    d = Daemon("[health]\ninterval_ms = 200\n", copy_binaries=True)
    yield d
    d.close()


def test_health_is_not_serving_while_workers_cannot_start(healthd):
    healthd.wait_health("SERVING")
    for worker in ("opjit-exec-worker", "opjit-compile-worker"):
        path = os.path.join(healthd.bindir, worker)
        os.rename(path, path + ".away")
        try:
            healthd.wait_health("NOT_SERVING")
        finally:
            os.rename(path + ".away", path)
        healthd.wait_health("SERVING")
    assert "NOT_SERVING" in healthd.read_log()


def test_health_is_not_serving_while_the_store_cannot_be_written(healthd):
    healthd.wait_health("SERVING")
    pid = str(healthd.proc.pid)
    subprocess.run(["prlimit", "--pid", pid, "--fsize=1:"], check=True)
    try:
        healthd.wait_health("NOT_SERVING")
        with opjit.Client(healthd.unix_address, timeout=30) as c:
            with pytest.raises(opjit.OpjitError):
                c.register(SPEC)  # the write fails cleanly; the daemon lives
    finally:
        subprocess.run(["prlimit", "--pid", pid, "--fsize=unlimited:"], check=True)
    healthd.wait_health("SERVING")
    with opjit.Client(healthd.unix_address, timeout=60) as c:
        c.register(SPEC)
        np.testing.assert_allclose(c.op("twice")(np.ones(2, np.float32)), 2.0)


# ---- metrics -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def metricsd():
    d = Daemon('[metrics]\nlisten = "127.0.0.1:0"\n')
    d.metrics = d.metrics_address()
    # Traffic: a registration (a compile), calls, a failing call, a region and a context.
    # Over gRPC, so that the exact counts below are transport="grpc" ones
    # (fast-channel calls are counted too; test_fast.py checks those).
    with opjit.Client(d.unix_address, namespace="mx", timeout=60, fast="off") as c:
        c.register(dict(SPEC, namespace="mx"))
        f = c.op("twice")
        for _ in range(5):
            f(c.asarray(np.ones(4, np.float32)))
        with pytest.raises(opjit.NotFound):
            c.op("missing")(np.ones(2, np.float32))
        x = c.asarray(np.ones(4, np.float32))
        c._executor  # the client keeps its region alive while we scrape
        d.keep = (c.empty((1024,), np.float32), x)
        d.text = urllib.request.urlopen("http://%s/metrics" % d.metrics, timeout=10).read().decode()
    yield d
    d.close()


def families(text):
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(fam, name=None, **labels):
    return [s for s in fam.samples if (name is None or s.name == name) and
            all(s.labels.get(k) == v for k, v in labels.items())]


def test_metrics_parse_and_count_calls_by_op_namespace_and_code(metricsd):
    fams = families(metricsd.text)
    calls = fams["opjit_rpc_calls"]  # the parser drops _total from counter family names
    ok = samples(calls, method="Forward", namespace="mx", op="twice", code="OK")
    assert ok and ok[0].value >= 5
    # A call naming an op that does not exist is counted under "(invalid)",
    # never under the made-up name (which could fill the family's label cap).
    missing = samples(calls, namespace="mx", op="(invalid)", code="NOT_FOUND")
    assert missing and missing[0].value >= 1
    assert not [s for s in calls.samples if s.labels.get("op") == "missing"]
    lat = fams["opjit_rpc_latency_seconds"]
    count = samples(lat, "opjit_rpc_latency_seconds_count", method="Forward")
    assert count and count[0].value >= 5
    inf = samples(lat, "opjit_rpc_latency_seconds_bucket", method="Forward", le="+Inf")
    assert inf[0].value == count[0].value


def test_metrics_cover_cache_workers_and_bytes_per_namespace(metricsd):
    fams = families(metricsd.text)  # counters' family names lose "_total" in this parser
    assert samples(fams["opjit_compiles"])[0].value >= 1
    assert samples(fams["opjit_compile_seconds"])[0].value > 0
    assert samples(fams["opjit_cache_misses"], tier="memory")[0].value >= 1
    assert samples(fams["opjit_executor_worker_starts"])[0].value >= 1
    assert samples(fams["opjit_shm_bytes"], namespace="mx")[0].value > 0
    assert samples(fams["opjit_serving"])[0].value == 1
    assert fams["opjit_executor_worker_crashes"].type == "counter"
    assert fams["opjit_quarantined_kernels"].type == "counter"
    # No backward context is held: the family has no series, so no HELP/TYPE either.
    assert "opjit_context_bytes" not in metricsd.text


def test_promtool_accepts_the_exposition(metricsd):
    r = subprocess.run(["promtool", "check", "metrics"], input=metricsd.text, text=True,
                       capture_output=True)
    # 0: parsed, and no lint complaint (3 would be lint problems, 1 a parse error).
    assert r.returncode == 0, r.stdout + r.stderr


@contextlib.contextmanager
def prometheus(tmp_path, jobs):
    """Debian's prometheus scraping every second with `jobs` (the YAML of
    scrape_configs entries); yields query(promql) -> the result list, or []
    while prometheus is not answering yet."""
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n" + jobs)
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen(["prometheus", "--config.file", str(cfg), "--storage.tsdb.path",
                             str(tmp_path / "data"), "--web.listen-address", "127.0.0.1:%d" % port],
                            stdout=log, stderr=subprocess.STDOUT)

    def query(promql):
        try:
            q = urllib.request.urlopen("http://127.0.0.1:%d/api/v1/query?%s" % (
                port, urllib.parse.urlencode({"query": promql})), timeout=5).read()
            return json.loads(q)["data"]["result"]
        except (OSError, ValueError, KeyError):
            return []

    try:
        yield query
    finally:
        prom.terminate()
        prom.wait(30)
        log.close()


def wait_query(tmp_path, query, promql, ok=bool, timeout=60):
    """Polls `promql` until ok(result); returns the result."""
    deadline = time.monotonic() + timeout
    result = query(promql)
    while not ok(result) and time.monotonic() < deadline:
        time.sleep(0.5)
        result = query(promql)
    assert ok(result), (promql, result, (tmp_path / "prometheus.log").read_text()[-2000:])
    return result


def test_prometheus_server_scrapes_the_endpoint(metricsd, tmp_path):
    job = ("  - job_name: opjit\n    static_configs:\n      - targets: ['%s']\n"
           % metricsd.metrics)
    with prometheus(tmp_path, job) as query:
        result = wait_query(tmp_path, query, 'opjit_rpc_calls_total{method="Forward",op="twice"}')
        assert float(result[0]["value"][1]) >= 5
        assert query("up")[0]["value"][1] == "1"


# ---- metrics with principals -------------------------------------------------------------------

TOKENS = {"alice": "tok-alice-metrics-0123456789", "bob": "tok-bob-metrics-0123456789",
          "admin": "tok-admin-metrics-0123456789",
          "scraper": "tok-scraper-metrics-0123456789"}


def scrape(address, authorization=None):
    """(HTTP status, headers, body) of GET /metrics."""
    req = urllib.request.Request("http://%s/metrics" % address)
    if authorization is not None:
        req.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


@pytest.fixture(scope="module")
def authd():
    """A daemon with principals alice (user of "alice"), bob (user of "bob")
    and an admin; alice and bob each registered and called an op."""
    config = "".join([
        principal_toml("alice", "user", ["alice"], TOKENS["alice"]),
        principal_toml("bob", "user", ["bob"], TOKENS["bob"]),
        principal_toml("root-admin", "admin", token=TOKENS["admin"]),
        principal_toml("prometheus", "metrics", token=TOKENS["scraper"]),
        '[metrics]\nlisten = "127.0.0.1:0"\n',
    ])
    d = Daemon(config)
    d.metrics = d.metrics_address()
    # Over the unix socket, with each user's token (root's uid alone would be admin).
    for who, op, calls in (("alice", "alice_visible_op", 3), ("bob", "bob_secret_op", 4)):
        with opjit.Client(d.unix_address, namespace=who, token=TOKENS[who], timeout=60,
                          fast="off") as c:
            c.register(dict(SPEC, name=op, namespace=who))
            f = c.op(op)
            for _ in range(calls):
                f(np.ones(4, np.float32))
    # Probes that must not become series in alice's namespace: bob naming it,
    # a caller with a wrong token, and alice naming an op that does not exist.
    probes = ((TOKENS["bob"], "bob_probe_op", opjit.NotFound),
              ("wrong-token-0123456789", "anon_probe_op", opjit.OpjitError),
              (TOKENS["alice"], "alice_typo_op", opjit.NotFound))
    for token, op, error in probes:
        with opjit.Client(d.unix_address, namespace="alice", token=token, timeout=60,
                          fast="off") as c:
            with pytest.raises(error):
                c.op(op)(np.ones(4, np.float32))
    yield d
    assert d.proc.poll() is None, "opjitd died:\n" + d.read_log()
    d.close()


def test_metrics_need_a_bearer_token_once_principals_exist(authd):
    refusals = [scrape(authd.metrics, h) for h in (
        None, "Bearer wrong-token", "Bearer " + token_sha(TOKENS["alice"]), "Basic YWxpY2U6eA==",
        "Bearer", TOKENS["alice"])]
    for status, headers, body in refusals:
        assert status == 401, body
        assert headers["WWW-Authenticate"] == 'Bearer realm="opjit"'
        assert "opjit_" not in body and "_op" not in body
    # One answer for a missing, malformed and unknown token alike.
    assert len({body for _, _, body in refusals}) == 1


def test_a_users_scrape_shows_only_its_namespaces_series(authd):
    status, headers, body = scrape(authd.metrics, "Bearer " + TOKENS["alice"])
    assert status == 200, body
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert "bob" not in body, "bob's namespace and op names must not leak"
    assert "probe" not in body and "alice_typo_op" not in body, "probes make no series"
    fams = families(body)
    calls = samples(fams["opjit_rpc_calls"], method="Forward", namespace="alice",
                    op="alice_visible_op", code="OK")
    assert calls and calls[0].value >= 3
    for fam in fams.values():
        for s in fam.samples:
            assert s.labels.get("namespace") == "alice", (fam.name, s)
    # Server-wide families (cache, workers, health, latency by method) are for admins.
    for name in ("opjit_serving", "opjit_cache_misses_total", "opjit_executor_workers",
                 "opjit_rpc_latency_seconds", "opjit_namespaces"):
        assert "# HELP %s " % name not in body and "\n%s" % name not in body, name
    r = subprocess.run(["promtool", "check", "metrics"], input=body, text=True,
                       capture_output=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # Bob, likewise, sees his and not alice's.
    status, _, body = scrape(authd.metrics, "bearer " + TOKENS["bob"])
    assert status == 200 and "bob_secret_op" in body and "alice" not in body, body


def test_an_admin_scrape_shows_everything(authd):
    status, _, body = scrape(authd.metrics, "Bearer " + TOKENS["admin"])
    assert status == 200, body
    fams = families(body)
    for ns, op, n in (("alice", "alice_visible_op", 3), ("bob", "bob_secret_op", 4)):
        calls = samples(fams["opjit_rpc_calls"], method="Forward", namespace=ns, op=op, code="OK")
        assert calls and calls[0].value >= n, (ns, op)
    assert samples(fams["opjit_serving"])[0].value == 1
    assert samples(fams["opjit_executor_worker_starts"])[0].value >= 1
    assert samples(fams["opjit_namespaces"])[0].value >= 3  # default, alice, bob
    # Refused calls are counted without their namespace and op; a call naming no
    # existing op keeps its namespace but not the made-up name.
    assert "probe_op" not in body and "alice_typo_op" not in body
    assert samples(fams["opjit_rpc_calls"], namespace="(refused)")
    assert samples(fams["opjit_rpc_calls"], namespace="alice", op="(invalid)", code="NOT_FOUND")


def test_a_metrics_principal_scrapes_everything_and_can_do_nothing_else(authd):
    status, _, body = scrape(authd.metrics, "Bearer " + TOKENS["scraper"])
    assert status == 200, body
    fams = families(body)
    for ns, op in (("alice", "alice_visible_op"), ("bob", "bob_secret_op")):
        assert samples(fams["opjit_rpc_calls"], method="Forward", namespace=ns, op=op, code="OK")
    assert samples(fams["opjit_serving"])[0].value == 1
    # Over gRPC it sees no namespace: it can neither list, call nor register.
    with opjit.Client(authd.unix_address, namespace="alice", token=TOKENS["scraper"], timeout=30,
                      fast="off") as c:
        assert c.ops(namespace="") == []  # every namespace: none it can see
        with pytest.raises(opjit.NotFound) as e:
            c.op("alice_visible_op")(np.ones(4, np.float32))
        assert e.value.reason == "NAMESPACE_NOT_FOUND"
        with pytest.raises(opjit.NotFound):
            c.register(dict(SPEC, name="scraper_op", namespace="alice"))


def test_prometheus_scrapes_with_a_credentials_file(authd, tmp_path):
    token_file = tmp_path / "alice.token"
    token_file.write_text(TOKENS["alice"] + "\n")
    os.chmod(token_file, 0o600)
    jobs = ("  - job_name: alice\n    authorization: {type: Bearer, credentials_file: '%s'}\n"
            "    static_configs:\n      - targets: ['%s']\n"
            "  - job_name: anonymous\n    static_configs:\n      - targets: ['%s']\n"
            % (token_file, authd.metrics, authd.metrics))
    with prometheus(tmp_path, jobs) as query:
        wait_query(tmp_path, query, 'up{job="alice"} == 1')
        wait_query(tmp_path, query, 'up{job="anonymous"}')
        assert query('up{job="anonymous"}')[0]["value"][1] == "0"  # refused: 401
        result = wait_query(tmp_path, query,
                            'opjit_rpc_calls_total{job="alice",op="alice_visible_op"}')
        assert float(result[0]["value"][1]) >= 3
        assert query('opjit_rpc_calls_total{op="bob_secret_op"}') == []
