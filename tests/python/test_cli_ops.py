"""The opjit CLI as operators and scripts meet it: --version, per-command
help, one-line errors with fitting hints and exit codes for every command
(a wrong flag, a missing file, an unreachable address, a wrong token),
`opjit token` as deploy/README.md uses it, `opjit health`, `opjit info`'s
registry and cache tiers, progress on a terminal, the generated bash
completion and man pages.

Every daemon here is the test's own (its own temp dir); fake servers are
Python gRPC servers on loopback port 0.
"""

import gzip
import json
import os
import pty
import re
import shutil
import socket
import subprocess
import tempfile
import time
from concurrent import futures

import grpc
import pytest

from conftest import EXAMPLES, TempDaemon, opjitd_binary

BIN = os.path.dirname(opjitd_binary())
OPJIT = os.path.join(BIN, "opjit")
BUILD = os.path.dirname(BIN)
SOURCE = os.environ.get("OPJIT_SOURCE_DIR") or os.path.dirname(os.path.dirname(
    os.path.dirname(os.path.abspath(__file__))))

# Every command, with arguments that make it reach the server.
COMMANDS = ["info", "health", "register", "ops", "describe", "delete", "unquarantine", "compile",
            "run", "grad", "gradcheck", "verify", "bench", "cache", "stats", "token", "help"]


def server_args(cmd, tmp):
    spec = os.path.join(EXAMPLES, "leaky_relu.json")
    src = os.path.join(EXAMPLES, "leaky_relu.cc")
    return {"register": [spec], "describe": ["leaky_relu"], "delete": ["leaky_relu"],
            "unquarantine": ["leaky_relu"],
            "compile": [src], "run": ["leaky_relu"], "grad": ["leaky_relu"],
            "gradcheck": ["leaky_relu"], "verify": ["leaky_relu", "--against", "leaky_relu"],
            "bench": ["leaky_relu"], "cache": ["stats"]}.get(cmd, [])


def run(*args, env=None, timeout=120, **kw):
    e = dict(os.environ)
    e.pop("OPJIT_TOKEN", None)
    e.pop("OPJIT_SERVER", None)
    e.update(env or {})
    return subprocess.run([OPJIT] + list(args), capture_output=True, text=True, timeout=timeout,
                          env=e, **kw)


def one_line(r):
    err = r.stderr.strip("\n")
    assert err and "\n" not in err, "want one line on stderr, got:\n%s" % r.stderr
    return err


class OwnDaemon(TempDaemon):
    """opjitd with `config` on a unix socket and loopback TCP (port 0)."""

    def __init__(self, config):
        self.spawn(config, prefix="opjit-cli-", tcp=True)


class FakeServer:
    """A gRPC server on loopback answering `handlers` {method: fn(bytes) -> bytes}
    with raw bytes."""

    def __init__(self, handlers):
        class Generic(grpc.GenericRpcHandler):
            def service(self, details):
                fn = handlers.get(details.method)
                return grpc.unary_unary_rpc_method_handler(
                    lambda req, ctx: fn(req)) if fn else None

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((Generic(),))
        self.address = "127.0.0.1:%d" % self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def close(self):
        self.server.stop(0)


def test_version_names_the_git_revision():
    r = run("--version")
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"opjit \d+\.\d+\.\d+ \(git [0-9a-z.\-]+\)\n", r.stdout), r.stdout


def test_each_command_has_its_own_help():
    overview = run("--help")
    assert overview.returncode == 0
    assert run("help").stdout == overview.stdout
    for cmd in COMMANDS:
        assert re.search(r"^  %s\s" % cmd, overview.stdout, re.M), cmd
    assert "Exit status" in overview.stdout and "5 no server answered" in overview.stdout
    for args in (["run", "--help"], ["help", "run"], ["run", "-h"]):
        r = run(*args)
        assert r.returncode == 0, r.stderr
        assert "Usage: opjit run [OPTIONS] OP" in r.stdout
        for flag in ("--in", "--attr", "--out", "--version", "--target", "--transport", "--json"):
            assert flag in r.stdout, (flag, r.stdout)
        assert "--aot" not in r.stdout and "--grad-out" not in r.stdout
    r = run("compile", "--help")
    assert "--aot" in r.stdout and "--name-expr" in r.stdout and "--transport" not in r.stdout
    r = run("health", "--help")
    assert "--service" in r.stdout and "4 the server answered NOT_SERVING" in r.stdout


