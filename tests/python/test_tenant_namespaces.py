"""Tenants cannot reach each other or the daemon (issue 27): namespaces,
scratch and memory that no limit counts.

Against a root daemon (the default), every executor and compile worker runs
in PID, mount, IPC, network and UTS namespaces of its own: the test compares
their /proc/<pid>/ns links with the daemon's and each other's, and a kernel
sees itself as process 1 with no parent it can name. Against a non-root
daemon (nobody), the same through a user namespace of each executor's own,
but in the host's PID namespace (that needs root), which its log says.
Either way, a kernel's scratch ($TMPDIR) is a private tmpfs over its /dev/shm of
[exec] scratch_mb: a kernel that writes until it cannot stops at the cap
with ENOSPC, nothing reaches the host, and another namespace cannot
open alice's files. Memory that RLIMIT_DATA does not count (memfd_create,
System V shm, shared anonymous mappings) and sockets are refused.
"""

import errno
import hashlib
import os
import random
import shutil
import tempfile

import grpc
import numpy as np
import pytest

import opjit

from conftest import TempDaemon, health, unary_kernel, unary_spec, wait_for
from test_tenant_walls import NobodyDaemon, executors, helpers

SCRATCH_MB = 8
NAMESPACES = ["pid", "mnt", "ipc", "net", "uts"]

# y[0]: getpid(), y[1]: getppid(), y[2]: bytes written to $TMPDIR before a
# write failed, y[3]: that errno, y[4]: memfd_create errno (0: it worked),
# y[5]: mmap(MAP_SHARED|MAP_ANONYMOUS) errno, y[6]: shmget errno, y[7]:
# socket(AF_INET) errno, y[8]: bytes a private mapping could hold (64 MiB
# touched, to show private memory still works), y[16..]: $TMPDIR as bytes.
PROBE = r"""#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  for (int i = 0; i < 256; ++i) y[i] = 0;
  const char* tmp = getenv("TMPDIR");
  if (tmp != nullptr) {  // a marker, named by x[0], for the neighbour to look for
    char mark[4096];
    snprintf(mark, sizeof mark, "%s/opjit-mark-%d", tmp, static_cast<int>(x[0]));
    const int fd = open(mark, O_WRONLY | O_CREAT, 0600);
    if (fd >= 0) close(fd);
  }
  y[0] = getpid();
  y[1] = getppid();
  const char* dir = getenv("TMPDIR");
  double written = 0;
  int err = 0;
  if (dir != nullptr) {
    static char chunk[1 << 20];
    memset(chunk, 7, sizeof chunk);
    for (int f = 0; f < 2 && err == 0; ++f) {
      char path[4096];
      snprintf(path, sizeof path, "%s/f%d", dir, f);
      const int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (fd < 0) { err = errno; break; }
      for (int i = 0; i < 12; ++i) {
        const ssize_t w = write(fd, chunk, sizeof chunk);
        if (w < 0) { err = errno; break; }
        written += w;
        if (w < (ssize_t)sizeof chunk) { err = ENOSPC; break; }
      }
      close(fd);
    }
    for (int i = 0; dir[i] != 0 && i < 200; ++i) y[16 + i] = dir[i];
  }
  y[2] = written;
  y[3] = err;
  const long m = syscall(SYS_memfd_create, "big", 0);
  y[4] = m < 0 ? errno : 0;
  void* shared = mmap(nullptr, 1 << 30, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  y[5] = shared == MAP_FAILED ? errno : 0;
  const int shm = shmget(IPC_PRIVATE, 1 << 20, IPC_CREAT | 0600);
  y[6] = shm < 0 ? errno : 0;
  const int sock = socket(AF_INET, SOCK_STREAM, 0);
  y[7] = sock < 0 ? errno : 0;
  char* priv = static_cast<char*>(malloc(64 << 20));
  if (priv != nullptr) { memset(priv, 1, 64 << 20); y[8] = 64 << 20; free(priv); }
  return 0;
}
"""

# x: a path as bytes (0-terminated). y[0]: open() errno (0: it opened).
PEEK = r"""#include <cerrno>
#include <cstdint>
#include <fcntl.h>
#include <unistd.h>

extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  char path[256] = {0};
  for (int i = 0; i < 250 && x[i] != 0; ++i) path[i] = static_cast<char>(x[i]);
  const int fd = open(path, O_RDONLY);
  y[0] = fd < 0 ? errno : 0;
  if (fd >= 0) close(fd);
  return 0;
}
"""

CONFIG = "[exec]\nscratch_mb = %d\nworker_idle_ms = 1000\n" % SCRATCH_MB


def ns_links(pid):
    return {n: os.readlink("/proc/%d/ns/%s" % (pid, n)) for n in NAMESPACES + ["user"]}


