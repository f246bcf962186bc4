"""Tenants cannot reach each other or the daemon (issue 27): calls aimed at
another process.

A kernel in bob's namespace aims prlimit64, setpriority, sched_setaffinity,
sched_setscheduler, signals (kill, tgkill, sigqueue), ptrace,
process_vm_readv and pidfd_open at every process it can name: the daemon
(by the pid the test passes in, and by getppid()), the test itself, alice's
executor and a bystander of the executors' uid. Each call must fail with
EPERM; the same calls aimed at the kernel's own process (pid 0) must work.
Afterwards alice's executor, the daemon, the test and the bystander keep
their limits (/proc/<pid>/limits), nice value (/proc/<pid>/stat), CPU
affinity and scheduling policy, and alice's calls, registration and health
are as before. Against a root daemon (a uid per namespace), a non-root
one (the daemon as nobody: without subordinate ids its executors share its
uid) and a non-root one with subordinate ids (a subordinate uid per
namespace, as the package sets up for its unit).
"""

import errno
import os
import pwd
import random
import shutil
import stat
import subprocess
import tempfile

import numpy as np
import pytest

import opjit

from conftest import TempDaemon, health, opjitd_binary, unary_kernel, unary_spec, wait_for

NOBODY = pwd.getpwnam("nobody")
ATTACKS = ["prlimit64(pid, RLIMIT_CPU, NULL, &old)", "prlimit64(pid, RLIMIT_CPU, {1,1})",
           "prlimit64(pid, RLIMIT_FSIZE, 4096)", "prlimit64(pid, RLIMIT_NOFILE, 32)",
           "setpriority(PRIO_PROCESS, pid, 19)", "sched_setaffinity(pid, {cpu 0})",
           "sched_setscheduler(pid, SCHED_IDLE)", "kill(pid, 0)", "tgkill(pid, pid, 0)",
           "rt_sigqueueinfo(pid, 0)", "ptrace(PTRACE_PEEKDATA, pid)", "process_vm_readv(pid)",
           "pidfd_open(pid)"]
TARGETS = ["the daemon (pid passed in)", "the test", "alice's executor", "a bystander",
           "getppid()"]
SELF = ["prlimit64(0, RLIMIT_CPU, NULL, &old)", "getrlimit(RLIMIT_NOFILE)",
        "sched_setaffinity(0, own mask)", "setpriority(PRIO_PROCESS, 0, own nice)",
        "raise(0) (tgkill on itself)", "a new thread: sched_setaffinity(0, own mask)"]
SELF_AT = 70
N = 80