def test_bad_flag_is_one_line_and_exit_2():
    for cmd in COMMANDS:
        r = run(cmd, *server_args(cmd, None), "--bogus")
        assert r.returncode == 2, (cmd, r.returncode, r.stderr)
        line = one_line(r)
        assert "--bogus" in line and "opjit %s --help" % cmd in line, line
    # A flag of another command, a global flag after the command, a bad value.
    assert "unknown option --aot for `ops` (it takes --namespace, --all-versions)" in \
        one_line(run("ops", "--aot"))
    assert "--server goes before the command" in one_line(run("ops", "--server", "x"))
    r = run("describe", "x", "--version", "abc")
    assert r.returncode == 2 and "--version takes an integer" in one_line(r)
    r = run("--timeout", "0", "ops")
    assert r.returncode == 2 and "--timeout needs a positive number" in one_line(r)
    r = run("run", "x", "--transport", "carrier-pigeon")
    assert r.returncode == 2 and "--transport takes auto, shm, inline" in one_line(r)
    r = run("cache", "stats", "--memory-only")
    assert r.returncode == 2 and "--memory-only goes with `cache clear`" in one_line(r)
    r = run("cache", "purge")
    assert r.returncode == 2 and "cache takes stats or clear" in one_line(r)
    r = run("run")
    assert r.returncode == 2 and "OP is required" in one_line(r)
    r = run("frobnicate")
    assert r.returncode == 2 and "unknown command frobnicate" in one_line(r)
    r = run()
    assert r.returncode == 2 and "no command given" in one_line(r)


def test_missing_file_is_one_line_and_exit_1(daemon, tmp_path):
    missing = str(tmp_path / "missing")
    cases = {
        "register": [missing + ".json"],
        "compile": [missing + ".cc"],
        "run": ["leaky_relu", "--in", missing + ".npy"],
        "grad": ["leaky_relu", "--in", missing + ".npy"],
        "gradcheck": ["leaky_relu", "--in", missing + ".npy"],
        "verify": ["leaky_relu", "--in", missing + ".npy", "--expect", missing + ".npy"],
    }
    for cmd, args in cases.items():
        r = run("--server", daemon.unix_address, cmd, *args)
        assert r.returncode == 1, (cmd, r.returncode, r.stderr)
        line = one_line(r)
        assert "missing" in line and ("cannot read" in line or "No such file" in line), line


def test_unreachable_address_is_one_line_with_a_hint(tmp_path):
    none = "unix:%s/none.sock" % tmp_path
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = "127.0.0.1:%d" % s.getsockname()[1]
    for cmd in COMMANDS:
        if cmd in ("token", "help"):
            continue  # offline
        for address, hint in ((none, "is opjitd running? Start it with `make run`"),
                              (closed, "check the address")):
            r = run("--server", address, "--timeout", "5", cmd, *server_args(cmd, tmp_path))
            assert r.returncode == (5 if cmd == "health" else 1), (cmd, r.returncode, r.stderr)
            line = one_line(r)
            assert hint in line and address.replace("unix:", "") in line, (cmd, line)
    # A stale socket file: nothing listens on it.
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))
    r = run("--server", "unix:%s" % stale, "ops")
    assert r.returncode == 1 and "a stale socket" in one_line(r)


