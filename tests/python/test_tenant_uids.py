"""A uid per namespace and caps on threads (issues 27 and 41).

On a root daemon, each namespace's executors run as a uid (and gid) of their
own from [exec] uid_range; on a non-root daemon with subordinate ids (as the
package sets up), as one of those (SubuidDaemon). Never the daemon's nor
nobody's, with no supplementary groups; the executor's scratch tmpfs is that
uid's, mode 0700. Two daemons on one host never give their tenants one uid
(each claims its uids host-wide, [exec] uid_claim_dir; a dead daemon's go
back at once): with the default config their first namespaces run as two
uids, and one tenant's threads no longer fill another daemon's tenant's
RLIMIT_NPROC. A kernel in bob's namespace that starts 1,500 sleeping
threads per call is held to [exec] threads_per_namespace (RLIMIT_NPROC of
bob's uid: its pthread_create gets EAGAIN); a pool call that leaves more
than threads_per_executor answers RESOURCE_EXHAUSTED and its executor is
replaced, and a fast channel's executor over the cap is stopped once the
call ends; alice's executor and calls, and the daemon, are untouched. An
idle executor whose kernel's threads go on starting threads after the call
is stopped within a bounded time with no other call, charged to no kernel.
A used-up range (or one other daemons claimed) refuses a new namespace
(RESOURCE_EXHAUSTED) rather than share a uid. A daemon that is not root says
in its log that tenants are not apart by uid.
"""

import errno
import fcntl
import hashlib
import os
import pwd
import re
import shutil
import struct
import time
import urllib.request

import numpy as np
import pytest

import opjit

from conftest import TempDaemon, health, unary_kernel, unary_spec, wait_for
from test_tenant_walls import N as PROBE_N
from test_tenant_walls import ATTACKS, PROBE, NobodyDaemon, SubuidDaemon, executors
from test_tenant_walls import subuid_claims_dir

NOBODY = pwd.getpwnam("nobody").pw_uid
FIRST, LAST = 1879048192, 1879113727  # the documented default exec.uid_range
PER_EXECUTOR, PER_NAMESPACE = 256, 1024  # the documented defaults
BOMB_THREADS = 1500

# Starts x[0] threads (64 KiB stacks) that sleep for ever; y[0]: how many
# started, y[1]: the errno of the first that did not (0: none failed).
BOMB = r"""#include <cstdint>
#include <pthread.h>
#include <unistd.h>

static void* Sleep(void*) {
  for (;;) pause();
  return nullptr;
}

extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  const int want = static_cast<int>(x[0]);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 64 << 10);
  int started = 0, failed = 0;
  for (int i = 0; i < want; ++i) {
    pthread_t t;
    const int rc = pthread_create(&t, &attr, Sleep, nullptr);
    if (rc != 0) {
      failed = rc;
      break;
    }
    pthread_detach(t);
    ++started;
  }
  pthread_attr_destroy(&attr);
  y[0] = static_cast<float>(started);
  y[1] = static_cast<float>(failed);
  return 0;
}
"""


# Starts, from a thread of its own that outlives the call, x[0] threads
# (64 KiB stacks) that sleep for ever, x[1] ms after the call: the call's
# end sees few threads, the idle executor then holds many. y[0]: 1 when the
# thread was started (x[0] > 0).
LATE = r"""#include <cstdint>
#include <pthread.h>
#include <unistd.h>

static void* Sleep(void*) {
  for (;;) pause();
  return nullptr;
}

struct Late {
  int n, ms;
};

static void* Spawn(void* arg) {
  const Late late = *static_cast<Late*>(arg);
  delete static_cast<Late*>(arg);
  usleep(late.ms * 1000);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 64 << 10);
  for (int i = 0; i < late.n; ++i) {
    pthread_t t;
    if (pthread_create(&t, &attr, Sleep, nullptr) != 0) break;
    pthread_detach(t);
  }
  for (;;) pause();
  return nullptr;
}

extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  for (int i = 0; i < 8; ++i) y[i] = 0;
  if (x[0] <= 0) return 0;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 64 << 10);
  pthread_t t;
  if (pthread_create(&t, &attr, Spawn, new Late{static_cast<int>(x[0]), static_cast<int>(x[1])}) == 0) {
    pthread_detach(t);
    y[0] = 1;
  }
  pthread_attr_destroy(&attr);
  return 0;
}
"""