# x[0..3]: the pids to aim at (0: none). y[13 * t + a]: attack a on target t
# (TARGETS; the last is getppid()), y[70 + i]: SELF[i]; each 0 when the call
# succeeded, else its errno; -1 for a target that was not named.
PROBE = r"""#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <thread>
#include <sched.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

static float Code(long r) { return r == -1 ? static_cast<float>(errno) : 0.0f; }

extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  for (int i = 0; i < 80; ++i) y[i] = -1;
  const pid_t targets[5] = {(pid_t)x[0], (pid_t)x[1], (pid_t)x[2], (pid_t)x[3], getppid()};
  for (int t = 0; t < 5; ++t) {
    const pid_t pid = targets[t];
    float* o = y + 13 * t;
    if (pid <= 0) continue;
    rlimit old{}, one{1, 1}, fsize{4096, 4096}, nofile{32, 32};
    o[0] = Code(syscall(SYS_prlimit64, pid, RLIMIT_CPU, nullptr, &old));
    o[1] = Code(syscall(SYS_prlimit64, pid, RLIMIT_CPU, &one, nullptr));
    o[2] = Code(syscall(SYS_prlimit64, pid, RLIMIT_FSIZE, &fsize, nullptr));
    o[3] = Code(syscall(SYS_prlimit64, pid, RLIMIT_NOFILE, &nofile, nullptr));
    o[4] = Code(setpriority(PRIO_PROCESS, pid, 19));
    cpu_set_t cpu0;
    CPU_ZERO(&cpu0);
    CPU_SET(0, &cpu0);
    o[5] = Code(sched_setaffinity(pid, sizeof cpu0, &cpu0));
    sched_param param{};
    o[6] = Code(sched_setscheduler(pid, SCHED_IDLE, &param));
    o[7] = Code(kill(pid, 0));
    o[8] = Code(syscall(SYS_tgkill, pid, pid, 0));
    siginfo_t info;
    memset(&info, 0, sizeof info);
    info.si_code = SI_QUEUE;
    info.si_pid = getpid();
    info.si_uid = getuid();
    o[9] = Code(syscall(SYS_rt_sigqueueinfo, pid, 0, &info));
    o[10] = Code(ptrace(PTRACE_PEEKDATA, pid, nullptr, nullptr));
    char byte = 0;
    iovec local{&byte, 1}, remote{&byte, 1};
    o[11] = Code(syscall(SYS_process_vm_readv, pid, &local, 1, &remote, 1, 0));
    const long fd = syscall(SYS_pidfd_open, pid, 0);
    o[12] = Code(fd);
    if (fd >= 0) close(static_cast<int>(fd));
  }
  float* me = y + 70;
  rlimit lim{};
  me[0] = Code(syscall(SYS_prlimit64, 0, RLIMIT_CPU, nullptr, &lim));
  me[1] = Code(getrlimit(RLIMIT_NOFILE, &lim));
  cpu_set_t mask;
  me[2] = Code(sched_getaffinity(0, sizeof mask, &mask) == 0 ? sched_setaffinity(0, sizeof mask, &mask) : -1);
  errno = 0;
  const int nice = getpriority(PRIO_PROCESS, 0);
  me[3] = Code(errno != 0 ? -1 : setpriority(PRIO_PROCESS, 0, nice));
  me[4] = Code(raise(0));
  float in_thread = -2;
  try {
    std::thread t([&] {
      cpu_set_t m;
      in_thread = Code(sched_getaffinity(0, sizeof m, &m) == 0 ? sched_setaffinity(0, sizeof m, &m) : -1);
    });
    t.join();
  } catch (...) {
  }
  me[5] = in_thread;
  return 0;
}
"""


def _descendants(root):
    """{pid: comm} of every process below `root` (children, their children...)."""
    parent, comm = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                s = f.read()
        except OSError:
            continue
        close = s.rfind(")")
        parent[int(name)] = int(s[close + 2:].split()[1])
        comm[int(name)] = s[s.find("(") + 1:close]
    out = {}
    for pid in parent:
        p, hops = parent[pid], 0
        while p > 1 and p != root and hops < 64:
            p, hops = parent.get(p, 0), hops + 1
        if p == root:
            out[pid] = comm[pid]
    return out


def helpers(daemon_pid, comm_prefix):
    """Pids of the daemon's helpers whose name starts with `comm_prefix`
    (below it; not the health monitor's short-lived --probe runs)."""
    out = set()
    for pid, comm in _descendants(daemon_pid).items():
        if not comm.startswith(comm_prefix):
            continue
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                if b"--probe" in f.read():
                    continue
        except OSError:
            continue
        out.add(pid)
    return out


def executors(daemon_pid):
    """Pids of the daemon's executors."""
    return helpers(daemon_pid, "opjit-exec-work")


def observe(pid):
    """What another process could change of `pid`: limits, nice, affinity, policy."""
    with open("/proc/%d/limits" % pid) as f:
        limits = f.read()
    with open("/proc/%d/stat" % pid) as f:
        s = f.read()
    nice = int(s[s.rfind(")") + 2:].split()[16])  # field 19
    return {"limits": limits, "nice": nice, "affinity": sorted(os.sched_getaffinity(pid)),
            "policy": os.sched_getscheduler(pid)}