def test_permission_denied_says_so(tmp_path):
    # As root the socket's mode is not enforced: the client runs as nobody.
    if os.geteuid() != 0:
        pytest.skip("needs root to run the client as another user")
    d = tempfile.mkdtemp(prefix="opjit-cli-perm-")
    try:
        os.chmod(d, 0o755)
        # A copy nobody can run, wherever the build tree lies.
        cli = os.path.join(d, "opjit")
        shutil.copy(OPJIT, cli)
        os.chmod(cli, 0o755)
        path = os.path.join(d, "s.sock")
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path)
            s.listen(1)
            os.chmod(path, 0o600)
            r = subprocess.run([cli, "--server", "unix:" + path, "ops"], capture_output=True,
                               text=True, timeout=60, user=65534, group=65534,
                               env={"PATH": "/usr/bin:/bin"})
        assert r.returncode == 1
        line = one_line(r)
        assert "permission denied on %s" % path in line, line
        assert "socket_group" in line, line
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def token_daemon(tmp_path_factory):
    """A daemon whose admin principal's line comes from `opjit token`, run as
    deploy/README.md says; yields (daemon, token)."""
    work = tmp_path_factory.mktemp("token")
    readme = open(os.path.join(SOURCE, "deploy", "README.md")).read()
    make = re.search(r"^\(umask 077; opjit token > admin\.token\).*$", readme, re.M)
    paste = re.search(r"^grep '\^token_sha256' admin\.token.*$", readme, re.M)
    secret = re.search(r'--from-literal=admin-token="(\$\(.*admin\.token\))"', readme)
    assert make and paste and secret, "deploy/README.md no longer has the token commands"
    env = dict(os.environ, PATH=BIN + ":" + os.environ["PATH"])
    sh = lambda cmd: subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True,
                                     text=True, check=True).stdout
    sh(make.group(0))
    assert oct(os.stat(work / "admin.token").st_mode & 0o777) == "0o600"
    line = sh(paste.group(0).split("#")[0]).strip()
    token = sh("printf %s " + secret.group(1))
    assert re.fullmatch(r"[0-9a-f]{64}", token), token
    # The TOML line pastes as is.
    d = OwnDaemon('[[principal]]\nname = "admin"\nrole = "admin"\n%s\n' % line)
    yield d, token
    d.close()


def test_deploy_readme_token_commands_make_a_working_secret(token_daemon):
    d, token = token_daemon
    ok = run("--server", d.tcp_address, "ops", env={"OPJIT_TOKEN": token})
    assert ok.returncode == 0, ok.stderr + d.read_log()[-2000:]
    bad = run("--server", d.tcp_address, "ops", env={"OPJIT_TOKEN": "0" * 64})
    assert bad.returncode == 1
    assert "UNAUTHENTICATED" in one_line(bad)
    # The format scripts rely on, and the JSON form.
    out = run("token").stdout.splitlines()
    assert len(out) == 2 and re.fullmatch(r"token: [0-9a-f]{64}", out[0]), out
    assert re.fullmatch(r'token_sha256 = \["[0-9a-f]{64}"\]', out[1]), out
    j = json.loads(run("token", "--json").stdout)
    import hashlib
    assert hashlib.sha256(j["token"].encode()).hexdigest() == j["token_sha256"]


def test_wrong_token_is_one_line_and_exit_1(token_daemon, tmp_path):
    d, _ = token_daemon
    for cmd in COMMANDS:
        if cmd in ("token", "help", "health"):
            continue  # offline, or (health) answers without a token
        r = run("--server", d.tcp_address, cmd, *server_args(cmd, tmp_path),
                env={"OPJIT_TOKEN": "f" * 64})
        assert r.returncode == 1, (cmd, r.returncode, r.stderr)
        line = one_line(r)
        assert "UNAUTHENTICATED" in line and "OPJIT_TOKEN" in line, (cmd, line)
    r = run("--server", d.tcp_address, "ops")
    assert r.returncode == 1 and "no token given: set OPJIT_TOKEN" in one_line(r)
    # The health check needs no token (probes have none).
    r = run("--server", d.tcp_address, "health", env={"OPJIT_TOKEN": "f" * 64})
    assert r.returncode == 0, r.stderr


