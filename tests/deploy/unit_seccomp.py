#!/usr/bin/python3
"""Runs a command under the seccomp filter a systemd unit's options amount to.

    unit_seccomp.py UNIT -- COMMAND [ARGS...]

systemd (no PID 1 here) would build a filter from these options of UNIT; this
builds the equivalent classic-BPF program itself, loads it and execs COMMAND:

  SystemCallFilter=~@group name ...   each syscall listed by
                                      `systemd-analyze syscall-filter @group`
                                      fails with SystemCallErrorNumber=
  SystemCallArchitectures=native      other architectures (and x32) killed
  RestrictAddressFamilies=AF_...      socket()/socketpair() of other families:
                                      EAFNOSUPPORT
  RestrictNamespaces=yes              unshare, setns, clone with CLONE_NEW*:
                                      EPERM; clone3: ENOSYS (as systemd does)
  LockPersonality=yes                 personality() to anything but the
                                      current one (PER_LINUX) or a query: EPERM
  RestrictRealtime=yes                sched_setscheduler/sched_setattr to
                                      SCHED_FIFO, SCHED_RR, SCHED_DEADLINE: EPERM

It prints one line per option applied to stderr, or to the file descriptor
$OPJIT_SECCOMP_REPORT_FD (then closed). x86-64 only (syscall numbers
from <asm/unistd_64.h>); elsewhere it exits 77.
"""

import ctypes
import errno
import os
import platform
import re
import struct
import subprocess
import sys

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
BPF_LD_W_ABS = 0x20
BPF_JMP_JEQ_K = 0x15
BPF_JMP_JGE_K = 0x35
BPF_JMP_JSET_K = 0x45
BPF_RET_K = 0x06
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
OFF_NR, OFF_ARCH = 0, 4


def off_arg(i):
    return 16 + 8 * i  # low 32 bits (little endian)


AF = {"AF_UNIX": 1, "AF_LOCAL": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16,
      "AF_PACKET": 17}
CLONE_NEW_ALL = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 |
                 0x20000000 | 0x40000000)  # NS CGROUP UTS IPC USER PID NET


def syscall_numbers():
    table = {}
    with open("/usr/include/x86_64-linux-gnu/asm/unistd_64.h") as f:
        for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)", f.read()):
            table[m.group(1)] = int(m.group(2))
    return table


def expand(name, seen=None):
    """A syscall group's names (recursively), via systemd-analyze."""
    seen = seen if seen is not None else set()
    if not name.startswith("@"):
        return {name}
    if name in seen:
        return set()
    seen.add(name)
    out = subprocess.run(["systemd-analyze", "syscall-filter", name], capture_output=True,
                         text=True, check=True).stdout
    names = set()
    for line in out.splitlines()[1:]:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        names |= expand(line, seen)
    return names


def unit_options(path):
    opts = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith(("#", ";", "[")) or "=" not in line:
                continue
            key, value = line.split("=", 1)
            opts.setdefault(key, []).append(value)
    return opts


class Program:
    def __init__(self):
        self.insns = []

    def stmt(self, code, k):
        self.insns.append((code, 0, 0, k))

    def jump(self, code, k, jt, jf):
        self.insns.append((code, jt, jf, k))

    def load(self, offset):
        self.stmt(BPF_LD_W_ABS, offset)

    def ret(self, value):
        self.stmt(BPF_RET_K, value)


def errno_ret(e):
    return SECCOMP_RET_ERRNO | (e & 0xFFFF)


