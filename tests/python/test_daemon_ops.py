"""Operating opjitd (issue 25): --version and --help, --check-config, SIGHUP
reloads, and what health, metrics and writes say while the registry's
PostgreSQL is down.

Every daemon here is the test's own (its own temp dir, state dir and unix
socket); the PostgreSQL is a throwaway one (tests/python/test_cluster.py's),
stopped and started again by the test.
"""

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

import numpy as np
import pytest

import opjit
from opjit import _fast
from opjit._proto import memory_pb2
from conftest import (REPO, TempDaemon, health, opjitd_binary, principal_toml, token_sha,
                      unary_kernel, unary_spec, wait_for)
from services import PG_BIN, Postgres

TOKENS = {"alice": "tok-alice-ops-0123456789", "bob": "tok-bob-ops-0123456789",
          "admin": "tok-admin-ops-0123456789", "carol": "tok-carol-ops-0123456789"}

STORE_SERVICE = "opjit.registry.store"


def spec(name, body, ns):
    return unary_spec(name, unary_kernel(body), namespace=ns)


def run_opjitd(*args, env=None):
    return subprocess.run([opjitd_binary()] + list(args), capture_output=True, text=True,
                          timeout=60, env=env)


# ---- --version and --help ------------------------------------------------------------------

def test_version_names_the_version_and_the_git_revision():
    r = run_opjitd("--version")
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"opjitd \d+\.\d+\.\d+ \(git [0-9a-z.+-]+\)\n", r.stdout), r.stdout
    assert run_opjitd("-V").stdout == r.stdout


def test_help_lists_every_flag_and_the_signals():
    r = run_opjitd("--help")
    assert r.returncode == 0 and r.stdout.startswith("Usage: opjitd"), r.stdout
    for flag in ("--config FILE", "--listen ADDR", "--state-dir DIR", "--log-level LEVEL",
                 "--isolation MODE", "--allow-insecure-tcp", "--check-config FILE",
                 "--verify-cache", "-V, --version", "-h, --help", "SIGHUP", "SIGTERM",
                 "Exit status"):
        assert flag in r.stdout, flag
    bad = run_opjitd("--no-such-flag")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "opjitd: unknown flag --no-such-flag (opjitd --help lists them)"


# ---- --check-config -------------------------------------------------------------------------