def test_health_exit_codes(daemon, tmp_path):
    r = run("--server", daemon.unix_address, "health")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "%s: SERVING\n" % daemon.unix_address
    r = run("--server", daemon.unix_address, "health", "--json")
    assert json.loads(r.stdout)["status"] == "SERVING"
    r = run("--server", daemon.unix_address, "health", "--service", "no.such.Service")
    assert r.returncode == 1 and "NOT_FOUND" in one_line(r)
    fake = FakeServer({"/grpc.health.v1.Health/Check": lambda req: b"\x08\x02"})
    try:
        r = run("--server", fake.address, "health")
        assert r.returncode == 4, r.stderr
        assert "NOT_SERVING" in one_line(r)
    finally:
        fake.close()
    r = run("--server", "unix:%s/none.sock" % tmp_path, "health")
    assert r.returncode == 5 and "no socket at" in one_line(r)


def test_health_checks_the_service_it_is_given():
    seen = []

    def check(req):
        seen.append(req)
        return b"\x08\x01"

    fake = FakeServer({"/grpc.health.v1.Health/Check": check})
    try:
        r = run("--server", fake.address, "health", "--service", "opjit.v1.Executor")
        assert r.returncode == 0, r.stderr
    finally:
        fake.close()
    assert seen == [b"\x0a\x11opjit.v1.Executor"]


def test_info_shows_the_registry_and_cache_tiers(tmp_path):
    with socket.socket() as s:  # a Redis that is not there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(32))
    os.chmod(key, 0o600)
    d = OwnDaemon('[cache.remote]\nurl = "redis://127.0.0.1:%d"\nkey_file = "%s"\ntimeout_ms = 200\n'
                  % (port, key))
    try:
        r = run("--server", d.unix_address, "info")
        assert r.returncode == 0, r.stderr
        assert re.search(r"^registry:  sqlite, (reachable|not checked yet)", r.stdout, re.M), r.stdout
        assert re.search(r"^cache:     memory reachable \(\d+ entries\)$", r.stdout, re.M)
        assert re.search(r"^cache:     disk   reachable \(\d+ entries\)$", r.stdout, re.M)
        assert "cache:     redis  not checked yet (connects at the first lookup)" in r.stdout, \
            r.stdout
        # A compile looks the kernel up in Redis: now it is known to be down.
        c = run("--server", d.unix_address, "compile", os.path.join(EXAMPLES, "leaky_relu.cc"))
        assert c.returncode == 0, c.stderr
        deadline = time.monotonic() + 30  # the store's first health probe runs at start
        while True:
            info = json.loads(run("--server", d.unix_address, "info", "--json").stdout)
            if info["registry_store"].get("checked") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert info["registry_store"]["name"] == "sqlite"
        assert info["registry_store"]["reachable"] is True, info["registry_store"]
        tiers = {t["name"]: t for t in info["cache_tiers"]}
        assert set(tiers) == {"memory", "disk", "redis"}
        assert tiers["memory"]["reachable"] and tiers["disk"]["reachable"]
        assert tiers["redis"]["enabled"] and not tiers["redis"]["reachable"], tiers["redis"]
        assert "in a row" in tiers["redis"]["detail"]
    finally:
        d.close()


def test_info_without_redis_says_off(daemon):
    r = run("--server", daemon.unix_address, "info")
    assert r.returncode == 0, r.stderr
    assert "cache:     redis  off" in r.stdout
    assert "registry:  sqlite, reachable" in r.stdout


def read_pty(master):
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace")