def status_of(pid):
    """/proc/<pid>/status as {field: value}."""
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def namespace_of(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    for i, a in enumerate(argv[:-1]):
        if a == b"--namespace":
            return argv[i + 1].decode()
    return None


def executors_of(daemon_pid, ns):
    return {pid for pid in executors(daemon_pid) if namespace_of(pid) == ns}


def threads_of(pids):
    """{pid: threads} of those still alive."""
    out = {}
    for pid in pids:
        try:
            out[pid] = int(status_of(pid)["Threads"])
        except (OSError, KeyError):
            pass
    return out


@pytest.fixture
def root_daemon():
    if os.geteuid() != 0:
        pytest.skip("a uid per namespace needs a root daemon; run as root")
    d = TempDaemon()
    d.spawn("", prefix="opjit-tu-", serving=True)
    yield d
    d.close()


@pytest.fixture(params=["root", "subuid"], ids=["root_daemon", "non_root_daemon_with_subuids"])
def uid_daemon(request):
    """A daemon that gives each namespace a uid of its own: as root from
    [exec] uid_range (gid = uid), or as nobody from its subordinate ids
    (SubuidDaemon: uid = first + k, gid = gid_first + k). d.ids(uid) is the
    gid that goes with uid, None outside its range."""
    if os.geteuid() != 0:
        pytest.skip("a uid per namespace needs a root daemon, and the subordinate-id case "
                    "starts one as nobody; run as root")
    if request.param == "root":
        d = TempDaemon()
        d.spawn("", prefix="opjit-tu-", serving=True)
        d.gid_of = lambda uid: uid if FIRST <= uid <= LAST else None
    else:
        d = SubuidDaemon()
        d.gid_of = lambda uid: (d.gid_first + uid - d.first
                                if d.first <= uid < d.first + d.count else None)
        log = wait_for(lambda: "subordinate uid per namespace" in d.read_log() and d.read_log(),
                       30, "the daemon to say it uses its subordinate ids")
        assert "WARNING" not in log or "not apart by uid" not in log, log[-2000:]
    d.kind = request.param
    yield d
    d.close()


def test_each_namespace_runs_as_a_uid_of_its_own(uid_daemon):
    d = uid_daemon
    c = opjit.Client(d.unix_address, timeout=120, fast="off")
    x = np.arange(8, dtype=np.float32)
    for ns in ("alice", "bob"):
        c.register(unary_spec("twice", unary_kernel(), namespace=ns))
        np.testing.assert_array_equal(c.op(ns + "/twice")(x), 2 * x)
    ids = {}
    for ns in ("alice", "bob"):
        pids = wait_for(lambda: executors_of(d.proc.pid, ns), 30, ns + "'s executor")
        for pid in pids:
            st = status_of(pid)
            uids = set(int(u) for u in st["Uid"].split())
            gids = set(int(g) for g in st["Gid"].split())
            assert len(uids) == 1 and len(gids) == 1, st  # real, effective, saved, fs
            uid = uids.pop()
            assert d.gid_of(uid) is not None, (uid, d.kind)
            assert gids.pop() == d.gid_of(uid)
            assert st["Groups"] == "", "supplementary groups: %r" % st["Groups"]
            assert uid not in (0, NOBODY, os.getuid()), uid
            ids.setdefault(ns, set()).add(uid)
    assert len(ids["alice"]) == 1 and len(ids["bob"]) == 1, ids
    assert ids["alice"] != ids["bob"], ids
    # Each executor's scratch is its own /dev/shm: a tmpfs of its uid's, mode
    # 0700, in its own mount namespace; nothing of it on the host.
    for ns in ("alice", "bob"):
        for pid in executors_of(d.proc.pid, ns):
            with open("/proc/%d/mountinfo" % pid) as f:
                tmp = [line for line in f if line.split()[4] == "/dev/shm"]
            assert tmp, "no /dev/shm mount in %s's executor" % ns
            fields = tmp[-1].split(" - ")[1].split()
            assert fields[0] == "tmpfs", tmp[-1]
            uid = next(iter(ids[ns]))
            assert "uid=%d" % uid in fields[2] and "mode=700" in fields[2], tmp[-1]
        assert not os.path.exists(os.path.join(d.state, "cache", "gpu-load",
                                               hashlib.sha256(ns.encode()).hexdigest()[:16]))

    # Bob's kernel can neither signal nor limit alice's executor.
    alice_pid = next(iter(executors_of(d.proc.pid, "alice")))
    c.register(unary_spec("probe", PROBE, namespace="bob"))
    probe_in = np.zeros(PROBE_N, dtype=np.float32)
    probe_in[2] = alice_pid  # the TARGETS slot of alice's executor
    y = c.op("bob/probe")(probe_in)
    codes = y[26:39]
    wrong = ["%s: %s" % (a, errno.errorcode.get(int(v), v))
             for a, v in zip(ATTACKS, codes) if v != errno.EPERM]
    assert not wrong, wrong
    np.testing.assert_array_equal(c.op("alice/twice")(x), 2 * x)
    assert alice_pid in executors(d.proc.pid)
    c.close()


CLAIMS = "/run/opjit-uids/uids.lock"  # the default [exec] uid_claim_dir's lock file


def claimed(path, uid):
    """Whether a process holds uid `uid` in the claim file `path`: an open
    file description lock on byte `uid`, as opjitd takes one."""
    fd = os.open(path, os.O_RDWR)
    try:
        query = struct.pack("@hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, uid, 1, 0)
        l_type = struct.unpack("@hhqqi4x", fcntl.fcntl(fd, fcntl.F_OFD_GETLK, query))[0]
        return l_type != fcntl.F_UNLCK
    finally:
        os.close(fd)


def close_started(*daemons):
    """Closes each of `daemons` that was started."""
    for d in daemons:
        if getattr(d, "proc", None) is not None:
            d.close()


def first_namespace_uid(d, ns="alice"):
    """Registers and calls an op in `ns` on daemon `d`; the one uid its
    executors run as."""
    with opjit.Client(d.unix_address, timeout=120, fast="off") as c:
        c.register(unary_spec("twice", unary_kernel(), namespace=ns))
        x = np.arange(8, dtype=np.float32)
        np.testing.assert_array_equal(c.op(ns + "/twice")(x), 2 * x)
    pids = wait_for(lambda: executors_of(d.proc.pid, ns), 30, ns + "'s executor")
    uids = {int(status_of(pid)["Uid"].split()[0]) for pid in pids}
    assert len(uids) == 1, uids
    return uids.pop()


def test_two_root_daemons_with_the_default_config_never_share_a_uid():
    """Every daemon used to give its first namespace the first uid of the
    same default range: two daemons' tenants then shared RLIMIT_NPROC (one
    filled it, the other's pthread_create failed). Each claims its uids
    host-wide now; a daemon killed with SIGKILL gives its claims back."""
    if os.geteuid() != 0:
        pytest.skip("a uid per namespace needs a root daemon; run as root")
    a, b = TempDaemon(), TempDaemon()
    try:
        a.spawn("", prefix="opjit-tu-", serving=True)
        b.spawn("", prefix="opjit-tu-", serving=True)
        ua, ub = first_namespace_uid(a), first_namespace_uid(b)
        assert ua != ub, (ua, ub)
        assert FIRST <= ua <= LAST and FIRST <= ub <= LAST, (ua, ub)
        assert claimed(CLAIMS, ua) and claimed(CLAIMS, ub)
        assert "claimed on this host" in a.read_log()
        # The claim goes with its daemon, however it dies.
        a.proc.kill()
        a.proc.wait()
        wait_for(lambda: not claimed(CLAIMS, ua), 10, "daemon a's claim to go")
        assert claimed(CLAIMS, ub)
    finally:
        close_started(a, b)


def test_two_non_root_daemons_of_one_user_never_share_a_subordinate_uid():
    """Two daemons of one user share its subordinate ids: each claims the
    uids it hands out in the same claim directory."""
    if os.geteuid() != 0:
        pytest.skip("starting a daemon as nobody needs root")
    claims = subuid_claims_dir()
    a = SubuidDaemon(claims_dir=claims)
    try:
        b = SubuidDaemon(first=a.first, claims_dir=claims)
        try:
            for d in (a, b):
                wait_for(lambda: "subordinate uid per namespace" in d.read_log(), 30,
                         "the daemon to say it uses its subordinate ids")
            ua, ub = first_namespace_uid(a), first_namespace_uid(b)
            assert ua != ub, (ua, ub)
            assert all(a.first <= u < a.first + a.count - 1 for u in (ua, ub)), (ua, ub)
            assert claimed(os.path.join(claims, "uids.lock"), ua)
        finally:
            b.close()
    finally:
        a.close()
        shutil.rmtree(os.path.dirname(claims), ignore_errors=True)


@pytest.mark.parametrize("fast", ["off", "on"], ids=["pool", "fast_channel"])
def test_a_thread_bomb_is_held_to_its_namespace(root_daemon, fast):
    """Pool executors are stopped by the daemon when they come back, and
    the call that left the threads answers RESOURCE_EXHAUSTED; a fast
    channel's call is answered as it ran (no thread count on the fast
    path), and its executor is stopped by the daemon once no call runs."""
    d = root_daemon
    c = opjit.Client(d.unix_address, timeout=120, fast=fast)
    x = np.arange(8, dtype=np.float32)
    c.register(unary_spec("twice", unary_kernel(), namespace="alice"))
    c.register(unary_spec("bomb", BOMB, namespace="bob"))
    np.testing.assert_array_equal(c.op("alice/twice")(x), 2 * x)
    alice = wait_for(lambda: executors_of(d.proc.pid, "alice"), 30, "alice's executor")
    bomb_in = np.zeros(8, dtype=np.float32)
    bomb_in[0] = BOMB_THREADS
    refused = 0
    for _ in range(3):
        try:
            y = c.op("bob/bomb")(bomb_in)
            # On the pool, allowed only if it could not leave more than an
            # executor keeps.
            assert fast == "on" or y[0] <= PER_EXECUTOR, y[:2]
        except opjit.ResourceExhausted as e:
            refused += 1
            assert "threads running" in str(e) and str(PER_EXECUTOR) in str(e), str(e)
        # Every executor of bob's keeps at most its share, and all of them
        # together stay under the namespace's cap. An executor over its share
        # is on its way out once the call is answered (a fast channel's ends
        # itself after answering; a process of 1,000 threads takes a while to
        # go on a loaded machine), so the check waits for that.
        def within_caps():
            bob = threads_of(executors_of(d.proc.pid, "bob"))
            assert sum(bob.values()) <= PER_NAMESPACE, bob
            return all(n <= PER_EXECUTOR for n in bob.values())

        wait_for(within_caps, 30, "bob's executors to keep at most %d threads each"
                 % PER_EXECUTOR)
        np.testing.assert_array_equal(c.op("alice/twice")(x), 2 * x)
    # 1,500 threads asked: the namespace's cap stopped it (EAGAIN in the
    # kernel), and each pool call was refused.
    assert refused == (3 if fast == "off" else 0)
    # Alice is untouched: the same executor, with its own few threads.
    assert alice <= executors(d.proc.pid), "alice's executor was replaced"
    assert all(n < 16 for n in threads_of(alice).values()), threads_of(alice)
    c.register(unary_spec("thrice", unary_kernel("* 3.0f"), namespace="alice"))
    np.testing.assert_array_equal(c.op("alice/thrice")(x), 3 * x)
    assert health(d.unix_address) == "SERVING"
    assert d.proc.poll() is None
    log = d.read_log()
    assert ("kept" in log if fast == "off" else "while no call runs); stopped" in log), log[-3000:]
    c.close()


def scrape(d):
    with urllib.request.urlopen("http://%s/metrics" % d.metrics_address(), timeout=10) as r:
        return r.read().decode()


def counter(text, name, labels=""):
    m = re.search(r"^%s%s (\S+)$" % (re.escape(name), re.escape(labels)), text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("fast", ["off", "on"], ids=["pool", "fast_channel"])
def test_an_idle_executor_past_its_thread_cap_is_stopped_without_another_call(fast):
    """A kernel's thread that goes on starting threads after its call
    returned (the call's end saw few): the idle executor grew to ~1,000
    threads and kept them. It is stopped within a bounded time now, with no
    other call (the daemon counts every idle executor's threads every
    ~100 ms), logged, counted, and charged to no kernel: the next call runs
    in a fresh executor, and nothing counts as a crash."""
    cap = 16
    d = TempDaemon()
    d.spawn('[metrics]\nlisten = "127.0.0.1:0"\n[exec]\nthreads_per_executor = %d\n' % cap,
            prefix="opjit-tu-", serving=True)
    try:
        c = opjit.Client(d.unix_address, timeout=120, fast=fast)
        c.register(unary_spec("late", LATE, namespace="bob"))
        late = np.zeros(8, dtype=np.float32)
        late[0], late[1] = 3 * cap, 300  # 48 threads, 300 ms after the call
        assert c.op("bob/late")(late)[0] == 1
        answered = time.monotonic()
        grown = executors_of(d.proc.pid, "bob")
        assert grown
        stopped = re.compile(r"executor process (\d+) has (\d+) threads \(at most %d while no call "
                             r"runs\); stopped, charged to no kernel" % cap)
        m = wait_for(lambda: stopped.search(d.read_log()), 10,
                     "the idle executor to be stopped")
        pid, threads = int(m.group(1)), int(m.group(2))
        assert pid in grown and threads > cap, (pid, threads, grown)
        wait_for(lambda: pid not in executors(d.proc.pid), 10, "executor %d to be gone" % pid)
        # 300 ms until the threads start, then at most one count (~100 ms)
        # of the watcher; generous for a loaded machine.
        assert time.monotonic() - answered < 5
        text = scrape(d)
        assert counter(text, "opjit_executor_thread_cap_stops_total", '{when="idle"}') == 1, text
        assert counter(text, "opjit_executor_worker_crashes_total") == 0, text
        assert counter(text, "opjit_quarantined_kernels_total") == 0, text
        # The next call is not charged: it runs, in a fresh executor.
        assert c.op("bob/late")(np.zeros(8, dtype=np.float32))[0] == 0
        assert pid not in executors(d.proc.pid)
        assert all(n <= cap for n in threads_of(executors_of(d.proc.pid, "bob")).values())
        assert counter(scrape(d), "opjit_executor_worker_crashes_total") == 0
        assert d.proc.poll() is None
        c.close()
    finally:
        d.close()


def test_the_namespace_cap_stops_pthread_create():
    """threads_per_namespace is RLIMIT_NPROC of the namespace's uid: beyond
    it, pthread_create fails with EAGAIN inside the kernel, whichever
    executor of the namespace asks."""
    if os.geteuid() != 0:
        pytest.skip("a uid per namespace needs a root daemon; run as root")
    # RLIMIT_NPROC counts every process and thread of the uid on the host:
    # the default range serves, as no other daemon of the host (another
    # test's, beside this one) holds the uid this one claims.
    d = TempDaemon()
    d.spawn("[exec]\nthreads_per_executor = 4096\nthreads_per_namespace = 100\n",
            prefix="opjit-tu-", serving=True)
    try:
        c = opjit.Client(d.unix_address, timeout=120, fast="off")
        c.register(unary_spec("bomb", BOMB, namespace="bob"))
        bomb_in = np.zeros(8, dtype=np.float32)
        bomb_in[0] = BOMB_THREADS
        y = c.op("bob/bomb")(bomb_in)
        assert 50 <= y[0] < 100 and y[1] == errno.EAGAIN, y[:2]
        y = c.op("bob/bomb")(bomb_in)
        assert y[0] < 100 and y[1] == errno.EAGAIN, y[:2]
        bob = threads_of(executors_of(d.proc.pid, "bob"))
        assert bob and sum(bob.values()) <= 100, bob
        assert health(d.unix_address) == "SERVING"
        c.close()
    finally:
        d.close()


def test_a_used_up_uid_range_refuses_new_namespaces_only():
    """Two uids for three namespaces: the third namespace's calls are
    refused (RESOURCE_EXHAUSTED), never run under another's uid; the first
    two keep working. A second daemon on the same range, whose uids the
    first holds, refuses its first namespace the same way."""
    if os.geteuid() != 0:
        pytest.skip("a uid per namespace needs a root daemon; run as root")
    # A range of this test's own (keyed by pid): other daemons of the host
    # claim from the default one, and could hold one of two uids there.
    first = 1900000000 + (os.getpid() % 1000000) * 4
    config = '[exec]\nuid_range = "%d-%d"\n' % (first, first + 1)
    d, other = TempDaemon(), TempDaemon()
    d.spawn(config, prefix="opjit-tu-", serving=True)
    try:
        c = opjit.Client(d.unix_address, timeout=120, fast="off")
        x = np.arange(4, dtype=np.float32)
        for ns in ("a", "b"):
            c.register(unary_spec("twice", unary_kernel(), namespace=ns))
            np.testing.assert_array_equal(c.op(ns + "/twice")(x), 2 * x)
        with pytest.raises(opjit.ResourceExhausted) as e:
            c.register(unary_spec("twice", unary_kernel(), namespace="c"))
            c.op("c/twice")(x)
        assert "uid" in str(e.value), str(e.value)
        uids = {ns: {int(status_of(p)["Uid"].split()[0]) for p in executors_of(d.proc.pid, ns)}
                for ns in ("a", "b", "c")}
        assert uids["a"] == {first} and uids["b"] == {first + 1} and not uids["c"], uids
        np.testing.assert_array_equal(c.op("a/twice")(x), 2 * x)
        c.close()
        # Claimed out by another daemon: refused, never shared.
        other.spawn(config, prefix="opjit-tu-", serving=True)
        with opjit.Client(other.unix_address, timeout=120, fast="off") as oc:
            with pytest.raises(opjit.ResourceExhausted) as e:
                oc.register(unary_spec("twice", unary_kernel(), namespace="z"))
                oc.op("z/twice")(x)
        assert "other opjitd servers on this host" in str(e.value), str(e.value)
        assert not executors_of(other.proc.pid, "z")
    finally:
        close_started(other, d)


def test_a_non_root_daemon_warns_that_tenants_share_its_uid():
    if os.geteuid() != 0:
        pytest.skip("starting a daemon as nobody needs root")
    d = NobodyDaemon()
    try:
        log = wait_for(lambda: "WARNING" in d.read_log() and d.read_log(), 30, "the warning")
        assert "not root" in log and "not apart by uid" in log, log[-2000:]
        c = opjit.Client(d.unix_address, timeout=120, fast="off")
        c.register(unary_spec("twice", unary_kernel(), namespace="alice"))
        x = np.arange(8, dtype=np.float32)
        np.testing.assert_array_equal(c.op("alice/twice")(x), 2 * x)
        for pid in executors(d.proc.pid):
            assert int(status_of(pid)["Uid"].split()[0]) == NOBODY
        c.close()
    finally:
        d.close()