@pytest.fixture
def tmp():
    d = tempfile.mkdtemp(prefix="opjit-ops-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def check(tmp, text):
    path = os.path.join(tmp, "c.toml")
    with open(path, "w") as f:
        f.write(text)
    # A HOME and a state dir that do not exist: --check-config must create neither.
    env = dict(os.environ, HOME=os.path.join(tmp, "home"),
               OPJIT_STATE_DIR=os.path.join(tmp, "state"))
    r = run_opjitd("--check-config", path, env=env)
    assert not os.path.exists(os.path.join(tmp, "home"))
    assert not os.path.exists(os.path.join(tmp, "state"))
    assert not os.path.exists(os.path.join(tmp, "named-state"))
    return path, r


def test_check_config_accepts_the_shipped_config(tmp):
    with open(os.path.join(REPO, "deploy", "opjitd.toml")) as f:
        shipped = f.read()
    assert '\nstate_dir = "/var/lib/opjit"\n' in shipped  # the unit's
    shipped = shipped.replace('\nstate_dir = "/var/lib/opjit"\n',
                              '\nstate_dir = "%s"\n' % os.path.join(tmp, "named-state"))
    path, r = check(tmp, shipped + principal_toml("alice", "user", ["alice"], TOKENS["alice"]))
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(path + ": ok: 2 principal(s), registry sqlite"), \
        r.stdout


def test_check_config_names_a_syntax_error_by_line_and_column(tmp):
    # What a pasted `opjit token` line of old looked like.
    path, r = check(tmp, 'log_level = "info"\ntoken_sha256: ["%s"]\n' % token_sha("x"))
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 2, r.stderr
    assert lines[0].startswith(path + ":2:13: "), lines[0]
    assert lines[1] == path + ": 1 problem(s)"


def test_check_config_names_each_problem_by_line_and_key(tmp):
    path, r = check(tmp, "\n".join([
        'log_level = "info"',                   # 1
        "colour = true",                        # 2: unknown key
        "[quota]",                              # 3
        'ops = "many"',                         # 4: bad type
        "calls_per_second = -5",                # 5: bad range
        "[exec]",                               # 6
        "worker_count = 2",                     # 7: unknown key in a section
        "[[principal]]",                        # 8
        'name = "carol"',                       # 9
        'role = "superuser"',                   # 10: bad role
        'namespaces = ["c"]',                   # 11
        'token_sha256 = ["%s"]' % token_sha("c"),
        "[registry]",                           # 13
        'backend = "postgres"',                 # 14: needs url
    ]) + "\n")
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert lines[-1] == path + ": 6 problem(s)", r.stderr
    got = lines[:-1]
    assert got[0].startswith(path + ":2: colour: unknown key"), got
    assert got[1] == path + ":4: quota.ops: expected an integer", got
    assert got[2] == path + ":5: quota.calls_per_second: expected a non-negative number", got
    assert got[3].startswith(path + ":7: exec.worker_count: unknown key"), got
    assert got[4].startswith(path + ":10: principal[0].role: expected \"admin\""), got
    assert got[5].startswith(path + ":14: registry.url: registry.backend = \"postgres\" needs"), \
        got
    assert token_sha("c") not in r.stderr


def test_a_daemon_started_on_a_bad_config_prints_the_same_problems(tmp):
    path = os.path.join(tmp, "c.toml")
    with open(path, "w") as f:
        f.write("[exec]\nworkers = 0\n")
    r = run_opjitd("--config", path, "--state-dir", os.path.join(tmp, "state"))
    assert r.returncode == 2
    assert r.stderr == "opjitd: %s:2: exec.workers: expected an integer >= 1, not 0\n" % path
    assert not os.path.exists(os.path.join(tmp, "state"))


# ---- SIGHUP ---------------------------------------------------------------------------------

class OpsDaemon(TempDaemon):
    def __init__(self, config):
        self.spawn(config, prefix="opjit-ops-")
        self.config = self.config_path

    def write_config(self, text):
        tmp = self.config + ".new"
        with open(tmp, "w") as f:
            f.write(text)
        os.rename(tmp, self.config)

    def client(self, who, namespace, **kw):
        return opjit.Client(self.unix_address, namespace=namespace, token=TOKENS[who],
                            timeout=60, **kw)

    def hup(self, expect):
        """SIGHUP, then waits for the log line that ends the reload."""
        before = self.read_log().count(expect)
        self.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: self.read_log().count(expect) > before or self.proc.poll() is not None,
                 30, "%r in the log" % expect)
        assert self.proc.poll() is None, "opjitd died on SIGHUP:\n" + self.read_log()[-3000:]


def config(principals, calls_per_second, log_level, exec_workers=2):
    return ('log_level = "%s"\n[health]\ninterval_ms = 200\n[quota]\ncalls_per_second = %g\n'
            "[exec]\nworkers = %d\n" % (log_level, calls_per_second, exec_workers) +
            "".join(principals))


ALICE = principal_toml("alice", "user", ["alice"], TOKENS["alice"])
BOB = principal_toml("bob", "user", ["bob"], TOKENS["bob"])


