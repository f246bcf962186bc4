"""Metrics an operator can use (issue 25): what a real daemon exports passes
`promtool check metrics` with no complaint; the shipped alert rules
(deploy/prometheus/alerts.yml) pass `promtool check rules` and their unit
tests; the shipped Grafana dashboard (deploy/grafana/opjit.json) is a
well-formed dashboard; and every series the rules and the dashboard query,
and every family the daemon exports, is one the daemon really exports and
README.md documents (name, type and labels).

The daemon is this test's own (a temp state dir, metrics on 127.0.0.1:0), and
every count asserted is of traffic this test drove: registrations, calls over
gRPC and over a fast channel, a failing compile, a kernel that crashes its
executor, a registration refused by the ops quota, a call naming no op.
"""

import json
import os
import re
import subprocess
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest
import yaml

import opjit

from conftest import TempDaemon, free_port, unary_kernel, unary_spec

SOURCE_DIR = os.environ.get("OPJIT_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALERTS = os.path.join(SOURCE_DIR, "deploy", "prometheus", "alerts.yml")
ALERTS_TEST = os.path.join(SOURCE_DIR, "deploy", "prometheus", "alerts_test.yml")
DASHBOARD = os.path.join(SOURCE_DIR, "deploy", "grafana", "opjit.json")
README = os.path.join(SOURCE_DIR, "README.md")

# y = 2x; traps (SIGILL, killing its executor process) when x[0] < 0.
SRC = unary_kernel("* 2.0f", pre="if (k > 0 && x[0] < 0) __builtin_trap();")


def spec(name, src=SRC):
    return unary_spec(name, src)


class Daemon(TempDaemon):
    def __init__(self, config):
        self.spawn('[metrics]\nlisten = "127.0.0.1:0"\n' + config, prefix="opjit-mo-")
        self.metrics = self.metrics_address()

    def scrape(self):
        url = "http://%s/metrics" % self.metrics
        return urllib.request.urlopen(url, timeout=30).read().decode()


@pytest.fixture(scope="module")
def opsd():
    # Three ops in the namespace: "twice", "broken" fails to compile (and so
    # is not kept), "q0", "q1"; the next registration is refused.
    d = Daemon("[quota]\nops = 3\n")
    try:
        with opjit.Client(d.unix_address, timeout=60, fast="off") as c:
            c.register(spec("twice"))
            f = c.op("twice")
            for _ in range(5):
                f(np.ones(4, np.float32))
            with pytest.raises(opjit.InvalidArgument) as e:
                c.register(spec("broken", "this is not C++"))
            assert e.value.reason == "COMPILE_FAILED"
            with pytest.raises(opjit.OpjitError) as e:
                f(-np.ones(4, np.float32))
            assert e.value.reason == "KERNEL_CRASHED"
            with pytest.raises(opjit.ResourceExhausted) as e:
                for i in range(5):
                    c.register(spec("q%d" % i))
            assert (e.value.reason, e.value.metadata["quota"]) == ("QUOTA_EXCEEDED", "ops")
            with pytest.raises(opjit.NotFound):
                c.op("missing")(np.ones(2, np.float32))
            region = c.empty((1024,), np.float32)  # shm bytes while we scrape
            # Calls on a same-host fast channel (their own series).
            with opjit.Client(d.unix_address, timeout=60, fast="on") as fc:
                g = fc.op("twice")
                for _ in range(3):
                    g(np.ones(4, np.float32))
            # Channels report their calls at least once a second: wait for them.
            channel = re.compile(r'^opjit_rpc_calls_total\{method="Forward",namespace="default",'
                                 r'op="twice",code="OK",transport="channel"\} 3$', re.M)
            deadline = time.monotonic() + 30
            d.text = d.scrape()
            while not channel.search(d.text) and time.monotonic() < deadline:
                time.sleep(0.1)
                d.text = d.scrape()
            del region
        yield d
        assert d.proc.poll() is None, "opjitd died:\n" + d.read_log()
    finally:
        d.close()


@pytest.fixture(scope="module")
def remoted(tmp_path_factory):
    """A daemon whose Redis tier ([cache.remote]) is down (a closed port), so
    it exports the tier's series: one registration's lookups count errors."""
    key = tmp_path_factory.mktemp("remote") / "cluster.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o600)
    d = Daemon('[cache.remote]\nurl = "redis://127.0.0.1:%d"\nkey_file = "%s"\n'
               'timeout_ms = 100\n' % (free_port(), key))
    try:
        with opjit.Client(d.unix_address, timeout=60, fast="off") as c:
            c.register(spec("twice"))
        errors = re.compile(r"^opjit_cache_remote_errors_total [1-9]", re.M)
        deadline = time.monotonic() + 30
        d.text = d.scrape()
        while not errors.search(d.text) and time.monotonic() < deadline:
            time.sleep(0.1)
            d.text = d.scrape()
        yield d
    finally:
        d.close()


def families(text):
    """{family name: (type, set of label names)} from an exposition; a
    counter's name keeps its _total; histograms lose _bucket/_sum/_count."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)$", line)
        if m:
            out[m.group(1)] = (m.group(2), set())
            continue
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? ", line)
        assert m, line
        name = base_name(m.group(1), out)
        labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(3) or ""))
        out[name][1].update(labels - {"le"})
    return out


def base_name(series, known):
    """The family of a series name: histogram suffixes stripped when that
    names a known family."""
    for suffix in ("_bucket", "_sum", "_count"):
        if series.endswith(suffix) and series[:-len(suffix)] in known:
            return series[:-len(suffix)]
    return series


def opjit_names(expr):
    """The opjit_* metric names a PromQL expression reads."""
    return set(re.findall(r"\bopjit_[a-z0-9_]+", expr))


def exported(opsd, remoted=None):
    fams = families(opsd.text)
    if remoted is not None:
        fams.update(families(remoted.text))
    names = set(fams)
    for name, (kind, _) in fams.items():
        if kind == "histogram":
            names |= {name + "_bucket", name + "_sum", name + "_count"}
    return names


# ---- the exposition ------------------------------------------------------------------------------

def test_the_traffic_shows_in_the_scrape(opsd):
    text = opsd.text
    assert re.search(r'^opjit_compile_failures_total [1-9]', text, re.M), text
    assert re.search(r'^opjit_executor_worker_crashes_total [1-9]', text, re.M), text
    assert re.search(r'^opjit_quota_refusals_total\{method="RegisterOp",namespace="default",'
                     r'quota="ops"\} 1$', text, re.M), text
    assert re.search(r'^opjit_rpc_calls_total\{method="Forward",namespace="default",op="twice",'
                     r'code="OK",transport="channel"\} 3$', text, re.M), text
    assert re.search(r'^opjit_shm_bytes\{namespace="default"\} [1-9]', text, re.M), text
    assert re.search(r'^opjit_registry_store_up 1$', text, re.M), text
    # Without [cache.remote] the Redis tier's series are absent.
    assert "opjit_cache_remote_errors_total" not in text
    # A region's name (made up per client) is not an op label.
    assert not re.search(r'method="CreateRegion",namespace="default",op="[^"]', text), text


def test_a_redis_outage_shows_in_the_scrape(remoted):
    text = remoted.text
    assert re.search(r"^opjit_cache_remote_errors_total [1-9]", text, re.M), text
    assert re.search(r"^opjit_cache_remote_rejected_total 0$", text, re.M), text
    assert re.search(r'^opjit_cache_misses_total\{tier="remote"\} [1-9]', text, re.M), text
    r = subprocess.run(["promtool", "check", "metrics"], input=text, text=True,
                       capture_output=True)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_opjit_info_shows_the_bound_metrics_endpoint(opsd):
    # The config asked for port 0: info names the port picked.
    cli = os.path.join(os.path.dirname(os.environ.get("OPJITD", "opjitd")), "opjit")
    r = subprocess.run([cli, "--server", opsd.unix_address, "info"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not opsd.metrics.endswith(":0"), opsd.metrics
    assert "\nmetrics:   http://%s/metrics\n" % opsd.metrics in r.stdout, r.stdout


def test_promtool_check_metrics_passes_on_a_real_scrape(opsd):
    r = subprocess.run(["promtool", "check", "metrics"], input=opsd.text, text=True,
                       capture_output=True)
    assert r.returncode == 0, r.stdout + r.stderr + "\n" + opsd.text
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


def test_totals_are_counters_and_every_family_has_samples(opsd):
    fams = families(opsd.text)
    for name, (kind, _) in fams.items():
        assert name.endswith("_total") == (kind == "counter"), (name, kind)
    declared = re.findall(r"^# TYPE (\S+) ", opsd.text, re.M)
    for name in declared:
        assert re.search(r"^%s(_bucket|_sum|_count)?[{ ]" % re.escape(name), opsd.text, re.M), \
            "%s is declared without samples" % name


# ---- alert rules ---------------------------------------------------------------------------------

def alert_rules():
    with open(ALERTS) as f:
        doc = yaml.safe_load(f)
    return [r for g in doc["groups"] for r in g["rules"]]


def test_alert_rules_pass_promtool_check_rules():
    r = subprocess.run(["promtool", "check", "rules", ALERTS], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_alert_rules_pass_their_unit_tests():
    r = subprocess.run(["promtool", "test", "rules", ALERTS_TEST], capture_output=True, text=True,
                       cwd=os.path.dirname(ALERTS_TEST))
    assert r.returncode == 0, r.stdout + r.stderr


def test_alert_rules_cover_what_an_operator_needs():
    by_expr = {r["alert"]: r["expr"] for r in alert_rules()}
    assert 'up{job="opjit"} == 0' in by_expr["OpjitDown"]
    wanted = {"OpjitRegistryStoreDown": "opjit_registry_store_up",
              "OpjitExecutorCrashes": "opjit_executor_worker_crashes_total",
              "OpjitQuotaRefusals": "opjit_quota_refusals_total",
              "OpjitCompileFailures": "opjit_compile_failures_total",
              "OpjitCallLatencyP99High": "opjit_rpc_latency_seconds_bucket",
              "OpjitRemoteCacheErrors": "opjit_cache_remote_errors_total",
              "OpjitRemoteCacheRejected": "opjit_cache_remote_rejected_total",
              "OpjitRegistryWritesRefused": "opjit_rpc_calls_total"}
    for alert, series in wanted.items():
        assert series in by_expr[alert], alert
    assert "histogram_quantile(0.99" in by_expr["OpjitCallLatencyP99High"]
    for r in alert_rules():
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]


def test_alert_rules_name_only_series_the_daemon_exports(opsd, remoted):
    names = exported(opsd, remoted)
    for r in alert_rules():
        used = opjit_names(r["expr"])
        assert used or "up{" in r["expr"], r["alert"]
        assert used <= names, (r["alert"], used - names)


# ---- Grafana dashboard ---------------------------------------------------------------------------

def dashboard():
    with open(DASHBOARD) as f:
        return json.load(f)


def dashboard_queries(d):
    """Every PromQL string of the dashboard: panel targets and variable queries."""
    out = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out.append(q["query"] if isinstance(q, dict) else q)
    return out


def test_dashboard_is_a_well_formed_grafana_dashboard():
    d = dashboard()
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in d["panels"]:
        assert p["type"] in ("timeseries", "stat"), p["title"]
        assert set(p["gridPos"]) == {"h", "w", "x", "y"}, p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in variables or var == "__rate_interval", (p["title"], var)


def test_dashboard_has_the_panels_an_operator_needs():
    panels = {p["title"]: " ".join(t["expr"] for t in p["targets"])
              for p in dashboard()["panels"]}
    text = "\n".join(panels.values())
    for needed in ("sum by (code) (rate(opjit_rpc_calls_total", "histogram_quantile(0.5,",
                   "histogram_quantile(0.99,", "opjit_compiles_total",
                   "opjit_compile_failures_total", "opjit_cache_hits_total",
                   "opjit_cache_misses_total", "opjit_executor_workers",
                   "opjit_executor_worker_crashes_total", "opjit_quota_refusals_total",
                   "opjit_registry_store_up", "opjit_shm_bytes",
                   "opjit_cache_remote_errors_total", "opjit_cache_remote_rejected_total",
                   'code="UNAVAILABLE"'):
        assert needed in text, needed


def test_dashboard_queries_parse_and_name_only_series_the_daemon_exports(opsd, remoted,
                                                                       tmp_path):
    names = exported(opsd, remoted)
    queries = dashboard_queries(dashboard())
    rules = []
    for i, q in enumerate(queries):
        used = opjit_names(q)
        assert used or q.startswith("up{"), q
        assert used <= names, (q, used - names)
        if q.startswith("label_values("):
            continue  # Grafana's own function, not PromQL
        # promtool parses each query as a recording rule, Grafana's variables filled in.
        promql = q.replace("$__rate_interval", "5m").replace("$job", ".*").replace(
            "$instance", ".*")
        rules.append({"record": "opjit:dashboard_query_%d" % i, "expr": promql})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- README --------------------------------------------------------------------------------------

def readme_metric_rows():
    """{name: (type, set of labels)} from README.md's table of series:
    rows "| `name` | type | `label`, ... | meaning |"."""
    rows = {}
    with open(README) as f:
        for line in f:
            m = re.match(r"\|\s*`(opjit_[a-z0-9_]+)`\s*\|\s*(counter|gauge|histogram)\s*\|"
                         r"([^|]*)\|", line)
            if m:
                rows[m.group(1)] = (m.group(2), set(re.findall(r"`([a-z_]+)`", m.group(3))))
    return rows


def test_readme_documents_every_exported_family_with_its_type_and_labels(opsd, remoted):
    rows = readme_metric_rows()
    fams = families(opsd.text)
    fams.update(families(remoted.text))
    for name, (kind, labels) in fams.items():
        assert name in rows, "README.md does not document %s" % name
        assert rows[name][0] == kind, (name, rows[name][0], kind)
        assert labels == rows[name][1], (name, labels, rows[name][1])


# ---- a real Prometheus evaluating both -----------------------------------------------------------

def test_prometheus_evaluates_the_rules_and_the_dashboard_on_the_daemon(opsd, tmp_path):
    """Debian's prometheus scrapes this test's daemon every second with the
    shipped rules loaded: every rule evaluates without error, and every
    dashboard query is accepted (and the ones on always-present series
    return data)."""
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                   "rule_files: ['%s']\n"
                   "scrape_configs:\n  - job_name: opjit\n    static_configs:\n"
                   "      - targets: ['%s']\n" % (ALERTS, opsd.metrics))
    port = free_port()
    log_path = tmp_path / "prometheus.log"

    def api(path, **params):
        url = "http://127.0.0.1:%d/api/v1/%s?%s" % (port, path, urllib.parse.urlencode(params))
        try:
            return json.loads(urllib.request.urlopen(url, timeout=5).read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())
        except (OSError, ValueError):
            return None

    def wait(ok, what, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = ok()
            if got:
                return got
            time.sleep(0.5)
        raise AssertionError("%s:\n%s" % (what, log_path.read_text()[-3000:]))

    with open(log_path, "wb") as log:
        prom = subprocess.Popen(["prometheus", "--config.file", str(cfg), "--storage.tsdb.path",
                                 str(tmp_path / "data"), "--web.listen-address",
                                 "127.0.0.1:%d" % port], stdout=log, stderr=subprocess.STDOUT)
        try:
            # Three scrapes, so rates over them have two points or more.
            wait(lambda: (api("query", query='count_over_time(up{job="opjit"}[1m]) >= 3') or {})
                 .get("data", {}).get("result"), "prometheus did not scrape the daemon")
            query = api("query", query='up{job="opjit"}')
            assert query["data"]["result"][0]["value"][1] == "1", query

            def rules_evaluated():
                r = api("rules")
                rules = [x for g in (r or {}).get("data", {}).get("groups", [])
                         for x in g["rules"]]
                return rules if rules and all(x.get("lastEvaluation", "").startswith("2")
                                              and not x["lastEvaluation"].startswith("0001")
                                              for x in rules) else None
            rules = wait(rules_evaluated, "the rules were not evaluated")
            assert {x["name"] for x in rules} == {x["alert"] for x in alert_rules()}
            for x in rules:
                assert x["health"] == "ok", (x["name"], x.get("lastError"))
            # Nothing is wrong with this daemon: no alert fires or waits.
            firing = [x["name"] for x in rules if x["state"] != "inactive"]
            assert firing == [], firing

            nonempty = ("opjit_rpc_calls_total", "opjit_registry_store_up", "opjit_serving",
                        "opjit_compiles_total", "opjit_cache_hits_total",
                        "opjit_executor_worker_crashes_total", "opjit_rpc_latency_seconds")
            for q in dashboard_queries(dashboard()):
                if q.startswith("label_values("):
                    continue
                promql = q.replace("$__rate_interval", "1m").replace("$job", "opjit").replace(
                    "$instance", ".*")
                r = api("query", query=promql)
                assert r and r["status"] == "success", (q, r)
                # Queries that pick one status or transport may rightly be empty.
                if any(n in q for n in nonempty) and not re.search(r'\b(code|transport)="', q):
                    assert r["data"]["result"], ("no data", q)
        finally:
            prom.terminate()
            prom.wait(30)