def test_progress_on_a_terminal_only():
    def slow_compile(req):
        time.sleep(2.5)
        return b""

    fake = FakeServer({"/opjit.v1.Compiler/Compile": slow_compile})
    src = os.path.join(EXAMPLES, "leaky_relu.cc")
    try:
        master, slave = pty.openpty()
        p = subprocess.Popen([OPJIT, "--server", fake.address, "compile", src],
                             stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL)
        os.close(slave)
        err = read_pty(master)
        out = p.stdout.read().decode()
        assert p.wait(60) == 0, err
        os.close(master)
        assert "\r  compiling\u2026 1s" in err, repr(err)
        assert "\r  compiling\u2026 2s" in err, repr(err)
        assert err.endswith("\r\x1b[K"), repr(err)  # the line is erased at the end
        assert "compiling" not in out
        # Not a terminal: nothing.
        r = run("--server", fake.address, "compile", src)
        assert r.returncode == 0 and r.stderr == "", r.stderr
    finally:
        fake.close()


def complete(words):
    """What the generated completion offers for `words` (the last one being
    completed)."""
    script = os.path.join(BUILD, "opjit.bash-completion")
    quoted = " ".join("'%s'" % w for w in words)
    cmd = ('source "%s"; COMP_WORDS=(%s); COMP_CWORD=%d; _opjit; printf "%%s\\n" "${COMPREPLY[@]}"'
           % (script, quoted, len(words) - 1))
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True,
                          check=True).stdout.split()


def test_bash_completion():
    assert complete(["opjit", "ru"]) == ["run"]
    assert set(complete(["opjit", ""])) == set(COMMANDS)
    assert complete(["opjit", "--server", "x", "gradc"]) == ["gradcheck"]
    assert complete(["opjit", "run", "--ta"]) == ["--target"]
    assert complete(["opjit", "run", "--tr"]) == ["--transport"]
    assert complete(["opjit", "run", "x", "--target", ""]) == ["cpu", "gpu"]
    assert complete(["opjit", "compile", "--lang", ""]) == ["c", "c++", "cuda"]
    assert complete(["opjit", "cache", ""]) == ["stats", "clear"]
    assert "--memory-only" in complete(["opjit", "cache", "clear", "--"])
    assert complete(["opjit", "--ti"]) == ["--timeout"]
    assert "--aot" not in complete(["opjit", "run", "--"])


def test_man_pages_are_generated():
    man = open(os.path.join(BUILD, "man", "opjit.1")).read()
    assert man.startswith('.\\" Generated') and ".TH OPJIT 1" in man
    for cmd in COMMANDS:
        assert '.SS "%s' % cmd in man, cmd
    assert ".SH EXIT STATUS" in man and ".SH ENVIRONMENT" in man
    with gzip.open(os.path.join(BUILD, "man", "opjit.1.gz"), "rt") as f:
        assert f.read() == man
    daemon_man = open(os.path.join(BUILD, "man", "opjitd.1")).read()
    assert ".TH OPJITD 1" in daemon_man and ".SH SYNOPSIS" in daemon_man
    assert "\\-\\-state\\-dir" in daemon_man
    if shutil.which("man"):
        r = subprocess.run(["man", "-l", os.path.join(BUILD, "man", "opjit.1")],
                           capture_output=True, text=True, env=dict(os.environ, MANWIDTH="80"))
        assert r.returncode == 0 and "gradcheck" in r.stdout, r.stderr


class FakeEvaluator(FakeServer):
    """opjit.v1.Evaluator answering `verify` and `bench` (responses), keeping
    the requests it got in `requests`."""

    def __init__(self, verify=None, bench=None, delay=0.0):
        from opjit.v1 import evaluate_pb2 as ev
        self.requests = []

        def answer(request_type, response):
            def fn(req):
                self.requests.append(request_type.FromString(req))
                time.sleep(delay)
                return response.SerializeToString()
            return fn

        super().__init__({
            "/opjit.v1.Evaluator/Verify": answer(ev.VerifyRequest, verify or ev.VerifyResponse()),
            "/opjit.v1.Evaluator/Benchmark": answer(ev.BenchmarkRequest,
                                                    bench or ev.BenchmarkResponse())})