def test_sighup_reloads_principals_quotas_and_log_level():
    d = OpsDaemon(config([ALICE], 1000, "info"))
    try:
        with d.client("alice", "alice", transport="inline") as c:
            c.register(spec("twice", "* 2.0f", "alice"))
            np.testing.assert_allclose(c.op("twice")(np.ones(2, np.float32)), 2.0)
        with pytest.raises(opjit.Unauthenticated):
            with d.client("bob", "bob", transport="inline") as c:
                c.register(spec("thrice", "* 3.0f", "bob"))
        assert " debug " not in d.read_log()

        # bob added, a lower quota, debug logging, and a key that needs a restart.
        d.write_config(config([ALICE, BOB], 3, "debug", exec_workers=3))
        d.hup("reloaded: 3 change(s) applied, 1 need a restart")
        log = d.read_log()
        assert 'reload: principal "bob" added (role user, namespaces [bob], 1 token(s)' in log
        assert "reload: quota.calls_per_second: 1000 -> 3" in log
        assert "reload: log_level: info -> debug" in log
        assert "reload: changed but not applied until a restart: exec.workers" in log
        for secret in TOKENS.values():
            assert secret not in log and token_sha(secret) not in log

        with d.client("bob", "bob", transport="inline") as c:
            c.register(spec("thrice", "* 3.0f", "bob"))
            np.testing.assert_allclose(c.op("thrice")(np.ones(2, np.float32)), 3.0)
        with d.client("alice", "alice", transport="inline") as c:
            f = c.op("twice")
            with pytest.raises(opjit.ResourceExhausted) as e:
                for _ in range(50):
                    f(np.ones(2, np.float32))
            assert (e.value.metadata["quota"], e.value.metadata["limit"]) == \
                ("calls_per_second", "3")
        assert " debug [" in d.read_log()  # e.g. bob's executor starting, at debug
        assert health(d.unix_address) == "SERVING"

        # A broken file changes nothing: bob stays, the daemon serves on.
        d.write_config(config([ALICE], 1000, "info") + "[quota\n")
        d.hup("the running configuration stays")
        assert re.search(r"reload: .*c\.toml:\d+:\d+: ", d.read_log()), d.read_log()[-2000:]
        with d.client("bob", "bob", transport="inline") as c:
            np.testing.assert_allclose(c.op("thrice")(np.ones(2, np.float32)), 3.0)
        # Neither does a file that would drop every principal (a restart's job).
        d.write_config(config([], 1000, "info"))
        d.hup("the running configuration stays")
        with d.client("bob", "bob", transport="inline") as c:
            np.testing.assert_allclose(c.op("thrice")(np.ones(2, np.float32)), 3.0)

        # bob removed, the quota lifted: bob's token stops working at once.
        d.write_config(config([ALICE], 0, "debug", exec_workers=3))
        d.hup("reloaded: 2 change(s) applied, 1 need a restart")
        assert 'reload: principal "bob" removed' in d.read_log()
        with pytest.raises(opjit.Unauthenticated):
            with d.client("bob", "bob", transport="inline") as c:
                c.op("thrice")(np.ones(2, np.float32))
        with d.client("alice", "alice", transport="inline") as c:
            f = c.op("twice")
            for _ in range(50):
                f(np.ones(2, np.float32))
        assert health(d.unix_address) == "SERVING"
        assert d.proc.poll() is None
    finally:
        d.close()
    assert d.proc.returncode == 0, d.read_log()[-3000:]


def regions_of(d, ns):
    """The names of every region in `ns`, as the daemon's own uid (admin) lists them."""
    with opjit.Client(d.unix_address, namespace=ns, timeout=30, fast="off") as admin:
        listed = admin._memory.ListRegions(memory_pb2.ListRegionsRequest(namespace=ns))
        return sorted(r.name for r in listed.regions)


@pytest.mark.skipif(not _fast.supported(), reason="the fast channel is x86-64 Linux only")
def test_sighup_revokes_what_a_removed_principal_holds():
    carol = lambda namespaces: principal_toml("carol", "user", namespaces, TOKENS["carol"])
    d = OpsDaemon(config([ALICE, carol(["carol", "carol2"])], 1000, "info"))
    clients = []
    try:
        calls = {}
        for ns in ("carol", "carol2"):
            c = d.client("carol", ns, fast="on")
            clients.append(c)
            c.register(spec("twice", "* 2.0f", ns))
            calls[ns] = c.op("twice").prepare(np.ones(4, np.float32))
            np.testing.assert_allclose(calls[ns](), 2.0)
            assert calls[ns].path == "fast"
            assert any(r.startswith("opjit-channel-") for r in regions_of(d, ns))

        # carol loses one namespace: what she held there goes, the other stays.
        d.write_config(config([ALICE, carol(["carol2"])], 1000, "info"))
        d.hup("reloaded: 1 change(s) applied")
        assert 'principal "carol" revoked in every namespace but [carol2]: 1 fast channel(s) ' \
               'closed' in d.read_log()
        assert regions_of(d, "carol") == []
        with pytest.raises(opjit.NotFound) as e:
            calls["carol"]()  # its channel closed: reopening it meets access control
        assert e.value.reason == "NAMESPACE_NOT_FOUND"
        np.testing.assert_allclose(calls["carol2"](), 2.0)
        assert calls["carol2"].path == "fast"

        # carol removed: her open channel closes at once, her regions go.
        d.write_config(config([ALICE], 1000, "info"))
        d.hup("reloaded: 1 change(s) applied")
        assert 'principal "carol" revoked in every namespace: 1 fast channel(s) closed' in \
            d.read_log()
        assert regions_of(d, "carol2") == []
        with pytest.raises(opjit.Unauthenticated) as e:
            calls["carol2"]()
        assert e.value.reason == "UNAUTHENTICATED"
        assert health(d.unix_address) == "SERVING"
    finally:
        for c in clients:
            try:
                c.close()
            except opjit.OpjitError:
                pass
        d.close()


