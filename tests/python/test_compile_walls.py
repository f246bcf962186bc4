"""Compiles read only what the README lists, and nothing of another
namespace (issue 27, item 4).

On a daemon of its own with principals (alice in "alice", bob in "bob", an
admin; test_access.AuthDaemon):
  1. a kernel whose inline assembly `.incbin`s a host file (/etc/os-release),
     a file of the daemon's state directory (its registry database, alice's
     precompiled preamble under <state>/cache/pch) or a header the compile
     may read, and copies the bytes to its output, fails to compile with
     COMPILE_FAILED; the bytes never come back (before issue 27 the
     os-release and PCH variants returned them);
  2. an #include of a file outside the allowed directories is "file not
     found", as before;
  3. preamble PCHs are per namespace: alice's second kernel with the same
     include block reuses her PCH, bob's compile of the same block builds
     his own, and bob cannot read alice's (above);
  4. GetServerInfo shows non-admins no host path in any field (the unix
     socket's path used to show); the admin still sees it and the state
     directory;
  5. compile workers run as the compile uid ([compiler] uid): not root, not
     the daemon's, no executor's, with CAP_DAC_READ_SEARCH alone, and still
     compile (and precompile) a kernel whose include block reads a header of
     a 0700 include directory of root's (issue 27, item 1).
"""

import os
import shutil
import tempfile

import pytest

import numpy as np

import opjit

from test_access import AuthDaemon
from conftest import unary_spec, wait_for
from test_tenant_walls import _descendants, executors, helpers

with open("/etc/os-release", "rb") as _f:
    OS_RELEASE = _f.read()

# y[i] = the i-th byte of what the assembler pastes in at `blob` (as a float),
# for the first k bytes.
INCBIN = r"""#include <cstdint>
%(asm)s
extern "C" const unsigned char blob[];
extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  int64_t k = 1;
  for (int i = 0; i < nd[0]; ++i) k *= s[0][i];
  float* y = static_cast<float*>(p[1]);
  for (int64_t i = 0; i < k; ++i) y[i] = blob[i];
  return 0;
}
"""


def incbin_source(path, macro=False):
    """A kernel that pastes `path` in with .incbin: spelled out, or (macro)
    put together by an assembler macro so that no text check sees it."""
    if macro:
        body = r'.macro paste a\n.inc\\a \"%s\"\n.endm\nblob: paste bin' % path
    else:
        body = r'blob: .incbin \"%s\"' % path
    return INCBIN % {"asm": 'asm(".section .rodata\\n.globl blob\\n%s\\n.byte 0\\n.text");' % body}


# A kernel with an include block (its preamble, precompiled per namespace).
PREAMBLE = "#include <cmath>\n#include <vector>\n#define WALLS_PREAMBLE 1\n"


def preamble_kernel(n):
    return PREAMBLE + ('extern "C" float F%d(float x) { return std::sqrt(x) * %d; }\n' % (n, n))


# The default [compiler] uid: the uid right after the default [exec] uid_range.
COMPILE_UID = 1879113728


@pytest.fixture(scope="module")
def private_include():
    """An extra include directory as operators keep them: root's, 0700, in a
    0700 directory, its header 0600."""
    top = tempfile.mkdtemp(prefix="opjit-walls-inc-")
    inc = os.path.join(top, "include")
    os.mkdir(inc, 0o700)
    path = os.path.join(inc, "walls_private.h")
    with open(path, "w") as f:
        f.write("#pragma once\n#define WALLS_PRIVATE_SCALE 3.0f\n")
    os.chmod(path, 0o600)
    yield inc
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="module")
def d(private_include):
    daemon = AuthDaemon(extra='[compiler]\nextra_include_dirs = ["%s"]\n' % private_include)
    yield daemon
    assert daemon.proc.poll() is None, "opjitd died:\n" + daemon.read_log()
    daemon.close()


def pch_files(d):
    path = os.path.join(d.state, "cache", "pch")
    return sorted(n for n in os.listdir(path) if n.endswith(".pch")) if os.path.isdir(path) else []