def compile_workers(daemon_pid):
    """[(pid, ns_links)] of the daemon's compile workers, less the health
    monitor's short-lived --probe runs and any that ended while looked at."""
    out = []
    for pid in helpers(daemon_pid, "opjit-compile"):
        try:
            out.append((pid, ns_links(pid)))
        except OSError:
            continue
    return out


def text_of(values):
    return "".join(chr(int(v)) for v in values if v > 0)


@pytest.fixture
def visible_file():
    """A world-readable file under /tmp, named to the daemon as the operator's
    CUDA driver (OPJIT_CUDA_DRIVER): executors get it read-only, and their
    private scratch mount must not hide it (the scratch once hid /tmp)."""
    d = tempfile.mkdtemp(prefix="opjit-tn-ro-")
    os.chmod(d, 0o755)
    path = os.path.join(d, "libstandin.so")
    with open(path, "w") as f:
        f.write("not a driver")
    os.chmod(path, 0o644)
    os.environ["OPJIT_CUDA_DRIVER"] = path
    yield path
    os.environ.pop("OPJIT_CUDA_DRIVER", None)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["root", "nobody"], ids=["root_daemon", "non_root_daemon"])
def daemon(request, visible_file):
    if os.geteuid() != 0:
        pytest.skip("the root case needs root, and the non-root one starts opjitd as nobody")
    if request.param == "root":
        d = TempDaemon()
        d.spawn(CONFIG, prefix="opjit-tn-", serving=True)
    else:
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv (util-linux) is missing")
        d = NobodyDaemon(config=CONFIG)
    d.kind = request.param
    yield d
    d.close()


def test_executors_are_apart_and_their_scratch_and_memory_are_capped(daemon):
    rooted = daemon.kind == "root"
    own = ns_links(daemon.proc.pid)
    # The compile worker the daemon starts ahead of the first compile:
    # namespaces of its own too, once it has loaded clang and closed its
    # sandbox.
    def compilers_apart():
        workers = compile_workers(daemon.proc.pid)
        return workers if workers and all(l["net"] != own["net"] for _, l in workers) else None

    for pid, l in wait_for(compilers_apart, 60, "a compile worker in namespaces of its own"):
        for n in NAMESPACES + ([] if rooted else ["user"]):
            assert l[n] != own[n], "compile worker %d, %s namespace" % (pid, n)
    c = opjit.Client(daemon.unix_address, timeout=120)
    c.register(unary_spec("probe", PROBE, namespace="alice"))
    c.register(unary_spec("probe", PROBE, namespace="bob"))
    c.register(unary_spec("peek", PEEK, namespace="bob"))
    marks = random.sample(range(1, 1 << 24), 2)
    x = np.zeros(256, dtype=np.float32)
    x[0] = marks[0]
    a = c.op("alice/probe")(x)
    x[0] = marks[1]
    b = c.op("bob/probe")(x)

    # Namespaces: process 1 with no visible parent, links apart from the
    # daemon's and from each other's (root); the host's otherwise, and the
    # daemon says so.
    procs = executors(daemon.proc.pid)
    assert len(procs) >= 2, procs
    links = {pid: ns_links(pid) for pid in procs}
    # A non-root daemon: the same, inside a user namespace of each
    # executor's own that the daemon made (its PID namespace is owned by
    # that one).
    assert (a[0], a[1]) == (1, 0) and (b[0], b[1]) == (1, 0), (a[:2], b[:2])
    if not rooted:
        assert "share the host's PID namespace" not in daemon.read_log()
    for pid, l in links.items():
        for n in NAMESPACES + ([] if rooted else ["user"]):
            assert l[n] != own[n], "executor %d, %s namespace" % (pid, n)
    for n in NAMESPACES + ([] if rooted else ["user"]):
        seen = [l[n] for l in links.values()]
        assert len(set(seen)) == len(seen), "executors share a %s namespace" % n

    # Scratch: each its own tmpfs over its /dev/shm, capped (ENOSPC), nothing
    # of it on the host.
    cap = SCRATCH_MB << 20
    for y in (a, b):
        assert cap - (1 << 20) <= y[2] <= cap, (y[2], y[3], text_of(y[16:]))
        assert y[3] == errno.ENOSPC, y[3]
    alice_dir, bob_dir = text_of(a[16:]), text_of(b[16:])
    alice_mark = "%s/opjit-mark-%d" % (alice_dir, marks[0])
    assert alice_dir == bob_dir == "/dev/shm", (alice_dir, bob_dir)
    assert not os.path.exists(alice_mark)
    # Bob cannot open alice's marker, either way.
    peek_in = np.zeros(256, dtype=np.float32)
    peek_in[:len(alice_mark)] = [ord(ch) for ch in alice_mark]
    peek = c.op("bob/peek")(peek_in)
    assert peek[0] in (errno.EACCES, errno.ENOENT), peek[0]
    # What the operator granted read-only stays readable, under /tmp too.
    granted = os.environ["OPJIT_CUDA_DRIVER"]
    peek_in[:] = 0
    peek_in[:len(granted)] = [ord(ch) for ch in granted]
    assert c.op("bob/peek")(peek_in)[0] == 0, "a granted path under /tmp is hidden"

    # Memory no limit counts: refused; private memory still works.
    for y in (a, b):
        assert y[4] == errno.EPERM, "memfd_create: %s" % y[4]
        assert y[5] == errno.EPERM, "mmap(MAP_SHARED|MAP_ANONYMOUS): %s" % y[5]
        assert y[6] == errno.EPERM, "shmget: %s" % y[6]
        assert y[7] == errno.EPERM, "socket: %s" % y[7]
        assert y[8] == 64 << 20

    # Gone with the executor: the client's channels close with it, idle pool
    # executors stop after worker_idle_ms, and their scratch with them.
    c.close()
    wait_for(lambda: not executors(daemon.proc.pid), 60, "the idle executors to stop")
    assert health(daemon.unix_address) == "SERVING"


