"""The CI example of README "Verifying and benchmarking kernels" (issue 31):
deploy/ci/verify-kernels.sh, which the example workflow
deploy/ci/github-verify-kernels.yml runs, checks a correct kernel (exit 0, a
JSON report, a benchmark) and a wrong one (exit 3, the failing case and the
command that reproduces it), each on a throwaway opjitd of its own."""

import json
import os
import subprocess

import yaml

from conftest import REPO, opjitd_binary

SCRIPT = os.path.join(REPO, "deploy", "ci", "verify-kernels.sh")
KERNELS = os.path.join(REPO, "kernels", "verify")


def run(tmp_path, cand, ref, *flags, bench="0"):
    env = dict(os.environ, OPJITD=opjitd_binary(),
               OPJIT=os.path.join(os.path.dirname(opjitd_binary()), "opjit"),
               REPORT=str(tmp_path / "report.json"), BENCH=bench,
               BENCH_FLAGS="--min-time-ms 100 --shape 4096")
    p = subprocess.run(["bash", SCRIPT, cand, ref] + list(flags), env=env, cwd=tmp_path,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    return p.returncode, p.stdout


def test_a_correct_kernel_passes_with_a_report_and_a_benchmark(tmp_path):
    rc, out = run(tmp_path, os.path.join(KERNELS, "scale_add.json"),
                  os.path.join(KERNELS, "scale_add_ref.json"), "--seeds", "1", bench="1")
    assert rc == 0, out
    assert "verify: PASS" in out and "reproduce: opjit verify default/scale_add" in out, out
    assert "ratio scale_add / scale_add_ref" in out, out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and report["cases"], report


def test_a_wrong_kernel_fails_the_job_and_says_how_to_reproduce(tmp_path):
    with open(os.path.join(KERNELS, "scale_add.json")) as f:
        spec = json.load(f)
    impl = spec["implementations"][0]
    with open(os.path.join(KERNELS, impl.pop("source_file"))) as f:
        impl["source"] = f.read()
    impl["entry"] = "ScaleAddWrongAt1031"
    spec["name"] = "scale_add_1031"
    cand = tmp_path / "cand.json"
    cand.write_text(json.dumps(spec))
    rc, out = run(tmp_path, str(cand), os.path.join(KERNELS, "scale_add_ref.json"),
                  "--seeds", "1", "--dtype", "float32")
    assert rc == 3, out
    assert "verify: FAIL" in out and "float32[1031]" in out and "outside the tolerance" in out, out
    assert "reproduce: opjit verify default/scale_add_1031 --against default/scale_add_ref" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert not report["passed"]


def test_usage_and_a_daemon_that_cannot_start(tmp_path):
    rc, out = run(tmp_path, "missing.json", "also-missing.json")
    assert rc == 1 and "cannot read also-missing.json" in out, out
    p = subprocess.run(["bash", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    assert p.returncode == 2 and "usage" in p.stdout
    env = dict(os.environ, OPJITD="/bin/false",
               OPJIT=os.path.join(os.path.dirname(opjitd_binary()), "opjit"))
    p = subprocess.run(["bash", SCRIPT, "a.json", "b.json"], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    assert p.returncode == 1 and "opjitd exited" in p.stdout, p.stdout


def test_the_example_workflow_runs_the_script():
    with open(os.path.join(REPO, "deploy", "ci", "github-verify-kernels.yml")) as f:
        wf = yaml.safe_load(f)
    steps = wf["jobs"]["verify"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert "verify-kernels.sh" in runs and "apt-get install" in runs
    assert wf["jobs"]["verify"]["container"] == "debian:12"
    assert any(s.get("uses", "").startswith("actions/upload-artifact") for s in steps)