def fake_verify_response(failed):
    from opjit.v1 import evaluate_pb2 as ev
    r = ev.VerifyResponse(passed=not failed, deterministic=True, seed=2**64 - 1,
                          cases_passed=1, cases_failed=int(failed), cases_skipped=1,
                          tolerances=["float32: atol=1e-05 rtol=1.3e-06 ulps=0"],
                          reproduce="opjit verify cand --against ref --seed 18446744073709551615")
    r.cases.add(index=0, kind="random", dtype="float32", shapes="float32[7], float32[7]",
                passed=True, deterministic=True, worst_index=-1)
    if failed:
        r.cases.add(index=1, kind="special", dtype="float32", shapes="float32[7], float32[7]",
                    max_abs_error=float("inf"), max_rel_error=0.5, max_ulp_error=1.5e7,
                    worst_output=0, worst_index=3, candidate_value=float("nan"),
                    reference_value=2.5, message="output 0 differs at [3]")
    r.cases.add(index=2, kind="random", dtype="float64", shapes="float64[0]", skipped=True,
                worst_index=-1, message="the reference refused float64")
    return r


def test_verify_sends_what_the_command_line_says():
    fake = FakeEvaluator(verify=fake_verify_response(False))
    try:
        r = run("--server", fake.address, "verify", "team/cand", "--against", "ref",
                "--shape", "4,5:5", "--shape", "[3];[]", "--shape", "7", "--dtype", "float32",
                "--dtype", "float16", "--seeds", "3", "--seed", str(2**64 - 1), "--low", "-1",
                "--high", "1.5", "--no-special", "--atol", "1e-3", "--ulps", "4",
                "--fp64-reference", "--inplace", "x", "--settle-ms", "20", "--attr", "alpha=2",
                "--version", "2", "--against-version", "1")
        assert r.returncode == 0, r.stderr
        plain = run("--server", fake.address, "verify", "cand", "--against", "default/ref")
        assert plain.returncode == 0, plain.stderr
    finally:
        fake.close()
    req, bare = fake.requests
    assert req.namespace == "team"
    assert (req.candidate.op, req.candidate.version) == ("cand", 2)
    assert (req.reference.op, req.reference.version) == ("ref", 1)
    assert [[list(i.values) for i in s.inputs] for s in req.shapes] == \
        [[[4, 5], [5]], [[3], []], [[7]]]
    assert list(req.dtypes) == ["float32", "float16"]
    assert (req.seeds, req.seed, req.low, req.high) == (3, 2**64 - 1, -1.0, 1.5)
    assert req.HasField("special_values") and not req.special_values
    assert req.tolerance.HasField("atol") and req.tolerance.atol == 1e-3
    assert not req.tolerance.HasField("rtol") and req.tolerance.ulps == 4
    assert req.fp64_reference and list(req.inplace_inputs) == ["x"] and req.settle_ms == 20
    assert req.attrs["alpha"].text == "2"
    # Nothing given: the server's defaults (special values on, its shapes and tolerances).
    assert (bare.namespace, bare.reference.op) == ("", "ref")
    assert not bare.HasField("special_values") and not bare.HasField("tolerance")
    assert len(bare.shapes) == 0 and bare.seed == 0 and not bare.given