@pytest.fixture(scope="module")
def alice_pch(d):
    """The path of alice's PCH of PREAMBLE (her compile builds it)."""
    before = set(pch_files(d))
    with d.client("alice", "alice") as c:
        c.compile(preamble_kernel(1))
    new = sorted(set(pch_files(d)) - before)
    assert len(new) == 1, (before, new)
    return os.path.join(d.state, "cache", "pch", new[0])


def assert_refused(d, who, source, leaked, name):
    """`who` registers an op built from `source`: COMPILE_FAILED, and no
    byte run of `leaked` in what comes back."""
    with d.client(who, who) as c:
        with pytest.raises(opjit.InvalidArgument) as e:
            c.register(unary_spec(name, source, namespace=who))
    assert e.value.reason == "COMPILE_FAILED", str(e.value)
    text = str(e.value).encode()
    for line in leaked.split(b"\n"):
        if len(line) >= 8:
            assert line not in text, "leaked %r" % line
    # And nothing was registered that could return them.
    with d.client(who, who) as c:
        assert name not in [r.op.name for r in c.ops()]
    return str(e.value)


# ---- 1. the assembler reads no file ----------------------------------------------------------

@pytest.mark.parametrize("macro", [False, True], ids=["spelled", "macro"])
def test_incbin_of_a_host_file_fails_and_leaks_nothing(d, macro):
    msg = assert_refused(d, "alice", incbin_source("/etc/os-release", macro), OS_RELEASE,
                         "walls_os_release_%d" % macro)
    if not macro:
        assert "inline assembly may not read files" in msg, msg


@pytest.mark.parametrize("macro", [False, True], ids=["spelled", "macro"])
def test_incbin_of_another_namespaces_pch_fails(d, alice_pch, macro):
    with open(alice_pch, "rb") as f:
        pch = f.read()
    assert b"WALLS_PREAMBLE" in pch  # what bob is after
    msg = assert_refused(d, "bob", incbin_source(alice_pch, macro), pch[:4096],
                         "walls_pch_%d" % macro)
    assert "WALLS_PREAMBLE" not in msg
    # Alice's own compile cannot read it either: no compile reads the PCH
    # directory; a compile gets its one PCH as a descriptor.
    assert_refused(d, "alice", incbin_source(alice_pch, True), pch[:4096], "walls_own_pch")


def test_incbin_of_the_state_dir_and_of_a_header_fails(d):
    db = [os.path.join(d.state, n) for n in os.listdir(d.state)
          if os.path.isfile(os.path.join(d.state, n))]
    assert db, os.listdir(d.state)
    for i, path in enumerate(db[:3]):
        with open(path, "rb") as f:
            content = f.read(4096)
        assert_refused(d, "bob", incbin_source(path, True), content, "walls_state_%d" % i)
    # A header the compile may #include is not the assembler's to paste.
    with open("/usr/include/stdio.h", "rb") as f:
        stdio = f.read()
    assert_refused(d, "bob", incbin_source("/usr/include/stdio.h", True), stdio, "walls_header")


def test_assembly_that_reads_nothing_still_works(d):
    src = INCBIN % {"asm": 'asm(".section .rodata\\n.globl blob\\nblob: .byte 7, 8, 9\\n.text");'}
    with d.client("alice", "alice") as c:
        c.register(unary_spec("walls_asm_ok", src, namespace="alice"))
        y = c.op("walls_asm_ok")(np.zeros(3, np.float32))
    assert list(y) == [7.0, 8.0, 9.0]


# ---- 2. includes outside the allowed directories -------------------------------------------

def test_include_outside_the_allowed_dirs_is_not_found(d, alice_pch):
    header = alice_pch[:-4] + ".h"
    for path, content in [("/etc/os-release", OS_RELEASE),
                          (header, open(header, "rb").read()),
                          (alice_pch, open(alice_pch, "rb").read(4096))]:
        src = '#include "%s"\nextern "C" int K() { return 0; }\n' % path
        with d.client("bob", "bob") as c:
            with pytest.raises(opjit.InvalidArgument) as e:
                c.compile(src)
        assert e.value.reason == "COMPILE_FAILED"
        assert "file not found" in str(e.value), str(e.value)
        for line in content.split(b"\n"):
            if len(line) >= 8:
                assert line not in str(e.value).encode()


