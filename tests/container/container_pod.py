#!/usr/bin/python3
"""container_pod: opjitd, PostgreSQL and Redis from deploy/k8s, run by
`podman kube play` from the images of deploy/container/build-image.sh.

  container_pod.py BUILD_DIR

Steps (each one's wall time is printed):
1. build-image.sh ci: the runtime base (mmdebstrap, cached in podman's
   storage and under BUILD_DIR/container), the opjit image from the host's
   build tree (cmake --install), the services image (PostgreSQL and Redis
   installed on the runtime base).
2. The image on its own (podman run, its default config, no network): its
   HEALTHCHECK (`podman healthcheck run`) passes once the daemon serves and
   fails once the daemon is stopped (SIGSTOP).
3. A test variant of deploy/k8s, derived from its files (what differs and
   why is printed and in deploy/container/NOTES.md): podman 4.3 plays
   Deployments, not StatefulSets, Services, HPAs or NetworkPolicies; a
   Secret volume crashes it (nil secrets manager), so the Secret's files come
   from a hostPath directory; pods use hostNetwork (no cluster DNS or
   Services: the endpoints become 127.0.0.1 on free ports). opjitd.toml is
   the ConfigMap's own, with only the endpoints, ports and token hashes
   replaced (each replacement must apply): TLS and principals stay on.
4. Clients on the host, over TCP with TLS and a bearer token: the CLI
   registers kernels/examples/leaky_relu.json, runs it on a tensor (inline
   bytes) and the result is checked; a call without the token is refused.
5. The registry lives in PostgreSQL: the opjitd pod is removed and played
   again with a fresh state dir, and the op is still there (and runs).
   The compiled kernel went to Redis (its key count grew).
6. podman kube down, and the pods' volumes removed.

Exit 77 (skipped) only when this machine cannot run containers at all
(podman or mmdebstrap missing, or podman cannot start one), with the reason.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

SKIP = 77
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build"))
HERE_CONF = os.path.join(ROOT, "deploy", "container", "containers.conf")
ENV = dict(os.environ, CONTAINERS_CONF=os.environ.get("CONTAINERS_CONF", HERE_CONF))
CLI = os.path.join(BUILD, "bin", "opjit")
# The manifests name these images; the test builds and plays its own, under
# names of this run only (RUN), so another run of this test beside it (a
# second clone's `make test`) never plays, stops or rebuilds what this one
# uses: images, pods and their containers all carry RUN.
MANIFEST_IMAGES = ("localhost/opjit:latest", "localhost/opjit-services:latest")
RUN = "t%d-%s" % (os.getpid(), os.urandom(3).hex())
IMAGE = f"localhost/opjit-{RUN}:latest"
SERVICES_IMAGE = f"localhost/opjit-services-{RUN}:latest"
OWN_IMAGE = dict(zip(MANIFEST_IMAGES, (IMAGE, SERVICES_IMAGE)))
TIMES = []

try:
    import yaml
except ImportError:
    print("SKIP: PyYAML (python3-yaml) is missing")
    sys.exit(SKIP)


def step(name):
    class Timer:
        def __enter__(self):
            self.t0 = time.monotonic()
            print(f"== {name}", flush=True)

        def __exit__(self, *exc):
            dt = time.monotonic() - self.t0
            TIMES.append((name, dt))
            print(f"   {name}: {dt:.1f}s", flush=True)
    return Timer()


def run(*cmd, check=True, timeout=600, env=None, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or ENV, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def podman(*args, **kw):
    return run("podman", *args, **kw)


def logs_of(ctr):
    r = podman("logs", ctr, check=False)
    return r.stdout + r.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, fn, timeout):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            ok, last = fn()
        except Exception as e:  # noqa: BLE001 - reported on timeout
            ok, last = False, str(e)
        if ok:
            return
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}: {last}")


def load_k8s():
    """The objects of deploy/k8s's kustomization, by (kind, name)."""
    k = os.path.join(ROOT, "deploy", "k8s")
    with open(os.path.join(k, "kustomization.yaml")) as f:
        resources = yaml.safe_load(f)["resources"]
    objs = {}
    for r in resources:
        with open(os.path.join(k, r)) as f:
            for d in yaml.safe_load_all(f):
                if d:
                    objs[(d["kind"], d["metadata"]["name"])] = d
    with open(os.path.join(k, "opjitd-secrets.yaml")) as f:
        s = yaml.safe_load(f)
    objs[("Secret", s["metadata"]["name"])] = s
    return objs


