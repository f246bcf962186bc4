"""Issue 41, hole 6: a write answered with an error never lands later, even
when PostgreSQL's COMMIT hangs.

The hang: a throwaway PostgreSQL with synchronous_standby_names naming a
standby that does not exist and synchronous_commit = on, so a plain COMMIT
writes its commit record and then waits for that standby forever; cancelling
the wait (statement_timeout, a cancel request, a closed connection) does not
undo it, the write lands ("the transaction has already committed locally").
opjit's writes run with SET LOCAL synchronous_commit = local, so they do not
wait; an operator who opts in to replication waits (options=-c
synchronous_commit=on in the url) gets STORE_OUTCOME_UNKNOWN, never a
"refused" write that lands, and can ask by registering again.
"""

import os
import shutil
import subprocess
import tempfile
import time

import pytest

import opjit
from conftest import TempDaemon, unary_kernel, unary_spec
from services import PG_BIN, Postgres


def spec(name, factor):
    return unary_spec(name, unary_kernel("* %.1ff" % factor), namespace="default")


class Daemon(TempDaemon):
    def __init__(self, url):
        self.spawn('[registry]\nbackend = "postgres"\nurl = "%s"\npoll_ms = 200\n' % url,
                   prefix="opjit-commit-", serving=True)

    def client(self):
        return opjit.Client(self.unix_address, timeout=60, transport="inline")


def psql(pg, sql, timeout=None):
    return subprocess.run(
        [PG_BIN + "/psql", "-h", "127.0.0.1", "-p", str(pg.port), "-U", "opjit", "-d", "opjit",
         "-At", "-c", sql], capture_output=True, text=True, cwd="/", timeout=timeout)


def versions(pg, name):
    out = psql(pg, "SELECT version FROM opjit_op_versions WHERE name = '%s' ORDER BY version"
               % name)
    assert out.returncode == 0, out.stderr
    return [int(v) for v in out.stdout.split()]


@pytest.fixture
def hung_standby():
    """PostgreSQL whose plain COMMITs wait for a standby that is not there."""
    if not os.path.exists(os.path.join(PG_BIN, "pg_ctl")):
        pytest.skip("PostgreSQL 15 is not installed (deploy/install-deps.sh installs it)")
    root = tempfile.mkdtemp(prefix="opjit-commit-pg-")
    os.chmod(root, 0o755)
    pg = Postgres(root).start()
    try:
        pg.createdb("opjit")
        for sql in ("ALTER SYSTEM SET synchronous_standby_names = 'nonexistent'",
                    "ALTER SYSTEM SET synchronous_commit = 'on'", "SELECT pg_reload_conf()"):
            assert psql(pg, sql).returncode == 0
        # The hang is real: a plain write's COMMIT does not come back.
        with pytest.raises(subprocess.TimeoutExpired):
            psql(pg, "CREATE TABLE hang_probe (x int)", timeout=2)
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def register_all(d, name, n):
    """n registrations of `name`, each new content: (answers, seconds)."""
    answers = []
    t0 = time.monotonic()
    with d.client() as c:
        for i in range(n):
            try:
                r = c.register(spec(name, float(i + 2)))
                answers.append(("ok", r.record.version))
            except opjit.Unavailable as e:
                answers.append((e.reason, dict(e.metadata)))
    return answers, time.monotonic() - t0


def test_no_refused_write_lands_under_a_missing_synchronous_standby(hung_standby):
    pg = hung_standby
    base = ("host=127.0.0.1 port=%d dbname=opjit user=opjit connect_timeout=2 "
            "options='-c statement_timeout=3000%s'")

    # Default: opjit's transactions do not wait for the standby; all succeed.
    a = Daemon(base % (pg.port, ""))
    b = None
    try:
        answers, took = register_all(a, "local", 5)
        print("synchronous standby missing, default: %s in %.2f s" % (answers, took))
        assert answers == [("ok", v) for v in range(1, 6)], answers
        assert took < 15, took
        assert versions(pg, "local") == [1, 2, 3, 4, 5]
    finally:
        a.close()

    # Opted in to replication waits: each COMMIT hangs and is answered
    # STORE_OUTCOME_UNKNOWN at the bound, never STORE_UNAVAILABLE ("refused").
    a = Daemon(base % (pg.port, " -c synchronous_commit=on"))
    try:
        answers, took = register_all(a, "waits", 2)
        print("synchronous standby missing, opted in: %s in %.2f s" % (answers, took))
        for reason, meta in answers:
            assert reason == "STORE_OUTCOME_UNKNOWN", answers
            assert meta.get("op") == "waits" and meta.get("transaction"), meta
        refused = [x for x in answers if x[0] == "STORE_UNAVAILABLE"]
        assert not refused
        # They did land (the cancelled wait commits locally): the answer was
        # right not to say refused. Seen from the database and a second daemon.
        deadline = time.monotonic() + 10
        while versions(pg, "waits") != [1, 2] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert versions(pg, "waits") == [1, 2]
        b = Daemon(base % (pg.port, ""))
        with b.client() as c:
            assert c.describe("waits").version == 2
            # Asking: the same definition again answers with where it landed.
            again = c.register(spec("waits", 3.0))
            assert (again.created, again.record.version) == (False, 2)
        with b.client() as c:
            assert c.describe("local").version == 5
    finally:
        a.close()
        if b is not None:
            b.close()