def test_verify_prints_a_row_per_case_and_exits_3_on_a_failure():
    fake = FakeEvaluator(verify=fake_verify_response(True))
    try:
        r = run("--server", fake.address, "verify", "cand", "--against", "ref")
        j = run("--server", fake.address, "verify", "cand", "--against", "ref", "--json")
    finally:
        fake.close()
    assert r.returncode == 3, r.stderr
    lines = r.stdout.splitlines()
    assert re.match(r"  #\s+kind\s+dtype\s+shapes\s+result\s+max abs err\s+max rel err\s+max ulp"
                    r"\s+worst\s+candidate vs reference\s+message$", lines[0]), lines[0]
    assert re.match(r"  0\s+random\s+float32\s+float32\[7\], float32\[7\]\s+pass\s", lines[1])
    assert re.match(r"  1\s+special\s+float32\s+float32\[7\], float32\[7\]\s+FAIL\s+inf\s+0\.5\s+"
                    r"1\.5e\+07\s+out0\[3\]\s+nan vs 2\.5\s+output 0 differs at \[3\]$",
                    lines[2]), lines[2]
    assert re.match(r"  2\s+random\s+float64\s+float64\[0\]\s+skip\s+-\s+-\s+-\s+-\s+-\s+"
                    r"the reference refused float64$", lines[3]), lines[3]
    assert lines[4] == ("verify cand against ref: FAIL: 1 passed, 1 failed, 1 skipped; "
                        "deterministic; seed 18446744073709551615")
    assert lines[5] == "tolerances: float32: atol=1e-05 rtol=1.3e-06 ulps=0"
    assert lines[6] == "reproduce: opjit verify cand --against ref --seed 18446744073709551615"
    assert j.returncode == 3, j.stderr
    out = json.loads(j.stdout)  # protobuf's JSON: field names as in the proto
    assert [c["index"] for c in out["cases"]] == [0, 1, 2]
    assert out["cases"][1]["worst_index"] == "3" and out["cases"][1]["candidate_value"] == "NaN"
    assert out["seed"] == "18446744073709551615" and out["cases_failed"] == 1


def test_verify_given_case_sends_the_npy_files(tmp_path):
    import numpy as np
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", 2 * x)
    fake = FakeEvaluator(verify=fake_verify_response(False))
    try:
        r = run("--server", fake.address, "verify", "cand", "--in", str(tmp_path / "x.npy"),
                "--expect", str(tmp_path / "y.npy"))
    finally:
        fake.close()
    assert r.returncode == 0, r.stderr
    (req,) = fake.requests
    assert not req.HasField("reference") and len(req.given) == 1
    (case,) = req.given
    assert [list(t.shape) for t in case.inputs[0].tensors] == [[2, 3]]
    assert case.inputs[0].tensors[0].inline_data == x.tobytes()
    assert case.outputs[0].dtype == "float32" and case.outputs[0].inline_data == (2 * x).tobytes()


def test_bench_sends_and_prints_the_timings():
    from opjit.v1 import evaluate_pb2 as ev
    resp = ev.BenchmarkResponse(shapes="float32[7], float32[7]", ratio=0.98, ratio_p10=0.95,
                                ratio_p90=1.02, flush_bytes=64 << 20,
                                reproduce="opjit bench op --against ref --seed 9")
    resp.op.CopyFrom(ev.TimingStats(reps=812, median_ms=0.4123, p10_ms=0.4011, p90_ms=0.455,
                                    kernel_median_ms=0.3, kernel_p10_ms=0.29,
                                    kernel_p90_ms=0.31, spread=0.131))
    resp.reference.CopyFrom(ev.TimingStats(reps=812, median_ms=0.5, p10_ms=0.45, p90_ms=0.6,
                                           kernel_median_ms=0.31, kernel_p10_ms=0.3,
                                           kernel_p90_ms=0.33, spread=0.3))
    fake = FakeEvaluator(bench=resp)
    try:
        r = run("--server", fake.address, "bench", "team/op", "--against", "ref", "--shape", "7",
                "--dtype", "float32", "--warmup", "1", "--min-reps", "3", "--max-reps", "9",
                "--min-time-ms", "40", "--flush-cache", "--seed", "9", "--attr", "k=v")
        j = run("--server", fake.address, "bench", "op", "--json")
    finally:
        fake.close()
    assert r.returncode == 0, r.stderr
    req = fake.requests[0]
    assert (req.namespace, req.op.op, req.reference.op) == ("team", "op", "ref")
    assert [list(i.values) for i in req.shape.inputs] == [[7]]
    assert (req.dtype, req.warmup, req.min_reps, req.max_reps, req.min_time_ms) == \
        ("float32", 1, 3, 9, 40)
    assert req.flush_cache and req.seed == 9 and req.attrs["k"].text == "v"
    lines = r.stdout.splitlines()
    assert lines[0] == ("bench team/op (float32[7], float32[7]): cache flushed before every run "
                        "(64 MiB)")
    assert re.match(r"\s+time\s+reps\s+median ms\s+p10 ms\s+p90 ms\s+spread$", lines[1]), lines[1]
    assert re.match(r"  team/op\s+end-to-end\s+812\s+0\.4123\s+0\.4011\s+0\.455\s+13\.1%$",
                    lines[2]), lines[2]
    assert re.match(r"\s+kernel\s+0\.3\s+0\.29\s+0\.31$", lines[3]), lines[3]
    assert re.match(r"  ref\s+end-to-end\s+812\s+0\.5\s+0\.45\s+0\.6\s+30\.0%$", lines[4]), lines[4]
    assert lines[6] == "ratio team/op / ref (kernel time): 0.98 (p10 0.95, p90 1.02)"
    assert lines[7] == "reproduce: opjit bench op --against ref --seed 9"
    assert j.returncode == 0, j.stderr
    out = json.loads(j.stdout)
    assert out["op"]["reps"] == 812 and out["ratio"] == 0.98
    assert fake.requests[1].op.op == "op" and not fake.requests[1].HasField("reference")