def test_sighup_without_a_config_file_reloads_nothing_and_keeps_serving():
    d = TempDaemon()
    d.spawn(None, prefix="opjit-ops-")
    try:
        for i in range(1, 4):  # one at a time: pending SIGHUPs merge into one
            d.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: d.read_log().count("nothing to reload") == i, 30,
                     "reload line %d" % i)
        assert d.proc.poll() is None
        assert health(d.unix_address) == "SERVING"
        with opjit.Client(d.unix_address, timeout=30) as c:
            c.info()
    finally:
        d.close()
    assert d.proc.returncode == 0
    assert not os.path.exists(os.path.join(d.state, "endpoints"))


# ---- the registry store's health ------------------------------------------------------------

def scrape(address):
    with urllib.request.urlopen("http://%s/metrics" % address, timeout=10) as r:
        return r.read().decode()


def gauge(text, name):
    m = re.search(r"^%s (\S+)$" % re.escape(name), text, re.M)
    return float(m.group(1)) if m else None


def test_a_local_store_that_cannot_be_written_drains_the_whole_daemon():
    d = OpsDaemon('[health]\ninterval_ms = 200\n[metrics]\nlisten = "127.0.0.1:0"\n')
    try:
        assert health(d.unix_address) == "SERVING"
        assert health(d.unix_address, STORE_SERVICE) == "SERVING"
        assert health(d.unix_address, "opjit.no.such.service") == "NOT_FOUND"
        metrics = d.metrics_address()
        text = scrape(metrics)
        assert gauge(text, "opjit_registry_store_up") == 1
        assert gauge(text, "opjit_serving") == 1
        # registry.db cannot grow (a file-size limit on the daemon): this host's disk.
        pid = str(d.proc.pid)
        subprocess.run(["prlimit", "--pid", pid, "--fsize=1:"], check=True)
        try:
            wait_for(lambda: health(d.unix_address) == "NOT_SERVING", 30, "NOT_SERVING")
            assert health(d.unix_address, STORE_SERVICE) == "NOT_SERVING"
            text = scrape(metrics)
            assert (gauge(text, "opjit_registry_store_up"), gauge(text, "opjit_serving")) == (0, 0)
        finally:
            subprocess.run(["prlimit", "--pid", pid, "--fsize=unlimited:"], check=True)
        # Both come back, the named service too (gRPC's "set all" must not leave it behind).
        wait_for(lambda: health(d.unix_address) == "SERVING", 30, "SERVING again")
        wait_for(lambda: health(d.unix_address, STORE_SERVICE) == "SERVING", 30,
                 "the store service SERVING again")
        assert gauge(scrape(metrics), "opjit_registry_store_up") == 1
        assert "registry store writable again" in d.read_log()
    finally:
        d.close()


@pytest.fixture
def postgres():
    if not os.path.exists(os.path.join(PG_BIN, "pg_ctl")):
        pytest.skip("PostgreSQL 15 is not installed (deploy/install-deps.sh installs it)")
    root = tempfile.mkdtemp(prefix="opjit-ops-pg-")
    os.chmod(root, 0o755)
    pg = Postgres(root).start()
    pg.createdb("opjit")
    yield pg
    pg.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_postgres_down_refuses_writes_serves_calls_and_says_so(postgres):
    d = OpsDaemon('[health]\ninterval_ms = 200\n[metrics]\nlisten = "127.0.0.1:0"\n'
                  '[registry]\nbackend = "postgres"\nurl = "%s"\npoll_ms = 500\n'
                  % postgres.url("opjit"))
    try:
        metrics = d.metrics_address()
        with opjit.Client(d.unix_address, timeout=60, transport="inline") as c:
            c.register(spec("twice", "* 2.0f", "default"))
            np.testing.assert_allclose(c.op("twice")(np.ones(2, np.float32)), 2.0)
        assert health(d.unix_address) == "SERVING"
        assert health(d.unix_address, STORE_SERVICE) == "SERVING"
        assert gauge(scrape(metrics), "opjit_registry_store_up") == 1

        postgres.stop()
        wait_for(lambda: health(d.unix_address, STORE_SERVICE) == "NOT_SERVING", 30,
                 "the store service to say NOT_SERVING")
        text = scrape(metrics)
        assert gauge(text, "opjit_registry_store_up") == 0
        assert gauge(text, "opjit_serving") == 1
        assert health(d.unix_address) == "SERVING"  # calls still work: no balancer drains it
        with opjit.Client(d.unix_address, timeout=60, transport="inline") as c:
            np.testing.assert_allclose(c.op("twice")(np.ones(3, np.float32)), 2.0)
            assert c.describe("twice")  # reads come from the registry in memory
            t0 = time.monotonic()
            with pytest.raises(opjit.Unavailable) as e:
                c.register(spec("thrice", "* 3.0f", "default"))
            assert e.value.reason == "STORE_UNAVAILABLE", e.value
            assert time.monotonic() - t0 < 30  # refused, not hung
            assert "host=" not in e.value.message and "port=" not in e.value.message
        assert "registry store cannot be written" in d.read_log()

        postgres.restart()
        wait_for(lambda: health(d.unix_address, STORE_SERVICE) == "SERVING", 60,
                 "the store service to say SERVING again")
        assert gauge(scrape(metrics), "opjit_registry_store_up") == 1
        with opjit.Client(d.unix_address, timeout=60, transport="inline") as c:
            c.register(spec("thrice", "* 3.0f", "default"))
            np.testing.assert_allclose(c.op("thrice")(np.ones(2, np.float32)), 3.0)
        assert "registry store writable again" in d.read_log()
        assert d.proc.poll() is None
    finally:
        d.close()


