"""A uid per namespace and caps on threads (issue 27).

On a root daemon, each namespace's executors run as a uid (and gid) of their
own from [exec] uid_range; on a non-root daemon with subordinate ids (as the
package sets up), as one of those (SubuidDaemon). Never the daemon's nor
nobody's, with no supplementary groups; the executor's scratch tmpfs is that
uid's, mode 0700. A kernel in bob's namespace that starts 1,500 sleeping threads per call
is held to [exec] threads_per_namespace (RLIMIT_NPROC of bob's uid: its
pthread_create gets EAGAIN), its call answers RESOURCE_EXHAUSTED once it has
left more than threads_per_executor, and that executor is replaced (pool and
fast channel); alice's executor and calls, and the daemon, are untouched. A
used-up range refuses a new namespace (RESOURCE_EXHAUSTED) rather than share
a uid. A daemon that is not root says in its log that tenants are not apart
by uid.
"""

import errno
import hashlib
import os
import pwd

import numpy as np
import pytest

import opjit

from conftest import TempDaemon, health, unary_kernel, unary_spec, wait_for
from test_tenant_walls import N as PROBE_N
from test_tenant_walls import ATTACKS, PROBE, NobodyDaemon, SubuidDaemon, executors

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


@pytest.mark.parametrize("fast", ["off", "on"], ids=["pool", "fast_channel"])
def test_a_thread_bomb_is_held_to_its_namespace(root_daemon, fast):
    """Pool executors are stopped by the daemon when they come back; a
    fast channel's executor ends itself after answering."""
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
            # Allowed only if it could not leave more than an executor keeps.
            assert y[0] <= PER_EXECUTOR, y[:2]
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
    # kernel), and each call was refused.
    assert refused == 3
    # Alice is untouched: the same executor, with its own few threads.
    assert alice <= executors(d.proc.pid), "alice's executor was replaced"
    assert all(n < 16 for n in threads_of(alice).values()), threads_of(alice)
    c.register(unary_spec("thrice", unary_kernel("* 3.0f"), namespace="alice"))
    np.testing.assert_array_equal(c.op("alice/thrice")(x), 3 * x)
    assert health(d.unix_address) == "SERVING"
    assert d.proc.poll() is None
    log = d.read_log()
    assert ("kept" in log if fast == "off" else "threads running" in log), log[-3000:]
    c.close()


def test_the_namespace_cap_stops_pthread_create():
    """threads_per_namespace is RLIMIT_NPROC of the namespace's uid: beyond
    it, pthread_create fails with EAGAIN inside the kernel, whichever
    executor of the namespace asks."""
    if os.geteuid() != 0:
        pytest.skip("a uid per namespace needs a root daemon; run as root")
    # RLIMIT_NPROC counts every process and thread of the uid on the host,
    # and a daemon gives its first namespace the first uid of its range: a
    # uid range of this test's own (outside the default one, keyed by pid),
    # so another test's or daemon's executors under the default range's
    # first uid do not count against this cap.
    first = 1900000000 + (os.getpid() % 1000000) * 4
    d = TempDaemon()
    d.spawn('[exec]\nthreads_per_executor = 4096\nthreads_per_namespace = 100\n'
            'uid_range = "%d-%d"\n' % (first, first + 3), prefix="opjit-tu-", serving=True)
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
    two keep working."""
    if os.geteuid() != 0:
        pytest.skip("a uid per namespace needs a root daemon; run as root")
    d = TempDaemon()
    d.spawn('[exec]\nuid_range = "1879048192-1879048193"\n', prefix="opjit-tu-", serving=True)
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
        assert uids["a"] == {1879048192} and uids["b"] == {1879048193} and not uids["c"], uids
        np.testing.assert_array_equal(c.op("a/twice")(x), 2 * x)
        c.close()
    finally:
        d.close()


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