# x[0]: MiB to allocate, touch and keep (until the executor ends).
HOG = r"""#include <cstdint>
#include <cstdlib>
#include <cstring>

extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  const size_t bytes = static_cast<size_t>(x[0]) << 20;
  char* keep = static_cast<char*>(malloc(bytes));
  if (keep == nullptr) return 1;
  memset(keep, 1, bytes);
  y[0] = keep[bytes - 1];
  return 0;
}
"""

CAP_MB = 512


def memory_cgroup_of(pid):
    """The directory of `pid`'s memory cgroup (cgroup v1's memory hierarchy,
    else v2)."""
    with open("/proc/%d/cgroup" % pid) as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    v1 = [path for _, ctl, path in lines if "memory" in ctl.split(",")]
    if v1:
        return "/sys/fs/cgroup/memory" + v1[0]
    return "/sys/fs/cgroup" + [path for _, ctl, path in lines if ctl == ""][0]


def test_a_namespaces_executors_share_one_memory_cap():
    if os.geteuid() != 0:
        pytest.skip("the memory cap needs a writable cgroup (root, or a delegated cgroup v2)")
    d = TempDaemon()
    d.spawn("[exec]\nnamespace_memory_mb = %d\nworker_memory_mb = 4096\n" % CAP_MB,
            prefix="opjit-tn-", serving=True)
    try:
        if "share a memory cap" not in d.read_log():
            pytest.skip("no writable cgroup with a memory controller here (the daemon says: %s)" %
                        [l for l in d.read_log().splitlines() if "namespace_memory_mb" in l])
        c = opjit.Client(d.unix_address, timeout=120)
        c.register(unary_spec("hog", HOG, namespace="bob"))
        c.register(unary_spec("twice", unary_kernel(), namespace="alice"))
        x = np.zeros(4, dtype=np.float32)
        x[0] = 64
        c.op("bob/hog")(x)  # held: 64 MiB of bob's cap
        np.testing.assert_array_equal(c.op("alice/twice")(x), 2 * x)
        # Each namespace's executors sit in a cgroup of its own with the cap.
        groups = {}
        for pid in executors(d.proc.pid):
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                ns = f.read().split(b"\0--namespace\0")[1].split(b"\0")[0].decode()
            groups.setdefault(ns, set()).add(memory_cgroup_of(pid))
        assert set(groups) == {"alice", "bob"}, groups
        assert len(groups["alice"]) == 1 and groups["alice"] != groups["bob"], groups
        for ns, dirs in groups.items():
            path = next(iter(dirs))
            assert path.endswith("ns-" + hashlib.sha256(ns.encode()).hexdigest()[:16]), path
            limit = [f for f in ("memory.max", "memory.limit_in_bytes")
                     if os.path.exists(os.path.join(path, f))][0]
            with open(os.path.join(path, limit)) as f:
                assert int(f.read()) == CAP_MB << 20
        # Past the cap (far below worker_memory_mb): the namespace's cap
        # ends it, and says so.
        x[0] = 2 * CAP_MB
        with pytest.raises(opjit.OpjitError) as e:
            c.op("bob/hog")(x)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        assert e.value.reason == "KERNEL_CRASHED", e.value.reason
        assert e.value.metadata.get("cause") == "namespace_memory" or "memory cap" in e.value.message, \
            e.value.message
        # Alice is untouched, and bob's next modest call works.
        x[0] = 16
        np.testing.assert_array_equal(c.op("alice/twice")(x), 2 * x)
        c.op("bob/hog")(x)
        assert health(d.unix_address) == "SERVING"
        c.close()
    finally:
        d.close()