class NobodyDaemon(TempDaemon):
    """opjitd as nobody (setpriv execs it: the pid is opjitd's), as under the
    package's unit: its executors run under its own uid."""

    def __init__(self, config=""):
        self.wrapper_dir = tempfile.mkdtemp(prefix="opjit-tw-bin-")
        wrapper = os.path.join(self.wrapper_dir, "opjitd-as-nobody")
        with open(wrapper, "w") as f:
            f.write(self.wrapper_script())
        os.chmod(wrapper, stat.S_IRWXU)
        d = tempfile.mkdtemp(prefix="opjit-tw-")
        os.chmod(d, 0o755)
        os.chown(d, NOBODY.pw_uid, NOBODY.pw_gid)
        self.spawn('socket_mode = "0666"\n' + config, binary=wrapper, dir=d, serving=True)

    def setpriv(self):
        return "setpriv --reuid=%d --regid=%d --clear-groups %s" % (
            NOBODY.pw_uid, NOBODY.pw_gid, opjitd_binary())

    def wrapper_script(self):
        return "#!/bin/sh\nexec %s \"$@\"\n" % self.setpriv()

    def close(self):
        super().close()
        shutil.rmtree(self.wrapper_dir, ignore_errors=True)


class SubuidDaemon(NobodyDaemon):
    """opjitd as nobody with subordinate ids of its own, as the package sets
    up for its user (postinst: usermod --add-subuids): each namespace's
    executors run as one of them. The daemon runs in a mount namespace of
    its own where /etc/subuid and /etc/subgid are this test's files (what
    newuidmap and newgidmap read), so nothing of the host's changes. The
    range is random, high, and `count` long: [first, first + count), unless
    `first` is given (two daemons of one user share its range). It claims
    its uids in `claims_dir` ([exec] uid_claim_dir), a directory of
    nobody's, mode 0700 (default: a new one): the host's /run/opjit-uids
    is root's, and a daemon that cannot claim uses no subordinate ids."""

    count = 64

    def __init__(self, config="", first=None, claims_dir=None):
        for tool in ("unshare", "newuidmap", "newgidmap"):
            if shutil.which(tool) is None:
                pytest.skip("%s is missing (util-linux, uidmap)" % tool)
        if not (os.path.exists("/etc/subuid") and os.path.exists("/etc/subgid")):
            pytest.skip("/etc/subuid or /etc/subgid is missing (the passwd package makes them)")
        self.first = first or 0x90000000 + random.randrange(1 << 12) * 0x10000
        self.gid_first = self.first + 0x8000
        self.ids_dir = tempfile.mkdtemp(prefix="opjit-tw-ids-")
        os.chmod(self.ids_dir, 0o755)
        for name, first in (("subuid", self.first), ("subgid", self.gid_first)):
            with open(os.path.join(self.ids_dir, name), "w") as f:
                f.write("nobody:%d:%d\n" % (first, self.count))
            os.chmod(os.path.join(self.ids_dir, name), 0o644)
        self.own_claims = claims_dir is None
        self.claims_dir = claims_dir or subuid_claims_dir()
        line = 'uid_claim_dir = "%s"\n' % self.claims_dir
        config = (config.replace("[exec]\n", "[exec]\n" + line, 1) if "[exec]\n" in config
                  else config + "[exec]\n" + line)
        super().__init__(config)

    def wrapper_script(self):
        inner = ('mount --bind "$1" /etc/subuid && mount --bind "$2" /etc/subgid && shift 2 && '
                 'exec %s "$@"' % self.setpriv())
        return ("#!/bin/sh\nexec unshare --mount --propagation private /bin/sh -c '%s' opjit-ids "
                "%s %s \"$@\"\n") % (
            inner, os.path.join(self.ids_dir, "subuid"), os.path.join(self.ids_dir, "subgid"))

    def close(self):
        super().close()
        shutil.rmtree(self.ids_dir, ignore_errors=True)
        if self.own_claims:
            shutil.rmtree(os.path.dirname(self.claims_dir), ignore_errors=True)