def build(opts, report):
    nr = syscall_numbers()
    p = Program()
    # Architecture: anything but x86-64 is killed (SystemCallArchitectures=native).
    p.load(OFF_ARCH)
    p.jump(BPF_JMP_JEQ_K, AUDIT_ARCH_X86_64, 1, 0)
    p.ret(SECCOMP_RET_KILL_PROCESS)
    p.load(OFF_NR)
    if opts.get("SystemCallArchitectures", [""])[-1] == "native":
        p.jump(BPF_JMP_JGE_K, X32_SYSCALL_BIT, 0, 1)  # x32 ABI
        p.ret(SECCOMP_RET_KILL_PROCESS)
        report.append("SystemCallArchitectures=native: non-x86-64 and x32 syscalls killed")

    err_name = opts.get("SystemCallErrorNumber", ["EPERM"])[-1]
    deny_errno = getattr(errno, err_name)
    denied = set()
    for value in opts.get("SystemCallFilter", []):
        if not value.startswith("~"):
            raise SystemExit("unit_seccomp: only deny-lists (SystemCallFilter=~...) are emulated")
        for item in value[1:].split():
            denied |= expand(item)
    known = sorted(n for n in denied if n in nr)
    for name in known:
        p.jump(BPF_JMP_JEQ_K, nr[name], 0, 1)
        p.ret(errno_ret(deny_errno))
    if denied:
        report.append("SystemCallFilter=~...: %d syscalls (%d exist on x86-64) fail with %s"
                      % (len(denied), len(known), err_name))

    def per_syscall(name, body):
        """if (nr == name) { body } -- body must end in a return."""
        start = len(p.insns)
        p.jump(BPF_JMP_JEQ_K, nr[name], 0, 0)
        body()
        skip = len(p.insns) - start - 1
        code, jt, _, k = p.insns[start]
        p.insns[start] = (code, jt, skip, k)
        p.load(OFF_NR)  # bodies load args; reload nr for the next test (harmless when skipped)

    families = opts.get("RestrictAddressFamilies", [])
    if families:
        allowed = sorted({AF[f] for v in families for f in v.split()})

        def family_check():
            p.load(off_arg(0))
            for i, fam in enumerate(allowed):
                # jump to "allow" (after the errno return) on a match
                p.jump(BPF_JMP_JEQ_K, fam, len(allowed) - i, 0)
            p.ret(errno_ret(errno.EAFNOSUPPORT))
            p.ret(SECCOMP_RET_ALLOW)

        per_syscall("socket", family_check)
        per_syscall("socketpair", family_check)
        report.append("RestrictAddressFamilies=%s: other socket families fail"
                      % " ".join(v for v in families))

    if opts.get("RestrictNamespaces", [""])[-1] == "yes":
        per_syscall("unshare", lambda: p.ret(errno_ret(errno.EPERM)))
        per_syscall("setns", lambda: p.ret(errno_ret(errno.EPERM)))
        per_syscall("clone3", lambda: p.ret(errno_ret(errno.ENOSYS)))

        def clone_check():
            p.load(off_arg(0))
            p.jump(BPF_JMP_JSET_K, CLONE_NEW_ALL, 0, 1)
            p.ret(errno_ret(errno.EPERM))
            p.ret(SECCOMP_RET_ALLOW)

        per_syscall("clone", clone_check)
        report.append("RestrictNamespaces=yes: unshare/setns/clone(CLONE_NEW*) fail, clone3 ENOSYS")

    if opts.get("LockPersonality", [""])[-1] == "yes":
        def personality_check():
            p.load(off_arg(0))
            p.jump(BPF_JMP_JEQ_K, 0, 2, 0)            # PER_LINUX
            p.jump(BPF_JMP_JEQ_K, 0xFFFFFFFF, 1, 0)   # query
            p.ret(errno_ret(errno.EPERM))
            p.ret(SECCOMP_RET_ALLOW)

        per_syscall("personality", personality_check)
        report.append("LockPersonality=yes: personality changes fail")

    if opts.get("RestrictRealtime", [""])[-1] == "yes":
        def policy_check(arg):
            def check():
                p.load(off_arg(arg))
                for i, policy in enumerate((1, 2, 6)):  # FIFO, RR, DEADLINE
                    p.jump(BPF_JMP_JEQ_K, policy, 3 - i, 0)
                p.ret(SECCOMP_RET_ALLOW)
                p.ret(errno_ret(errno.EPERM))
            return check

        per_syscall("sched_setscheduler", policy_check(1))
        report.append("RestrictRealtime=yes: realtime scheduling fails")

    p.ret(SECCOMP_RET_ALLOW)
    return p.insns


def load(insns):
    raw = b"".join(struct.pack("HBBI", *i) for i in insns)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Fprog(len(insns), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


def main():
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        raise SystemExit(__doc__)
    if platform.machine() != "x86_64":
        print("unit_seccomp: not x86-64; no filter", file=sys.stderr)
        sys.exit(77)
    report = []
    insns = build(unit_options(sys.argv[1]), report)
    if len(insns) > 4096:
        raise SystemExit("unit_seccomp: program too long")
    load(insns)
    # The report goes to $OPJIT_SECCOMP_REPORT_FD (closed before the exec), else stderr.
    fd = os.environ.pop("OPJIT_SECCOMP_REPORT_FD", "")
    out = os.fdopen(int(fd), "w") if fd else sys.stderr
    for line in report:
        print("seccomp: " + line, file=out)
    out.flush()
    if fd:
        out.close()
    os.execvp(sys.argv[3], sys.argv[3:])


if __name__ == "__main__":
    main()