def _pg_processes(pg):
    """The server's postmaster and the processes it started."""
    with open(os.path.join(pg.data, "postmaster.pid")) as f:
        postmaster = int(f.readline())
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == postmaster:
            children.append(int(entry))
    return postmaster, children


def _stopped(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "TtZX"
    except OSError:
        return True


def test_postgres_frozen_write_fails_fast_and_never_lands(postgres):
    """Issue 26: with every PostgreSQL process stopped (SIGSTOP: connections are
    accepted, nothing answers), a registration is refused with STORE_UNAVAILABLE
    within the url's bound (3 s) instead of hanging, the daemon logs the hang,
    calls go on; once the server runs again the refused registration never
    appears, and registering works again."""
    url = ("host=127.0.0.1 port=%d dbname=opjit user=opjit connect_timeout=2 "
           "options='-c statement_timeout=3000'" % postgres.port)
    d = OpsDaemon('[health]\ninterval_ms = 200\n'
                  '[registry]\nbackend = "postgres"\nurl = "%s"\npoll_ms = 500\n' % url)
    frozen = []
    try:
        with opjit.Client(d.unix_address, timeout=60, transport="inline") as c:
            c.register(spec("twice", "* 2.0f", "default"))
            postmaster, children = _pg_processes(postgres)
            for pid in [postmaster] + children:
                os.kill(pid, signal.SIGSTOP)
                frozen.append(pid)
            wait_for(lambda: all(_stopped(p) for p in frozen), 10, "PostgreSQL to stop")

            t0 = time.monotonic()
            with pytest.raises(opjit.Unavailable) as e:
                c.register(spec("frozen", "* 5.0f", "default"))
            took = time.monotonic() - t0
            print("register with PostgreSQL frozen: refused after %.2f s" % took)
            assert e.value.reason == "STORE_UNAVAILABLE", e.value
            assert took < 15, took
            assert "host=" not in e.value.message and "port=" not in e.value.message
            np.testing.assert_allclose(c.op("twice")(np.ones(3, np.float32)), 2.0)
            wait_for(lambda: health(d.unix_address, STORE_SERVICE) == "NOT_SERVING", 30,
                     "the store service to say NOT_SERVING")
            assert health(d.unix_address) == "SERVING"
            assert "PostgreSQL has not answered for" in d.read_log()

            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
            frozen.clear()
            time.sleep(3)
            rows = subprocess.run(
                [PG_BIN + "/psql", "-h", "127.0.0.1", "-p", str(postgres.port), "-U", "opjit",
                 "-d", "opjit", "-At", "-c",
                 "SELECT count(*) FROM opjit_op_versions WHERE name = 'frozen'"],
                check=True, capture_output=True, text=True, cwd="/").stdout.strip()
            assert rows == "0", "the refused registration landed later"
            wait_for(lambda: health(d.unix_address, STORE_SERVICE) == "SERVING", 60,
                     "the store service to say SERVING again")
            c.register(spec("frozen", "* 5.0f", "default"))
            np.testing.assert_allclose(c.op("frozen")(np.ones(2, np.float32)), 5.0)
            assert c.describe("frozen").version == 1  # nothing of the refused one was kept
        assert d.proc.poll() is None
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        d.close()