# ---- 3. PCHs are per namespace and reused ----------------------------------------------------

def test_pchs_are_per_namespace_and_reused(d, alice_pch):
    before = pch_files(d)
    with d.client("alice", "alice") as c:
        c.compile(preamble_kernel(2))  # the same include block: her PCH
    assert pch_files(d) == before, "alice's second kernel reuses her PCH"
    with d.client("bob", "bob") as c:
        c.compile(preamble_kernel(3))
        after_bob = pch_files(d)
        c.compile(preamble_kernel(4))
    assert len(after_bob) == len(before) + 1, "bob's PCH is his own"
    assert pch_files(d) == after_bob, "bob's second kernel reuses his"
    assert os.stat(os.path.dirname(alice_pch)).st_mode & 0o077 == 0


# ---- 4. ServerInfo shows non-admins no host path ---------------------------------------------

def strings_of(msg, prefix=""):
    """(field path, value) of every string in a protobuf message, recursively."""
    out = []
    for field, value in msg.ListFields():
        repeated = field.label == field.LABEL_REPEATED
        for i, v in enumerate(value if repeated else [value]):
            name = prefix + field.name + ("[%d]" % i if repeated else "")
            if field.type == field.TYPE_MESSAGE:
                out += strings_of(v, name + ".")
            elif isinstance(v, str):
                out.append((name, v))
    return out


def test_server_info_shows_non_admins_no_host_path(d):
    for who in ("alice", "bob"):
        with d.client(who) as c:
            info = c.info()
        assert info.role == "user"
        fields = strings_of(info)
        assert any(n.startswith("listen") for n, _ in fields)
        for name, value in fields:
            assert "/" not in value, "%s shows %r to %s" % (name, value, who)
        assert info.state_dir == ""
    with d.client("admin") as c:
        info = c.info()
    assert info.state_dir == d.state
    assert any(d.dir in l for l in info.listen), list(info.listen)


# ---- 5. compile workers run as the compile uid ----------------------------------------------

# y = x * WALLS_PRIVATE_SCALE, from a header of the 0700 include dir, in the
# include block (so it is precompiled too).
PRIVATE_KERNEL = r"""#include <cstdint>
#include <walls_private.h>
extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  int64_t k = 1;
  for (int i = 0; i < nd[0]; ++i) k *= s[0][i];
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  for (int64_t i = 0; i < k; ++i) y[i] = x[i] * WALLS_PRIVATE_SCALE * %d;
  return 0;
}
"""


def status_of(pid):
    """{field: value} of /proc/<pid>/status."""
    with open("/proc/%d/status" % pid) as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def compile_workers(daemon_pid):
    """{pid: status} of the daemon's compile workers (not the health
    monitor's short-lived --probe runs, which load nothing)."""
    out = {}
    for pid in helpers(daemon_pid, "opjit-compile"):
        try:
            out[pid] = status_of(pid)
        except OSError:
            continue
    return out