def replace_once(text, old, new, what):
    if old not in text:
        raise RuntimeError(f"deploy/k8s's opjitd.toml changed: {what} ({old!r}) is not there; "
                           "update tests/container/container_pod.py")
    return text.replace(old, new)


def as_deployment(sts):
    """A StatefulSet as the Deployment podman can play (claims -> emptyDir)."""
    spec = sts["spec"]
    tmpl = spec["template"]
    for c in spec.get("volumeClaimTemplates", []):
        tmpl["spec"].setdefault("volumes", []).append({"name": c["metadata"]["name"], "emptyDir": {}})
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": sts["metadata"],
            "spec": {"replicas": 1, "selector": spec["selector"], "template": tmpl}}


def set_env(container, name, value):
    env = container.setdefault("env", [])
    for e in env:
        if e["name"] == name:
            e["value"] = value
            return
    env.append({"name": name, "value": value})


def pod_name(manifest_name):
    """This run's name for an object of deploy/k8s (a Deployment's pod is NAME-pod-0,
    a ConfigMap becomes a volume of that name)."""
    return f"{manifest_name}-{RUN}"


def main():
    for tool in ("podman", "mmdebstrap"):
        if shutil.which(tool) is None:
            print(f"SKIP: {tool} is missing (deploy/install-deps.sh installs it)")
            return SKIP
    if not os.access(CLI, os.X_OK):
        print(f"FAIL: {CLI} is missing: build first")
        return 1
    r = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False)
    if r.returncode != 0:
        print(f"SKIP: podman cannot run here: {r.stderr.strip()}")
        return SKIP

    with step("build-image.sh ci (bases cached by content)"):
        r = run(os.path.join(ROOT, "deploy", "container", "build-image.sh"), "ci",
                env=dict(ENV, OPJIT_BUILD_DIR=BUILD, OPJIT_IMAGE=IMAGE,
                         OPJIT_SERVICES_IMAGE=SERVICES_IMAGE), timeout=1500, check=False)
        print(r.stderr.strip())
        if r.returncode != 0:
            raise RuntimeError("build-image.sh ci failed")

    tmp = tempfile.mkdtemp(prefix="opjit-pod-")
    played = []
    volumes = set()
    standalone = f"opjit-hc-{os.getpid()}"
    try:
        with step("image alone: podman run + HEALTHCHECK"):
            r = podman("run", "-d", "--name", standalone, "--network", "none", IMAGE, check=False)
            if r.returncode != 0:
                print(f"SKIP: podman cannot start a container here: {r.stderr.strip()}")
                return SKIP
            wait_for("opjitd ready in the container",
                     lambda: ("ready" in (o := logs_of(standalone)), o[-300:]), 60)
            hc = podman("healthcheck", "run", standalone, check=False)
            if hc.returncode != 0:
                raise RuntimeError(f"HEALTHCHECK of a serving daemon failed: {hc.stdout}{hc.stderr}")
            cfg = json.loads(podman("image", "inspect", IMAGE).stdout)[0]["Config"]
            assert cfg.get("User") == "10001:10001", cfg.get("User")
            # The health check must be able to fail: with opjitd stopped
            # (SIGSTOP keeps the container, the socket stops answering).
            podman("exec", standalone, "/bin/sh", "-c", "kill -STOP $(cat /var/lib/opjit/opjitd.lock)")
            hc = podman("healthcheck", "run", standalone, check=False)
            if hc.returncode == 0:
                raise RuntimeError("HEALTHCHECK passed with opjitd stopped")
            print("   HEALTHCHECK: healthy while serving, unhealthy with opjitd stopped")

        objs = load_k8s()
        pg_port, redis_port, grpc_port, metrics_port = (free_port() for _ in range(4))
        def new_token():
            out = run(CLI, "token").stdout
            return (re.search(r"token:\s+(\S+)", out).group(1),
                    re.search(r'token_sha256 = \["([0-9a-f]{64})"\]', out).group(1))
        admin_token, admin_hash = new_token()
        _, user_hash = new_token()

        # The Secret's files, made for real (a self-signed TLS pair for
        # localhost), in a directory the pods mount.
        secrets = os.path.join(tmp, "secrets")
        os.makedirs(secrets)
        run("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "2", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout", os.path.join(secrets, "tls.key"), "-out", os.path.join(secrets, "tls.crt"))
        for key, value in (("db-password", os.urandom(12).hex()),
                           ("cache-hmac-key", os.urandom(32).hex()),
                           ("admin-token", admin_token)):
            with open(os.path.join(secrets, key), "w") as f:
                f.write(value)
        expected = set(objs[("Secret", "opjitd-secrets")]["stringData"])
        assert set(os.listdir(secrets)) == expected, (sorted(os.listdir(secrets)), sorted(expected))
        for f in os.listdir(secrets):
            os.chown(os.path.join(secrets, f), 0, 10001)
            os.chmod(os.path.join(secrets, f), 0o440)
        os.chown(secrets, 0, 10001)
        os.chmod(secrets, 0o750)
        os.chmod(tmp, 0o755)

        # opjitd.toml: the ConfigMap's, endpoints and hashes replaced.
        cm = objs[("ConfigMap", "opjitd-config")]
        toml = cm["data"]["opjitd.toml"]
        toml = replace_once(toml, '"0.0.0.0:7878"', f'"127.0.0.1:{grpc_port}"', "the gRPC listen address")
        toml = replace_once(toml, '"0.0.0.0:9464"', f'"127.0.0.1:{metrics_port}"', "[metrics] listen")
        toml = replace_once(toml, "host=opjit-postgres port=5432", f"host=127.0.0.1 port={pg_port}",
                            "[registry] url")
        toml = replace_once(toml, "redis://opjit-redis:6379", f"redis://127.0.0.1:{redis_port}",
                            "[cache.remote] url")
        toml = replace_once(toml, "0" * 64, admin_hash, "the admin token hash")
        toml = replace_once(toml, "1" * 64, user_hash, "the ml-team token hash")
        cm = json.loads(json.dumps(cm))
        cm["data"]["opjitd.toml"] = toml
        # podman keeps a played ConfigMap as a named volume of its name.
        cm["metadata"]["name"] = pod_name(cm["metadata"]["name"])
        cm_file = os.path.join(tmp, "configmap.yaml")
        with open(cm_file, "w") as f:
            yaml.safe_dump(cm, f)

        def adapt(dep, port_env=None, ports=None):
            dep = json.loads(json.dumps(dep))
            dep["metadata"]["name"] = pod_name(dep["metadata"]["name"])
            spec = dep["spec"]["template"]["spec"]
            spec["hostNetwork"] = True
            # podman 4.3 plays an emptyDir as a named volume of the
            # volume's own name ("state", "run", ...): one of this run's.
            renamed = {}
            for v in spec.get("volumes", []):
                if "emptyDir" in v:
                    renamed[v["name"]] = v["name"] = pod_name(v["name"])
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                for m in c.get("volumeMounts", []):
                    m["name"] = renamed.get(m["name"], m["name"])
            for v in spec.get("volumes", []):
                if "configMap" in v:
                    v["configMap"]["name"] = pod_name(v["configMap"]["name"])
                if "secret" in v:
                    v.pop("secret")
                    v["hostPath"] = {"path": secrets, "type": "Directory"}
            for c in spec["containers"]:
                c["imagePullPolicy"] = "Never"
                if c["image"] not in OWN_IMAGE:
                    raise RuntimeError(f"deploy/k8s names an image this test does not build: {c['image']}")
                c["image"] = OWN_IMAGE[c["image"]]
                for key, value in (port_env or {}).items():
                    set_env(c, key, value)
                # podman 4.3 turns containerPorts into port mappings, which
                # it refuses with hostNetwork; the probes name the ports.
                c.pop("ports", None)
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    for kind in ("tcpSocket", "grpc", "httpGet"):
                        p = c.get(probe, {}).get(kind)
                        if p is not None and not isinstance(p["port"], int):
                            p["port"] = (ports or {})[p["port"]]
            return dep

        pg = adapt(as_deployment(objs[("StatefulSet", "opjit-postgres")]),
                   {"PGPORT": str(pg_port), "PG_LISTEN_ADDRESSES": "127.0.0.1"}, {"postgres": pg_port})
        rd = adapt(objs[("Deployment", "opjit-redis")],
                   {"REDIS_PORT": str(redis_port), "REDIS_BIND": "127.0.0.1"}, {"redis": redis_port})
        od = adapt(objs[("Deployment", "opjitd")])
        files = {}
        files_pod = {"postgres": "opjit-postgres", "redis": "opjit-redis", "opjitd": "opjitd"}
        for name, dep in (("postgres", pg), ("redis", rd), ("opjitd", od)):
            files[name] = os.path.join(tmp, f"{name}.yaml")
            with open(files[name], "w") as f:
                yaml.safe_dump(dep, f)
        print("   test variant of deploy/k8s: StatefulSet opjit-postgres as a Deployment "
              "(claim -> emptyDir); Secret -> hostPath dir; no containerPorts; hostNetwork on 127.0.0.1 ports "
              f"pg={pg_port} redis={redis_port} grpc={grpc_port} metrics={metrics_port}; "
              "Services, HPA and NetworkPolicy not played")

        def containers_of(pod_prefix):
            out = podman("ps", "-a", "--format", "{{.Names}}", "--filter", f"pod={pod_prefix}-pod-0",
                         check=False).stdout.split()
            return [c for c in out if not c.endswith("-infra")]

        def remember_volumes(name):
            """The named volumes of pod `name`'s containers, also kept for the cleanup."""
            mine = set()
            for c in containers_of(name):
                r = podman("inspect", c, "--format", "{{range .Mounts}}{{.Name}} {{end}}", check=False)
                mine.update(v for v in r.stdout.split() if v)
            volumes.update(mine)
            return mine

        def play(name, *extra):
            r = podman("kube", "play", *extra, files[name], check=False)
            played.append(name)
            if r.returncode != 0:
                raise RuntimeError(f"podman kube play {name}: {r.stdout}{r.stderr}")
            remember_volumes(pod_name(files_pod[name]))

        with step("kube play postgres + redis, wait until ready"):
            play("postgres")
            play("redis")
            pg_ctr, = containers_of(pod_name("opjit-postgres"))
            rd_ctr, = containers_of(pod_name("opjit-redis"))
            for ctr, what in ((pg_ctr, "postgres"), (rd_ctr, "redis")):
                wait_for(f"{what} ready", lambda: (
                    (r := podman("exec", ctr, "/usr/local/bin/services-entrypoint", "ready", what,
                                 check=False)).returncode == 0, r.stderr + r.stdout), 90)

        client_env = dict(os.environ, OPJIT_TLS_CA=os.path.join(secrets, "tls.crt"),
                          OPJIT_TOKEN=admin_token)
        server = f"localhost:{grpc_port}"

        def cli(*args, env=client_env, check=True):
            return run(CLI, "--server", server, "--timeout", "60", *args, env=env, check=check)

        def opjitd_up():
            wait_for("opjitd SERVING over TLS", lambda: (
                (r := cli("info", check=False)).returncode == 0, r.stderr.strip()), 90)
            ctr, = containers_of(pod_name("opjitd"))
            return ctr

        with step("kube play opjitd, wait for health over TLS"):
            play("opjitd", "--configmap", cm_file)
            od_ctr = opjitd_up()
            hc = podman("healthcheck", "run", od_ctr, check=False)
            if hc.returncode != 0:
                raise RuntimeError(f"the pod's probe (health over the unix socket) failed: {hc.stderr}")
            logs = logs_of(od_ctr)
            if "postgres" not in logs.lower():
                raise RuntimeError(f"opjitd did not open its registry in PostgreSQL:\n{logs[-2000:]}")

        def redis_keys():
            return int(podman("exec", rd_ctr, "/usr/bin/redis-cli", "-p", str(redis_port), "dbsize").stdout)

        x = os.path.join(tmp, "x.npy")
        y = os.path.join(tmp, "y.npy")
        run("/usr/bin/python3", "-c",
            f"import numpy as np; np.save({x!r}, np.array([-2, -1, 0, 3], np.float32))")

        def check_run():
            if os.path.exists(y):
                os.unlink(y)
            cli("run", "leaky_relu", "--in", x, "--attr", "alpha=0.5", "--out", y, "--transport", "inline")
            got = run("/usr/bin/python3", "-c",
                      f"import numpy as np; print(np.load({y!r}).tolist())").stdout.strip()
            if got != "[-1.0, -0.5, 0.0, 3.0]":
                raise RuntimeError(f"leaky_relu gave {got}")

        with step("register + run through the pod (CLI, TCP + TLS + token)"):
            keys_before = redis_keys()
            cli("register", os.path.join(ROOT, "kernels", "examples", "leaky_relu.json"))
            check_run()
            r = cli("info", env=dict(client_env, OPJIT_TOKEN="not-a-token"), check=False)
            if r.returncode == 0 or "UNAUTHENTICATED" not in r.stderr:
                raise RuntimeError(f"a wrong token was not refused: {r.returncode} {r.stderr}")
            r = cli("info", env=dict(client_env, OPJIT_TLS_CA=""), check=False)
            if r.returncode == 0:
                raise RuntimeError("plaintext gRPC to the TLS port succeeded")
            keys_after = redis_keys()
            if keys_after <= keys_before:
                raise RuntimeError(f"nothing went to Redis ({keys_before} -> {keys_after} keys)")
            print(f"   leaky_relu ok; Redis keys {keys_before} -> {keys_after}; "
                  "bad token and plaintext refused")

        with step("opjitd pod replaced (fresh state dir): the op is still registered"):
            # Only opjitd's volumes: PostgreSQL and Redis keep theirs.
            opjitd_volumes = remember_volumes(pod_name("opjitd"))
            podman("kube", "down", files["opjitd"], check=False)
            for v in opjitd_volumes:
                podman("volume", "rm", "-f", v, check=False)
            play("opjitd", "--configmap", cm_file)
            opjitd_up()
            ops = cli("ops").stdout
            if "leaky_relu" not in ops:
                raise RuntimeError(f"the registry did not survive the pod: {ops}")
            check_run()
    finally:
        with step("kube down + cleanup"):
            podman("rm", "-f", "-v", "-t", "2", standalone, check=False)
            for name in reversed(played):
                try:
                    podman("kube", "down", files[name], check=False)
                except Exception as e:  # noqa: BLE001 - cleanup goes on
                    print(f"   kube down {name}: {e}")
            for v in volumes:
                podman("volume", "rm", "-f", v, check=False)
            for image in (IMAGE, SERVICES_IMAGE):
                podman("rmi", "-f", image, check=False)
            shutil.rmtree(tmp, ignore_errors=True)
    total = sum(t for _, t in TIMES)
    print("timings: " + ", ".join(f"{n.split(' ')[0]} {t:.1f}s" for n, t in TIMES) + f"; total {total:.1f}s")
    print("container_pod: ok")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:
        print(f"FAIL: {e}")
        sys.exit(1)
