"""Several daemons sharing one PostgreSQL registry and one Redis cache tier.

A throwaway PostgreSQL (initdb + pg_ctl, run as `nobody`: PostgreSQL refuses
root) and a Redis, both on loopback in a temp dir, and three opjitd daemons
configured with [registry] backend = "postgres" and [cache.remote]. Checks:

- an op registered through one daemon is visible and runnable on the others,
  within the bound the registry states (NOTIFY, else poll_ms);
- a kernel compiled by one daemon is a cache-tier hit on the others (timings
  are printed: run with -s, or see the ctest log);
- concurrent registrations of one op through all three agree on versions;
- kill -9 of a daemon mid-registration loses nothing acknowledged;
- Redis killed mid-run degrades to local compiles with no failed call.

The daemons share one module-scoped cluster; the tests run in file order and
the last one kills Redis.
"""

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import numpy as np
import pytest

import opjit
from conftest import TempDaemon, opjitd_binary, wait_for
from services import PG_BIN, REDIS, Postgres, Redis

POLL_MS = 500  # the daemons' [registry] poll_ms: the bound when a NOTIFY is lost


class Node(TempDaemon):
    """One opjitd of the cluster, with its own state dir and unix socket; it
    can be stopped and started again."""

    def __init__(self, root, name, config_path):
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir)
        self.state = os.path.join(self.dir, "state")
        self.address = self.unix_address = "unix:" + os.path.join(self.dir, "s.sock")
        self.config = config_path
        self.proc = None

    def start(self):
        self.log = open(os.path.join(self.dir, "log"), "ab")
        ep = os.path.join(self.state, "endpoints")
        if os.path.exists(ep):
            os.unlink(ep)
        self.proc = subprocess.Popen(
            [opjitd_binary(), "--state-dir", self.state, "--config", self.config,
             "--listen", self.address],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(lambda: self.answers() and os.path.exists(ep), 60,
                 "opjitd in %s to serve" % self.dir)
        return self

    def client(self):
        return opjit.Client(self.address, timeout=120)

    def read_log(self):
        with open(os.path.join(self.dir, "log"), "rb") as f:
            return f.read().decode(errors="replace")[-6000:]

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Cluster:
    def __init__(self):
        # Short path (unix sockets), traversable by `nobody` (PostgreSQL).
        self.root = tempfile.mkdtemp(prefix="opjit-cl-")
        os.chmod(self.root, 0o755)
        self.pg = Postgres(self.root)
        self.redis = Redis(self.root)
        self.nodes = []

    def start(self, n=3):
        self.pg.start()
        self.pg.createdb("opjit")
        self.redis.start()
        key = os.path.join(self.root, "cluster.key")
        with open(key, "wb") as f:
            f.write(os.urandom(32))
        os.chmod(key, 0o600)
        config = os.path.join(self.root, "opjitd.toml")
        with open(config, "w") as f:
            f.write('[registry]\nbackend = "postgres"\nurl = "%s"\npoll_ms = %d\n\n'
                    '[cache.remote]\nurl = "redis://127.0.0.1:%d"\nkey_file = "%s"\n'
                    'timeout_ms = 200\n'
                    % (self.pg.url("opjit"), POLL_MS, self.redis.port, key))
        for i in range(n):
            self.nodes.append(Node(self.root, "d%d" % i, config))
        # All three at once: schema creation must not race.
        errors = []
        threads = [threading.Thread(target=_capture, args=(errors, n.start)) for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return self

    def close(self):
        for n in self.nodes:
            n.stop()
        self.redis.close()
        self.pg.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def _capture(errors, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (re-raised by the caller)
        errors.append(e)


def kernel(factor, entry="Scale"):
    return r'''
#include <cstdint>
extern "C" int %s(int nparam, void** params, int* ndims, int64_t** shapes,
                  const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * %.6ff;
  return 0;
}
''' % (entry, factor)


def spec(name, factor):
    return {
        "name": name,
        "inputs": [{"index": 0, "name": "x", "param_type": "required"}],
        "outputs": [{"index": 0, "name": "y", "param_type": "required"}],
        "dtype_formats": [{"dtypes": ["float32", "float32"]}],
        "implementations": [{"target": "CPU", "language": "c++", "source": kernel(factor),
                             "entry": "Scale"}],
        "output_rules": [{"kind": "same_as", "input": 0}],
    }


X = np.arange(1, 9, dtype=np.float32).reshape(2, 4)


@pytest.fixture(scope="module")
def cluster():
    for path in (PG_BIN + "/initdb", PG_BIN + "/pg_ctl", REDIS):
        if not os.access(path, os.X_OK):
            pytest.fail("%s is missing: run deploy/install-deps.sh (postgresql-15, "
                        "redis-server)" % path)
    c = Cluster()
    try:
        c.start()
    except Exception:
        logs = "\n".join("--- %s\n%s" % (n.dir, n.read_log()) for n in c.nodes
                         if os.path.exists(os.path.join(n.dir, "log")))
        c.close()
        raise AssertionError("cluster did not start:\n" + logs)
    yield c
    c.close()


def test_registration_is_visible_and_runnable_everywhere(cluster):
    d0, d1, d2 = cluster.nodes
    with d0.client() as c0:
        rec = c0.register(spec("scale2", 2.0)).record
    t0 = time.monotonic()
    seen = {}
    for node in (d1, d2):
        with node.client() as c:
            def visible():
                try:
                    return c.describe("scale2").version == rec.version
                except opjit.NotFound:
                    return False
            wait_for(visible, POLL_MS / 1000.0 + 2.0, "scale2 on " + node.dir)
            seen[node.dir] = time.monotonic() - t0
            np.testing.assert_allclose(c.op("scale2")(X), 2.0 * X)
    print("\nregistration visible on the other daemons after: %s"
          % ", ".join("%.0f ms" % (1000 * v) for v in seen.values()))


def test_kernel_compiled_once_is_a_tier_hit_on_the_others(cluster):
    d0, d1, d2 = cluster.nodes
    name = "tier_%d" % os.getpid()
    with d0.client() as c0:
        # Registration may compile already: the clock covers it and the call.
        before0 = c0.cache_stats()
        t = time.monotonic()
        c0.register(spec(name, 3.5))
        np.testing.assert_allclose(c0.op(name)(X), 3.5 * X)
        first_ms = 1000 * (time.monotonic() - t)
        after0 = c0.cache_stats()
        assert after0.remote_enabled
        # Puts are asynchronous: wait until d0's artifacts are in the tier.
        wait_for(lambda: c0.cache_stats().remote_puts > before0.remote_puts, 10,
                 "d0 to write its artifacts to the tier")
        time.sleep(0.2)
    timings = {"d0 (register + compile + call)": first_ms}
    for node in (d1, d2):
        with node.client() as c:
            wait_for(lambda c=c: _has(c, name), POLL_MS / 1000.0 + 2.0, name + " visible")
            b = c.cache_stats()
            t = time.monotonic()
            np.testing.assert_allclose(c.op(name)(X), 3.5 * X)
            timings[os.path.basename(node.dir) + " (tier)"] = 1000 * (time.monotonic() - t)
            a = c.cache_stats()
            assert a.remote_hits > b.remote_hits, (b, a)
            assert a.compiles == b.compiles, "the kernel was compiled again on %s" % node.dir
            assert a.remote_rejected == b.remote_rejected
    assert after0.compiles > before0.compiles  # d0 really compiled it
    print("\nfirst call, cold: " + ", ".join("%s %.0f ms" % kv for kv in timings.items()))


def test_concurrent_registrations_agree_on_versions(cluster):
    nodes = cluster.nodes
    clients = [n.client() for n in nodes]
    try:
        # The same definition through all three at once: one version, created once.
        barrier = threading.Barrier(len(nodes))
        results, errors = [None] * len(nodes), []

        def same(i):
            try:
                barrier.wait()
                results[i] = clients[i].register(spec("race_same", 1.5))
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        ts = [threading.Thread(target=same, args=(i,)) for i in range(len(nodes))]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert not errors, errors
        assert len({r.record.version for r in results}) == 1, results
        assert sum(r.created for r in results) == 1

        # Different definitions, three rounds through all three at once:
        # distinct versions 1..9, and every daemon ends with the same list.
        rounds, acked = 3, []
        lock = threading.Lock()

        def diff(i, r):
            try:
                barrier.wait()
                rec = clients[i].register(spec("race_diff", 10 + 10 * r + i)).record
                with lock:
                    acked.append((rec.version, rec.content_hash))
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        for r in range(rounds):
            ts = [threading.Thread(target=diff, args=(i, r)) for i in range(len(nodes))]
            [t.start() for t in ts]
            [t.join() for t in ts]
        assert not errors, errors
        versions = sorted(v for v, _ in acked)
        assert versions == list(range(1, rounds * len(nodes) + 1)), versions
        want = sorted(acked)

        def listing(c):
            return sorted((o.version, o.content_hash)
                          for o in c.ops(all_versions=True) if o.op.name == "race_diff")
        for c in clients:
            wait_for(lambda c=c: listing(c) == want, POLL_MS / 1000.0 + 2.0,
                     "every daemon to list the same versions")
    finally:
        for c in clients:
            c.close()


def test_kill_9_mid_registration_loses_nothing_acknowledged(cluster):
    d0, d1, d2 = cluster.nodes
    acked, stop = [], threading.Event()

    def writer():
        try:
            with d2.client() as c:
                i = 0
                while not stop.is_set():
                    rec = c.register(spec("crashy", 100 + i)).record
                    acked.append((rec.version, rec.content_hash))
                    i += 1
        except opjit.OpjitError:
            pass  # the daemon died under us: expected
    t = threading.Thread(target=writer)
    t.start()
    wait_for(lambda: len(acked) >= 5, 60, "a few registrations through d2")
    d2.proc.send_signal(signal.SIGKILL)
    d2.proc.wait()
    stop.set()
    t.join(60)
    assert not t.is_alive()
    assert acked
    with d0.client() as c0:
        def all_there():
            have = {(o.version, o.content_hash) for o in c0.ops(all_versions=True)
                    if o.op.name == "crashy"}
            return set(acked) <= have
        wait_for(all_there, POLL_MS / 1000.0 + 2.0, "every acknowledged version on d0")
        for version, content_hash in acked:
            rec = c0.describe("crashy", version)
            assert rec.content_hash == content_hash
        latest = c0.describe("crashy")
        np.testing.assert_allclose(c0.op("crashy", version=acked[-1][0])(X),
                                   (100 + len(acked) - 1) * X, rtol=1e-6)
    d2.start()  # same state dir, after a kill -9
    with d2.client() as c2:
        have = {(o.version, o.content_hash) for o in c2.ops(all_versions=True)
                if o.op.name == "crashy"}
        assert set(acked) <= have
        assert c2.describe("crashy").version == latest.version


def test_redis_killed_mid_run_degrades_to_local_compiles(cluster):
    d0, d1, d2 = cluster.nodes
    failures, calls, stop = [], [0], threading.Event()

    def caller():
        with d1.client() as c:
            op = c.op("scale2")
            while not stop.is_set():
                try:
                    np.testing.assert_allclose(op(X), 2.0 * X)
                    calls[0] += 1
                except Exception as e:  # noqa: BLE001
                    failures.append(e)
    t = threading.Thread(target=caller)
    t.start()
    try:
        wait_for(lambda: calls[0] > 10, 30, "calls on d1")
        cluster.redis.kill()
        name = "after_redis_%d" % os.getpid()
        with d0.client() as c0:
            c0.register(spec(name, 7.0))
        for node in (d0, d1, d2):
            with node.client() as c:
                wait_for(lambda c=c: _has(c, name), POLL_MS / 1000.0 + 2.0, name + " visible")
                before = c.cache_stats()
                np.testing.assert_allclose(c.op(name)(X), 7.0 * X)
                after = c.cache_stats()
                # A local compile (or the local disk/memory), never a failure.
                assert after.remote_hits == before.remote_hits
        n_before = calls[0]
        wait_for(lambda: calls[0] > n_before + 10, 30, "calls on d1 to go on")
    finally:
        stop.set()
        t.join(60)
    assert not failures, failures[:3]
    with d0.client() as c0:
        assert c0.cache_stats().remote_errors > 0


def _has(c, name):
    try:
        c.describe(name)
        return True
    except opjit.NotFound:
        return False
