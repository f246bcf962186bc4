#!/usr/bin/python3
"""Offline checks of deploy/k8s (no cluster): what kubectl can check alone,
and the cross references between the objects.

`kubectl apply/create --dry-run=client` need a server even for the dry run
(discovery for the REST mapping, /openapi/v2 for --validate), so they fail
without a cluster. What works offline, and what this test runs:

1. `kubectl kustomize` of deploy/k8s, alone and with the insecure
   component (from an overlay outside it, as users would): the YAML
   parses, every resource file and patch applies, image overrides resolve.
2. Strict schema for the kinds kubectl decodes into its Go types offline:
   Deployment and StatefulSet (`kubectl set serviceaccount --local`), Service
   (`kubectl set selector --local`). A wrong type fails the decode; an
   unknown or misspelt field is silently dropped by the decode, so every
   field of the input must come back in kubectl's re-encoded output.
3. By hand, for the kinds kubectl reads only as untyped maps (ConfigMap,
   Secret, HPA, NetworkPolicy) and across objects: every ConfigMap/Secret a
   pod mounts exists and has the keys it names; Services, the HPA and the
   NetworkPolicy select pods that exist, on ports they declare; the probes'
   ports and commands; opjitd.toml parses (tomllib), names only the
   sections and keys server/config.cc knows, and every file it names under
   /etc/opjit/secrets is a key of the mounted Secret; the [registry] and
   [cache.remote] endpoints are Services of this set.

What only a real cluster shows: admission (quota, PodSecurity), defaulting,
scheduling on nvidia.com/gpu, DNS, the HPA with a metrics adapter.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib

try:
    import yaml
except ImportError:
    print("SKIP: PyYAML (python3-yaml) is missing")
    sys.exit(77)

SKIP = 77
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
K8S = os.path.join(ROOT, "deploy", "k8s")
KUBECTL = os.environ.get("KUBECTL", "kubectl")
failures = []
tomls_checked = []


def fail(msg):
    failures.append(msg)


def kubectl(*args, stdin=None):
    r = subprocess.run([KUBECTL, *args], input=stdin, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


def missing_fields(src, out, path=""):
    """Paths present in src but absent or different in out (out may add defaults)."""
    if isinstance(src, dict):
        if not isinstance(out, dict):
            return [path or "/"]
        bad = []
        for k, v in src.items():
            if k not in out:
                # kubectl drops empty maps and nulls it does not know either way.
                if v in ({}, None, []):
                    continue
                bad.append(f"{path}.{k}")
            else:
                bad += missing_fields(v, out[k], f"{path}.{k}")
        return bad
    if isinstance(src, list):
        if not isinstance(out, list) or len(out) != len(src):
            return [path]
        bad = []
        for i, (a, b) in enumerate(zip(src, out)):
            bad += missing_fields(a, b, f"{path}[{i}]")
        return bad
    # Quantities and int-or-string come back as given; numbers may come back
    # as strings only where the schema says so (a real mismatch fails decode).
    if src != out and str(src) != str(out):
        return [f"{path} ({src!r} -> {out!r})"]
    return []


def typed_roundtrip(doc, where):
    """Decodes doc with kubectl's Go types; True when kubectl knows the kind.

    `kubectl set ... --local` decodes into the typed object, applies its
    change and re-encodes; it prints nothing when the change is a no-op, so
    the change is one to a field these manifests never set.
    """
    kind = doc.get("kind")
    src = json.loads(json.dumps(doc))
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        if src["spec"]["template"]["spec"].get("serviceAccountName"):
            return False
        args = ["set", "serviceaccount", "--local", "-f", "-", "opjit-validate", "-o", "json"]
    elif kind == "Service":
        args = ["set", "selector", "--local", "-f", "-", "opjit-validate=1", "-o", "json"]
        src["spec"].pop("selector", None)
    else:
        return False
    rc, out, err = kubectl(*args, stdin=json.dumps(doc))
    if rc != 0 or not out.strip():
        fail(f"{where}: kubectl could not decode {kind}/{doc['metadata']['name']}: {err.strip()}")
        return True
    back = json.loads(out)
    for p in missing_fields(src, back):
        fail(f"{where}: {kind}/{doc['metadata']['name']}: field {p} is not in the "
             f"{kind} schema (dropped by kubectl's decode) or changed")
    return True


def known_config_keys():
    """Sections and keys opjitd accepts, read from server/config.cc."""
    src = open(os.path.join(ROOT, "server", "config.cc")).read()
    known = {}
    # The key table: k.push_back(Int("compiler.timeout_ms", ...)), KeyRow x = Str(...) and
    # k.push_back({"principal", ...}); "a.b.c" is key c of section [a.b].
    for full in re.findall(r'(?:k\.push_back\(|KeyRow \w+ = )\s*(?:[A-Za-z]+\(|\{)\s*"([a-z0-9_.]+)"', src):
        parts = full.split(".")
        for i, part in enumerate(parts):
            known.setdefault("".join(p + "." for p in parts[:i]), set()).add(part)
    if "" not in known:
        fail("server/config.cc: no key table rows (k.push_back(Int(\"...\"))) found "
             "(has the table changed?)")
    # [[principal]] tables are checked with a computed prefix.
    m = re.search(r'CheckKeys\(\w+,\s*\*t,\s*where,\s*\{([^}]*)\}', src)
    if m:
        known["principal[]."] = set(re.findall(r'"([^"]+)"', m.group(1)))
    return known


def check_with_daemon(text, where):
    """`opjitd --check-config` on the config, as an operator would run it
    (every key, type, range and principal). Files the config names under
    /etc/opjit/secrets/ (mounted from the Secret in a pod) are stood in for by
    empty files of a temp dir. Skipped when $OPJITD is not set."""
    binary = os.environ.get("OPJITD")
    if not binary:
        return
    with tempfile.TemporaryDirectory(prefix="opjit-k8s-") as tmp:
        def stand_in(m):
            path = os.path.join(tmp, "secrets", m.group(1))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "a").close()
            return path
        body = re.sub(r"/etc/opjit/secrets/([A-Za-z0-9._-]+)", stand_in, text)
        cfg = os.path.join(tmp, "opjitd.toml")
        with open(cfg, "w") as f:
            f.write(body)
        r = subprocess.run([binary, "--check-config", cfg], capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"{where}: opjitd --check-config: {r.stderr.strip().replace(tmp, '')}")


def check_toml(text, where, secret_keys, services):
    tomls_checked.append(where)
    try:
        cfg = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        fail(f"{where}: opjitd.toml does not parse: {e}")
        return
    known = known_config_keys()

    def walk(table, prefix):
        allowed = known.get(prefix)
        if allowed is None:
            fail(f"{where}: opjitd.toml: unknown section [{prefix.rstrip('.')}]")
            return
        for k, v in table.items():
            if k not in allowed:
                fail(f"{where}: opjitd.toml: unknown key {prefix}{k}")
            elif isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, list) and v and all(isinstance(t, dict) for t in v):
                for t in v:
                    walk(t, f"{prefix}{k}[].")

    walk(cfg, "")
    check_with_daemon(text, where)
    for path in re.findall(r'"(/etc/opjit/secrets/[^"]+)"', text):
        key = path.rsplit("/", 1)[1]
        if secret_keys is not None and key not in secret_keys:
            fail(f"{where}: opjitd.toml names {path}, not a key of the mounted Secret")
    reg = cfg.get("registry", {})
    if reg.get("backend") == "postgres":
        m = re.search(r"host=(\S+)", reg.get("url", ""))
        if not m or m.group(1) not in services:
            fail(f"{where}: [registry] url host is not a Service of deploy/k8s")
    remote = cfg.get("cache", {}).get("remote", {})
    if remote.get("url"):
        m = re.match(r"redis://([^:/]+)", remote["url"])
        if not m or m.group(1) not in services:
            fail(f"{where}: [cache.remote] url host is not a Service of deploy/k8s")


def pod_specs(docs):
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield d, d["spec"]["template"]


def check_references(docs, where):
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    cms, secrets = by_kind.get("ConfigMap", {}), by_kind.get("Secret", {})
    services = set(by_kind.get("Service", {}))
    # Secrets may be created out of band (the placeholder file documents
    # them); their keys are then unknown.
    for owner, tmpl in pod_specs(docs):
        name = f"{owner['kind']}/{owner['metadata']['name']}"
        spec = tmpl["spec"]
        labels = tmpl["metadata"].get("labels", {})
        sel = owner["spec"]["selector"].get("matchLabels", {})
        if any(labels.get(k) != v for k, v in sel.items()):
            fail(f"{where}: {name}: selector {sel} does not match its pod labels {labels}")
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in owner["spec"].get("volumeClaimTemplates", [])}
        for c in spec["containers"]:
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            for m in c.get("volumeMounts", []):
                if m["name"] not in vols and m["name"] not in claims:
                    fail(f"{where}: {name}/{c['name']}: mounts unknown volume {m['name']}")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe)
                if not p:
                    continue
                for kind in ("grpc", "tcpSocket", "httpGet"):
                    if kind in p:
                        port = p[kind]["port"]
                        if port not in ports and port not in ports.values():
                            fail(f"{where}: {name}/{c['name']}: {probe} port {port} is not a container port")
                if "exec" in p and not p["exec"]["command"][0].startswith("/"):
                    fail(f"{where}: {name}: {probe} exec needs an absolute command (images have no PATH)")
        for v in vols.values():
            if "configMap" in v:
                cm = cms.get(v["configMap"]["name"])
                if cm is None:
                    fail(f"{where}: {name}: ConfigMap {v['configMap']['name']} is not defined")
                    continue
                for it in v["configMap"].get("items", []):
                    if it["key"] not in cm.get("data", {}):
                        fail(f"{where}: {name}: ConfigMap key {it['key']} is missing")
            if "secret" in v:
                s = secrets.get(v["secret"]["secretName"])
                if s is None:
                    continue
                keys = set(s.get("stringData", {})) | set(s.get("data", {}))
                for it in v["secret"].get("items", []):
                    if it["key"] not in keys:
                        fail(f"{where}: {name}: Secret key {it['key']} is missing")
        for c in spec["containers"]:
            args = c.get("args", []) + c.get("command", [])
            if "--config" not in args:
                continue
            path = args[args.index("--config") + 1]
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            m = mounts.get(os.path.dirname(path))
            v = vols.get(m["name"], {}) if m else {}
            cm = cms.get(v.get("configMap", {}).get("name"))
            key = os.path.basename(path)
            if cm is None or key not in cm.get("data", {}):
                fail(f"{where}: {name}: --config {path} is not a key of a mounted ConfigMap")
                continue
            sec_keys = None
            s_mount = mounts.get("/etc/opjit/secrets")
            s_vol = vols.get(s_mount["name"], {}) if s_mount else {}
            if "secret" in s_vol:
                s = secrets.get(s_vol["secret"]["secretName"])
                if s is not None:
                    sec_keys = set(s.get("stringData", {})) | set(s.get("data", {}))
            else:
                sec_keys = set()
            check_toml(cm["data"][key], f"{where}: {name}", sec_keys, services)
    pods = [(o, t) for o, t in pod_specs(docs)]

    def selects(selector, tmpl):
        labels = tmpl["metadata"].get("labels", {})
        ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", selector).items()
                 if k != "matchExpressions")
        for e in selector.get("matchExpressions", []):
            if e["operator"] == "In":
                ok = ok and labels.get(e["key"]) in e["values"]
        return ok

    for svc in by_kind.get("Service", {}).values():
        sel = svc["spec"].get("selector", {})
        matched = [t for _, t in pods if selects(sel, t)]
        if not matched:
            fail(f"{where}: Service/{svc['metadata']['name']} selects no pod template")
            continue
        for p in svc["spec"]["ports"]:
            tp = p.get("targetPort", p["port"])
            cports = [(cp.get("name"), cp["containerPort"]) for t in matched
                      for c in t["spec"]["containers"] for cp in c.get("ports", [])]
            if not any(tp in pair for pair in cports):
                fail(f"{where}: Service/{svc['metadata']['name']}: targetPort {tp} is no container port")
    for hpa in by_kind.get("HorizontalPodAutoscaler", {}).values():
        if hpa["apiVersion"] != "autoscaling/v2":
            fail(f"{where}: HPA {hpa['metadata']['name']}: apiVersion must be autoscaling/v2")
        ref = hpa["spec"]["scaleTargetRef"]
        if ref["name"] not in by_kind.get(ref["kind"], {}):
            fail(f"{where}: HPA target {ref['kind']}/{ref['name']} is not defined")
        if not 1 <= hpa["spec"].get("minReplicas", 1) <= hpa["spec"]["maxReplicas"]:
            fail(f"{where}: HPA replica bounds")
        for m in hpa["spec"]["metrics"]:
            if m["type"] not in ("Resource", "Pods", "Object", "External", "ContainerResource"):
                fail(f"{where}: HPA metric type {m['type']}")
            body = m.get(m["type"][0].lower() + m["type"][1:], {})
            if m["type"] == "Pods" and body.get("target", {}).get("type") != "AverageValue":
                fail(f"{where}: HPA Pods metrics take an AverageValue target")
    for np in by_kind.get("NetworkPolicy", {}).values():
        if not any(selects(np["spec"]["podSelector"], t) for _, t in pods):
            fail(f"{where}: NetworkPolicy/{np['metadata']['name']} selects no pod")
        for rule in np["spec"].get("ingress", []):
            for frm in rule.get("from", []):
                if "podSelector" in frm and not any(selects(frm["podSelector"], t) for _, t in pods):
                    fail(f"{where}: NetworkPolicy/{np['metadata']['name']}: a from selects no pod")


def check(dirname, component=None):
    where = os.path.relpath(dirname, ROOT)
    if component is None:
        rc, out, err = kubectl("kustomize", dirname)
    else:
        # A component is used from an overlay outside the base, as its
        # users would.
        where += " + " + os.path.relpath(component, ROOT)
        with tempfile.TemporaryDirectory() as t:
            with open(os.path.join(t, "kustomization.yaml"), "w") as f:
                f.write(f"resources: [{os.path.relpath(dirname, t)}]\n"
                        f"components: [{os.path.relpath(component, t)}]\n")
            rc, out, err = kubectl("kustomize", t)
    if rc != 0:
        fail(f"{where}: kubectl kustomize: {err.strip()}")
        return
    docs = [d for d in yaml.safe_load_all(out) if d]
    kinds = sorted({d["kind"] for d in docs})
    typed = sum(typed_roundtrip(d, where) for d in docs)
    # The placeholder Secret is not in the kustomization (create the real
    # one out of band); its keys are what the pods mount.
    if not any(d["kind"] == "Secret" for d in docs):
        with open(os.path.join(K8S, "opjitd-secrets.yaml")) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    n = len(tomls_checked)
    check_references(docs, where)
    print(f"{where}: {len(docs)} objects ({', '.join(kinds)}); {typed} decoded strictly by kubectl; "
          f"{len(tomls_checked) - n} opjitd.toml checked")
    if len(tomls_checked) == n:
        fail(f"{where}: no opjitd.toml found through the Deployment's --config")


def main():
    try:
        subprocess.run([KUBECTL, "version", "--client"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        print("SKIP: kubectl is missing (deploy/install-deps.sh installs kubernetes-client)")
        return SKIP
    check(K8S)
    check(K8S, os.path.join(K8S, "insecure"))
    # The files one by one too: `kubectl apply -f deploy/k8s/` reads each.
    for name in sorted(os.listdir(K8S)):
        if name.endswith(".yaml") and name != "kustomization.yaml":
            with open(os.path.join(K8S, name)) as f:
                for d in yaml.safe_load_all(f):
                    if d and ("apiVersion" not in d or "kind" not in d or "name" not in d.get("metadata", {})):
                        fail(f"deploy/k8s/{name}: an object without apiVersion, kind or metadata.name")
    # The check must be able to fail: a misspelt field is caught.
    before = len(failures)
    probe = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
             "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {
                 "metadata": {"labels": {"a": "b"}},
                 "spec": {"containers": [{"name": "c", "image": "i", "readinesProbe": {}}]}}}}
    probe["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"exec": {"command": ["/x"]}}
    typed_roundtrip(probe, "self-test")
    caught = len(failures) > before
    del failures[before:]
    if not caught:
        fail("self-test: a misspelt field (readinesProbe) was not caught")
    before = len(failures)
    check_toml('[registry]\nbackend = "sqlite"\nbogus = 1\n', "self-test", set(), set())
    caught = len(failures) > before
    del failures[before:]
    if not caught:
        fail("self-test: an unknown opjitd.toml key ([registry] bogus) was not caught")
    for f in failures:
        print("FAIL:", f)
    if failures:
        print(f"{len(failures)} problem(s)")
        return 1
    print("kubectl_validate: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
