"""Throwaway services for the tests' own daemons: a PostgreSQL cluster and a
redis-server, each on a free loopback port in a temp dir of the test's.

Used by test_cluster.py (the registry and cache tier of three daemons),
test_cache_keys.py (the cache tier) and test_daemon_ops.py (a PostgreSQL
stopped and started again under a running daemon).
"""

import os
import pwd
import socket
import subprocess

from conftest import free_port, wait_for

PG_BIN = "/usr/lib/postgresql/15/bin"
REDIS = "/usr/bin/redis-server"


class Postgres:
    """A PostgreSQL cluster in `root`/pg, owned and run by `nobody`
    (PostgreSQL refuses root): `root` must be traversable by it."""

    def __init__(self, root):
        self.root = root
        self.data = os.path.join(root, "pg")
        self.port = free_port()
        self.log = os.path.join(root, "pg.log")
        nobody = pwd.getpwnam("nobody")
        self.uid, self.gid = nobody.pw_uid, nobody.pw_gid

    def _run(self, *argv):
        # As nobody through setpriv, not a preexec_fn: that makes Python fork
        # rather than vfork, and gRPC's fork handler (grpcio 1.51) then waits
        # for a busy client's thread pool to idle, forever (a hang seen in the
        # sanitizer run).
        if os.getuid() == 0:
            argv = ("setpriv", "--reuid=%d" % self.uid, "--regid=%d" % self.gid,
                    "--clear-groups") + argv
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       cwd="/")

    def start(self):
        os.makedirs(self.data, mode=0o700)
        if os.getuid() == 0:
            os.chown(self.data, self.uid, self.gid)
            open(self.log, "w").close()
            os.chown(self.log, self.uid, self.gid)
        if not os.path.exists(os.path.join(self.data, "PG_VERSION")):
            self._run(PG_BIN + "/initdb", "-D", self.data, "-U", "opjit", "--auth=trust",
                      "-E", "UTF8", "--no-instructions")
        self.restart()
        return self

    def restart(self):
        """Starts the server (again, after stop()): the same data dir and port."""
        self._run(PG_BIN + "/pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "60", "-o",
                  "-p %d -k %s -c listen_addresses=127.0.0.1" % (self.port, self.data), "start")

    def createdb(self, name):
        self._run(PG_BIN + "/psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "opjit",
                  "-d", "postgres", "-q", "-c", "CREATE DATABASE %s" % name)

    def url(self, db):
        return "host=127.0.0.1 port=%d dbname=%s user=opjit connect_timeout=5" % (self.port, db)

    def stop(self):
        try:
            self._run(PG_BIN + "/pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
        except subprocess.CalledProcessError:
            pass


class Redis:
    """A redis-server in `root`/redis, without persistence."""

    def __init__(self, root):
        self.dir = os.path.join(root, "redis")
        os.makedirs(self.dir)
        self.port = free_port()
        self.proc = None
        self.log = None

    def start(self):
        """Starts it and waits until it answers PING."""
        self.log = open(os.path.join(self.dir, "log"), "wb")
        self.proc = subprocess.Popen(
            [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"],
            stdout=self.log, stderr=subprocess.STDOUT)

        def ping():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    return s.recv(16).startswith(b"+PONG")
            except OSError:
                return False
        wait_for(ping, 20, "redis-server to answer PING")
        return self

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self):
        self.kill()
        if self.log:
            self.log.close()
