"""The package's config (deploy/opjitd.toml) makes a member of the socket's
group nobody special (issue 41, "Safe operator defaults"): root and the
daemon's user are admins, anyone else is refused until a [[principal]] names
their uid, and the principal deploy/README.md shows ("user" in a namespace of
their own) may not clear the cache. The daemon runs with the shipped file as
it is, plus that principal after a SIGHUP."""

import os
import re
import signal
import subprocess
import time

import pytest

from conftest import TempDaemon, wait_for

SOURCE_DIR = os.environ.get("OPJIT_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = os.path.join(SOURCE_DIR, "deploy", "opjitd.toml")
MEMBER_UID = 65534  # nobody, given the socket's group as a supplementary group

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to call as another uid")


def cli_binary():
    return os.path.join(os.path.dirname(os.environ.get("OPJITD", "opjitd")), "opjit")


def as_member(*argv, server):
    def drop():
        os.setgroups([os.getgid()])  # the socket's group (0660), as `usermod -aG` gives it
        os.setgid(MEMBER_UID)
        os.setuid(MEMBER_UID)
    return subprocess.run([cli_binary(), "--server", server] + list(argv), preexec_fn=drop,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def packaged():
    with open(SHIPPED) as f:
        shipped = f.read()
    # Access is what is tested here. The ATen profile's PCH, which the shipped
    # config builds at start (about 30 s of CPU per daemon), is test_aten's.
    assert "\npch_at_start = true\n" in shipped
    shipped = shipped.replace("\npch_at_start = true\n", "\npch_at_start = false\n")
    d = TempDaemon()
    d.spawn(shipped, prefix="opjit-pa-", serving=True)
    os.chmod(d.dir, 0o755)
    yield d
    d.proc.terminate()
    d.proc.wait(timeout=30)


def test_check_config_of_the_packaged_file_reports_the_units_paths(tmp_path):
    unit = open(os.path.join(SOURCE_DIR, "deploy", "systemd", "opjitd.service")).read()
    exec_start = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1).split()
    flag = lambda name: exec_start[exec_start.index(name) + 1]
    assert flag("--config") == "/etc/opjit/opjitd.toml"
    env = dict(os.environ, HOME=str(tmp_path / "home"), OPJIT_STATE_DIR=str(tmp_path / "s"))
    r = subprocess.run([os.environ.get("OPJITD", "opjitd"), "--check-config", SHIPPED],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert ", listen %s, " % flag("--listen") in r.stdout, (r.stdout, flag("--listen"))
    with open(SHIPPED) as f:
        assert '\nstate_dir = "%s"\n' % flag("--state-dir") in f.read()
    assert not os.path.exists(tmp_path / "home") and not os.path.exists(tmp_path / "s")


def test_a_group_member_is_no_admin_under_the_packaged_config(packaged):
    server = packaged.unix_address
    # Unlisted: refused, though the socket lets them in.
    r = as_member("cache", "clear", server=server)
    assert r.returncode != 0, r.stdout
    assert "UNAUTHENTICATED" in r.stderr, r.stderr
    print("unlisted member:", r.stderr.strip())
    # Root is the admin; the packaged config has no metrics endpoint.
    r = subprocess.run([cli_binary(), "--server", server, "info"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "\nmetrics:   off\n" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([cli_binary(), "--server", server, "cache", "clear"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # deploy/README.md's principal for a user: "user" in their own namespace.
    with open(packaged.config_path, "a") as f:
        f.write('\n[[principal]]\nname = "member"\nrole = "user"\nnamespaces = ["member"]\n'
                'uids = [%d]\n' % MEMBER_UID)
    packaged.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: as_member("info", server=server).returncode == 0, 30,
             "the reload to let the member in")
    r = as_member("cache", "clear", server=server)
    assert r.returncode != 0, r.stdout
    assert "PERMISSION_DENIED" in r.stderr, r.stderr
    print("user member:", r.stderr.strip())


def test_a_second_daemon_on_a_live_socket_is_refused_before_it_creates_its_state_dir(packaged):
    state = os.path.join(packaged.dir, "second-state")
    r = subprocess.run([os.environ.get("OPJITD", "opjitd"), "--config", SHIPPED, "--state-dir",
                        state, "--listen", packaged.unix_address],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "already listening on %s" % packaged.unix_address in r.stdout + r.stderr, \
        r.stdout + r.stderr
    assert not os.path.exists(state)
    assert packaged.answers()  # the first one goes on