def test_compile_workers_run_as_the_compile_uid_and_read_a_private_include_dir(d):
    if os.geteuid() != 0:
        pytest.skip("compile workers switch uid only on a root daemon")
    before = set(pch_files(d))
    with d.client("alice", "alice") as c:
        for n in (1, 2):  # the second reuses the first's PCH
            c.register(unary_spec("walls_private_%d" % n, PRIVATE_KERNEL % n, namespace="alice"))
            y = c.op("walls_private_%d" % n)(np.ones(4, np.float32))
            assert list(y) == [3.0 * n] * 4
        assert len(set(pch_files(d)) - before) == 1, "one PCH of the private include block"
        executor_uids = {int(status_of(pid)["Uid"].split()[0]) for pid in executors(d.proc.pid)}
        assert executor_uids, "the ops' executors are running"
    daemon_uid = int(status_of(d.proc.pid)["Uid"].split()[0])
    # Once clang is loaded the worker has switched (the one started ahead of
    # the next compile may still be loading).
    switched = wait_for(lambda: {p: s for p, s in compile_workers(d.proc.pid).items()
                                 if s["Uid"].split()[0] != "0"} or None,
                        60, "a compile worker past its start")
    for pid, s in switched.items():
        uids = {int(u) for u in s["Uid"].split()}
        gids = {int(g) for g in s["Gid"].split()}
        assert uids == gids == {COMPILE_UID}, (pid, s["Uid"], s["Gid"])
        assert COMPILE_UID not in executor_uids | {0, daemon_uid}, executor_uids
        assert s["Groups"].strip() == "", s["Groups"]
        one = "%016x" % (1 << 2)  # CAP_DAC_READ_SEARCH
        for field in ("CapEff", "CapPrm", "CapBnd"):
            assert s[field] == one, (pid, field, s[field])
        assert s["CapInh"] == s["CapAmb"] == "0" * 16, (s["CapInh"], s["CapAmb"])
        assert s["NoNewPrivs"] == "1"
    # None of the settled workers kept root.
    for pid, s in compile_workers(d.proc.pid).items():
        if s["Uid"].split()[0] == "0":
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                assert b"--uid" in f.read(), "compile worker %d started without --uid" % pid
    assert "compile workers run as uid %d" % COMPILE_UID in d.read_log()


# ---- a non-root daemon (as the package's unit runs it) ---------------------------------------

def test_a_non_root_daemons_compiles_read_nothing_either():
    """The same walls on opjitd running as nobody (its compile workers share
    its uid, and so could read its state directory but for the walls)."""
    if os.geteuid() != 0:
        pytest.skip("starting a daemon as nobody needs root")
    import shutil
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    from test_tenant_walls import NobodyDaemon
    d = NobodyDaemon()
    try:
        with opjit.Client(d.unix_address, timeout=120) as c:
            c.compile(preamble_kernel(1), namespace="alice")
            pchs = [os.path.join(d.state, "cache", "pch", n) for n in pch_files(d)]
            assert len(pchs) == 1, pchs
            with open(pchs[0], "rb") as f:
                pch = f.read(4096)
            for i, (path, content) in enumerate([("/etc/os-release", OS_RELEASE),
                                                 (pchs[0], pch)]):
                for macro in (False, True):
                    with pytest.raises(opjit.InvalidArgument) as e:
                        c.register(unary_spec("nr_%d_%d" % (i, macro),
                                              incbin_source(path, macro), namespace="bob"))
                    assert e.value.reason == "COMPILE_FAILED", str(e.value)
                    for line in content.split(b"\n"):
                        if len(line) >= 8:
                            assert line not in str(e.value).encode()
    finally:
        d.close()