def subuid_claims_dir():
    """A uid claim directory for daemons running as nobody: <new temp
    dir>/claims, nobody's, mode 0700."""
    top = tempfile.mkdtemp(prefix="opjit-tw-claims-")
    os.chmod(top, 0o755)
    d = os.path.join(top, "claims")
    os.mkdir(d, 0o700)
    os.chown(d, NOBODY.pw_uid, NOBODY.pw_gid)
    return d


def _make(kind):
    if kind == "root":
        if os.geteuid() != 0:
            pytest.skip("a root daemon needs root")
        d = TempDaemon()
        d.spawn("", prefix="opjit-tw-", serving=True)
        return d
    if os.geteuid() != 0:
        pytest.skip("starting a daemon as nobody needs root (as a non-root user, run "
                    "the root case: its executors share your uid)")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    return SubuidDaemon() if kind == "subuid" else NobodyDaemon()


@pytest.fixture(params=["root", "nobody", "subuid"],
                ids=["root_daemon", "non_root_daemon", "non_root_daemon_with_subuids"])
def daemon(request):
    d = _make(request.param)
    yield d
    d.close()


@pytest.fixture
def bystander():
    """A process of the executors' uid that no namespace owns."""
    user = NOBODY.pw_uid if os.geteuid() == 0 else None
    p = subprocess.Popen(["sleep", "600"], user=user, group=NOBODY.pw_gid if user else None)
    yield p.pid
    p.kill()
    p.wait()


def test_kernels_cannot_reach_other_processes(daemon, bystander):
    c = opjit.Client(daemon.unix_address, timeout=120)
    c.register(unary_spec("twice", unary_kernel(), namespace="alice"))
    c.register(unary_spec("probe", PROBE, namespace="bob"))
    x = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(c.op("alice/twice")(x), 2 * x)
    # Alice's executor: the only one so far (or its processes, should an
    # executor ever be more than one process).
    alice = wait_for(lambda: executors(daemon.proc.pid), 30, "alice's executor")
    alice_pid = max(alice)
    victims = {"daemon": daemon.proc.pid, "test": os.getpid(), "bystander": bystander}
    victims.update({"alice's executor %d" % pid: pid for pid in alice})
    before = {name: observe(pid) for name, pid in victims.items()}

    probe_in = np.zeros(N, dtype=np.float32)
    probe_in[:4] = [daemon.proc.pid, os.getpid(), alice_pid, bystander]
    y = c.op("bob/probe")(probe_in)
    wrong = []
    for t, target in enumerate(TARGETS):
        codes = y[13 * t:13 * t + 13]
        if target == "getppid()" and codes[0] == -1:
            continue  # no parent it can name (a PID namespace of its own)
        for a, attack in enumerate(ATTACKS):
            if codes[a] != errno.EPERM:
                wrong.append("%s on %s: %s" % (attack, target,
                                                "succeeded" if codes[a] == 0 else
                                                errno.errorcode.get(int(codes[a]), codes[a])))
    for i, call in enumerate(SELF):
        if y[SELF_AT + i] != 0:
            wrong.append("%s on itself failed: %s" %
                         (call, errno.errorcode.get(int(y[SELF_AT + i]), y[SELF_AT + i])))
    assert not wrong, "\n".join(wrong)

    after = {name: observe(pid) for name, pid in victims.items()}
    for name in victims:
        assert after[name] == before[name], name
    # Alice is untouched: her executor is the same process, her calls work
    # (more than the three that died and the fourth that met a quarantine),
    # and the daemon registers and is healthy.
    for _ in range(5):
        np.testing.assert_array_equal(c.op("alice/twice")(x), 2 * x)
    assert alice <= executors(daemon.proc.pid), "alice's executor was replaced"
    c.register(unary_spec("thrice", unary_kernel("* 3.0f"), namespace="alice"))
    np.testing.assert_array_equal(c.op("alice/thrice")(x), 3 * x)
    assert health(daemon.unix_address) == "SERVING"
    assert daemon.proc.poll() is None
    c.close()