def test_verify_and_bench_usage_errors_are_one_line():
    for args, want in (
            (["verify", "cand"], "verify needs --against REF"),
            (["verify", "cand", "--against", "r", "--in", "x.npy"], "not with --against"),
            (["verify", "cand", "--against", "other/r"], "the reference must be in the "
                                                           "candidate's namespace"),
            (["verify", "cand", "--against", "r", "--shape", "4,x"], "--shape takes dimensions"),
            (["verify", "cand", "--against", "r", "--shape", "-4"], "--shape takes dimensions"),
            (["verify", "cand", "--against", "r", "--low", "1"], "--low and --high go together"),
            (["verify", "cand", "--against", "r", "--seed", "-1"], "--seed takes a whole number"),
            (["verify", "cand", "--against", "r", "--seeds", str(2**32)],
             "--seeds takes a whole number from 0 to 4294967295"),
            (["verify", "cand", "--against", "r", "--atol", "tiny"], "--atol takes a number"),
            (["bench", "op", "--max-reps", "many"], "--max-reps takes a whole number"),
            (["bench", "op", "--shape", "7", "--shape", "8"], "--shape"),
            (["bench", "op", "--against", "x/r"], "the reference must be in")):
        r = run("--server", "unix:/nonexistent.sock", *args)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        line = one_line(r)
        assert want in line and "opjit %s --help" % args[0] in line, (args, line)


def test_verify_past_the_deadline_says_to_raise_timeout():
    fake = FakeEvaluator(verify=fake_verify_response(False), delay=3)
    try:
        r = run("--server", fake.address, "--timeout", "1", "verify", "cand", "--against", "ref")
    finally:
        fake.close()
    assert r.returncode == 1
    line = one_line(r)
    assert "DEADLINE_EXCEEDED" in line and "--timeout, 1 s" in line, line


def test_verify_and_bench_on_a_daemon_without_the_evaluator():
    fake = FakeServer({})  # answers UNIMPLEMENTED to everything
    try:
        for cmd in (["verify", "cand", "--against", "ref"], ["bench", "op"]):
            r = run("--server", fake.address, *cmd)
            assert r.returncode == 1, (cmd, r.returncode, r.stderr)
            line = one_line(r)
            assert line.startswith("opjit: UNIMPLEMENTED: ") and \
                "no opjit.v1.Evaluator service: it is older than `opjit %s`" % cmd[0] in line, line
    finally:
        fake.close()