def test_a_non_root_daemons_compile_workers_run_as_a_subordinate_uid_of_their_own():
    """With subordinate ids (as the package sets up for its user), the
    compile workers of opjitd running as nobody run as the last of them,
    which no executor gets and which is not the daemon's, in user and PID
    namespaces of their own that map the daemon's ids too: with
    CAP_DAC_READ_SEARCH alone there, they still read the daemon's 0700
    include directory."""
    if os.geteuid() != 0:
        pytest.skip("starting a daemon as nobody needs root")
    from test_tenant_walls import NOBODY, SubuidDaemon
    top = tempfile.mkdtemp(prefix="opjit-walls-sub-")
    inc = os.path.join(top, "include")
    os.mkdir(inc, 0o700)
    with open(os.path.join(inc, "walls_private.h"), "w") as f:
        f.write("#pragma once\n#define WALLS_PRIVATE_SCALE 3.0f\n")
    os.chmod(os.path.join(inc, "walls_private.h"), 0o600)
    for path in (top, inc, os.path.join(inc, "walls_private.h")):
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    os.chmod(top, 0o700)
    d = SubuidDaemon(config='[compiler]\nextra_include_dirs = ["%s"]\n' % inc)
    try:
        compile_uid, compile_gid = d.first + d.count - 1, d.gid_first + d.count - 1
        with opjit.Client(d.unix_address, timeout=120) as c:
            # The first builds the include block's PCH (its worker is then
            # recycled), the second reuses it.
            for n in (1, 2):
                c.register(unary_spec("walls_private_%d" % n, PRIVATE_KERNEL % n,
                                      namespace="alice"))
                y = c.op("alice/walls_private_%d" % n)(np.ones(4, np.float32))
                assert list(y) == [3.0 * n] * 4
            executor_uids = {int(status_of(pid)["Uid"].split()[0])
                             for pid in executors(d.proc.pid)}
        assert executor_uids and compile_uid not in executor_uids, executor_uids
        own_user_ns = os.readlink("/proc/%d/ns/user" % d.proc.pid)
        workers = wait_for(lambda: {p: s for p, s in compile_workers(d.proc.pid).items()
                                    if s["Uid"].split()[0] != str(NOBODY.pw_uid)} or None,
                           60, "a compile worker")
        for pid, s in workers.items():
            assert {int(u) for u in s["Uid"].split()} == {compile_uid}, s["Uid"]
            assert {int(g) for g in s["Gid"].split()} == {compile_gid}, s["Gid"]
            assert s["NSpid"].split()[-1] == "1", s["NSpid"]  # process 1 of its own
            assert os.readlink("/proc/%d/ns/user" % pid) != own_user_ns
            one = "%016x" % (1 << 2)  # CAP_DAC_READ_SEARCH, in its own user namespace
            for field in ("CapEff", "CapPrm", "CapBnd"):
                assert s[field] == one, (pid, field, s[field])
            assert s["NoNewPrivs"] == "1"
        assert "compile workers run as subordinate uid %d" % compile_uid in d.read_log()
    finally:
        d.close()
        shutil.rmtree(top, ignore_errors=True)


NVCC_TOOLS = {"nvcc", "cicc", "ptxas", "cudafe++", "fatbinary", "nvlink", "gcc", "cc1plus", "as",
              "ld", "collect2"}


def test_a_non_root_daemons_nvcc_runs_as_its_compile_subordinate_uid():
    """nvcc (MindSpore aot .cu kernels) on opjitd as nobody with subordinate
    ids: it and every tool it starts run as the compile uid (the last
    subordinate uid), below a PID namespace of their own; the temp dir's ACL
    lets that uid work there, and the daemon reads the object back."""
    if os.geteuid() != 0:
        pytest.skip("starting a daemon as nobody needs root")
    if not os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
        pytest.skip("no nvcc in /usr/local/cuda")
    import threading
    import time
    from conftest import REPO
    from test_tenant_walls import SubuidDaemon
    with open(os.path.join(REPO, "kernels", "examples", "add_aot.cu")) as f:
        source = f.read()
    d = SubuidDaemon()
    seen, done = {}, threading.Event()

    def watch():
        while not done.is_set():
            for pid, comm in _descendants(d.proc.pid).items():
                if comm in NVCC_TOOLS:
                    try:
                        # A compile's (not `nvcc --version`, which the daemon
                        # runs itself for cache keys): it names the temp dir.
                        with open("/proc/%d/cmdline" % pid, "rb") as f:
                            if b"opjit-nvcc-" not in f.read():
                                continue
                        s = status_of(pid)
                        seen[pid] = (comm, int(s["Uid"].split()[0]), s["NSpid"])
                    except (OSError, KeyError):
                        pass
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with opjit.Client(d.unix_address, timeout=300) as c:
            r = c.compile(source, entry="CustomAddGpu", language="cuda", target="GPU",
                          namespace="alice")
            assert r.cache_key and r.cache_hit == "" and r.binary_bytes > 0, r
    finally:
        done.set()
        watcher.join()
        log = d.read_log()
        d.close()
    compile_uid = d.first + d.count - 1
    assert seen, "no nvcc process was seen"
    for pid, (comm, uid, nspid) in seen.items():
        assert uid == compile_uid, (pid, comm, uid)
        assert "\t" in nspid, (pid, comm, nspid)  # below a PID namespace of its own
    assert "nvcc runs as opjitd's own uid" not in log
