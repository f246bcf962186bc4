"""The opjit CLI against the session's opjitd: which compiler a .cu file gets
(nvcc for MindSpore aot files with host code, NVRTC for device code), the
hint when NVRTC meets host code anyway, `run --target gpu`, per-command
flags, and registration warnings.

GPU compiles need the CUDA toolkit in /usr/local/cuda (NVRTC; nvcc for the
aot files), not a GPU; tests skip, saying so, where it is missing. `run
--target gpu` runs the kernel where the daemon has a GPU and checks the
error otherwise.
"""

import json
import os
import re
import shlex
import shutil
import subprocess

import numpy as np
import pytest

from conftest import EXAMPLES, opjitd_binary

CUDA = "/usr/local/cuda"
HAVE_NVRTC = os.path.exists(os.path.join(CUDA, "include", "nvrtc.h"))
HAVE_NVCC = os.access(os.path.join(CUDA, "bin", "nvcc"), os.X_OK)
needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC, reason="no CUDA toolkit in /usr/local/cuda (NVRTC)")
needs_nvcc = pytest.mark.skipif(not HAVE_NVCC, reason="no nvcc in /usr/local/cuda/bin")

# MindSpore's aot form: a __global__ kernel and an extern "C" entry that
# launches it with <<<>>>.
MINDSPORE_AOT_CU = r'''
#include <cstdint>
#include "custom_aot_extra.h"

// Not a launch: k<<<1, 1>>>() in a comment.
__global__ void CliAddKernel(const float* x, const float* y, float* out, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];
}

extern "C" int CustomCliAdd(int nparam, void** params, int* ndims, int64_t** shapes,
                            const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  CliAddKernel<<<(n + 255) / 256, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const float*>(params[0]), static_cast<const float*>(params[1]),
      static_cast<float*>(params[2]), n);
  return cudaGetLastError() == cudaSuccess ? 0 : 2;
}
'''

# Device code only, as NVRTC takes it.
DEVICE_ONLY_CU = r'''
// A host launcher would read: cli_saxpy<<<grid, 256>>>(a, x, y, n);
extern "C" __global__ void cli_saxpy(float a, const float* x, float* y, long long n) {
  long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
'''


def opjit_cli():
    path = os.path.join(os.path.dirname(opjitd_binary()), "opjit")
    if not os.access(path, os.X_OK):
        pytest.fail("opjit not found at %s (build the `opjit` target)" % path)
    return path


def cli(daemon, *args, timeout=300):
    return subprocess.run([opjit_cli(), "--server", daemon.unix_address] + list(args),
                          capture_output=True, text=True, timeout=timeout)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@needs_nvcc
def test_mindspore_aot_cu_compiles_with_nvcc_without_aot_flag(daemon, tmp_path):
    src = write(tmp_path, "cli_add.cu", MINDSPORE_AOT_CU)
    r = cli(daemon, "compile", src, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["target"] == "GPU"
    assert out["ptx_arch"] == ""          # nvcc's shared object: no PTX
    assert out["lowered_names"] == {}
    assert int(out["binary_bytes"]) > 10000, out  # a shared object, not a CUBIN
    # The human form names the compiler.
    again = cli(daemon, "compile", src)
    assert again.returncode == 0, again.stderr
    assert "nvcc shared object" in again.stdout, again.stdout
    # --aot asks for what was chosen: the same cache entry.
    forced = cli(daemon, "compile", src, "--aot", "--json")
    assert forced.returncode == 0, forced.stderr
    forced = json.loads(forced.stdout)
    assert forced["cache_key"] == out["cache_key"]
    assert forced["cache_hit"] == "memory"


@needs_nvcc
def test_the_repositorys_aot_example_compiles_without_aot_flag(daemon):
    r = cli(daemon, "compile", os.path.join(EXAMPLES, "add_aot.cu"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ptx_arch"] == "" and int(out["binary_bytes"]) > 10000, out


@needs_nvrtc
def test_device_only_cu_still_goes_to_nvrtc(daemon, tmp_path):
    src = write(tmp_path, "cli_saxpy.cu", DEVICE_ONLY_CU)
    r = cli(daemon, "compile", src, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["target"] == "GPU"
    assert out["ptx_arch"].startswith("compute_"), out  # NVRTC's PTX
    human = cli(daemon, "compile", src)
    assert human.returncode == 0, human.stderr
    assert "NVRTC" in human.stdout, human.stdout
    # A template kernel's name expression comes back lowered.
    tmpl = cli(daemon, "compile", os.path.join(EXAMPLES, "scale_add.cu"),
               "--name-expr", "scale_add<float>", "--json")
    assert tmpl.returncode == 0, tmpl.stderr
    lowered = json.loads(tmpl.stdout)["lowered_names"]
    assert lowered["scale_add<float>"].startswith("_Z"), lowered


@needs_nvrtc
def test_nvrtc_on_host_code_says_how_to_use_nvcc(daemon, tmp_path):
    # Name expressions keep a job on NVRTC, which refuses the host code.
    src = write(tmp_path, "cli_launch.cu", MINDSPORE_AOT_CU.replace("#include <cstdint>\n", "")
                .replace("int64_t", "long long").replace('#include "custom_aot_extra.h"\n', ""))
    r = cli(daemon, "compile", src, "--name-expr", "CliAddKernel")
    assert r.returncode == 1
    assert "INVALID_ARGUMENT" in r.stderr
    assert "cli_launch.cu" in r.stderr  # the user's file name in the diagnostics
    assert "hint: this source has host code" in r.stderr, r.stderr
    assert "CustomCliAdd" in r.stderr
    assert "--aot" in r.stderr and '"launch"' in r.stderr, r.stderr
    assert "is opjitd running" not in r.stderr
    if HAVE_NVCC:
        forced = cli(daemon, "compile", src, "--name-expr", "CliAddKernel", "--aot", "--json")
        assert forced.returncode == 0, forced.stderr
        assert json.loads(forced.stdout)["ptx_arch"] == ""

    # An unannotated helper the detector does not count: NVRTC's own
    # complaint gets the hint too.
    helper = write(tmp_path, "cli_helper.cu", "static float sq(float v) { return v * v; }\n"
                   "__global__ void k(float* x) { x[0] = 1.0f; }\n")
    r = cli(daemon, "compile", helper)
    assert r.returncode == 1
    assert "hint: NVRTC compiles device code only" in r.stderr, r.stderr
    assert "-default-device" in r.stderr


def gpu_available(daemon):
    r = cli(daemon, "info", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["gpu"]["available"]


@needs_nvrtc
def test_run_target_gpu(daemon, tmp_path):
    # scale_add with its CPU and NVRTC implementations, under its own name.
    with open(os.path.join(EXAMPLES, "scale_add_gpu.json")) as f:
        spec = json.load(f)
    spec["name"] = "cli_scale_add"
    shutil.copy(os.path.join(EXAMPLES, "scale_add.cu"), tmp_path / "scale_add.cu")
    spec_path = write(tmp_path, "cli_scale_add.json", json.dumps(spec))
    reg = cli(daemon, "register", spec_path)
    assert reg.returncode == 0, reg.stderr
    x = np.arange(8, dtype=np.float32)
    b = np.ones(8, dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "b.npy", b)
    args = ["run", "cli_scale_add", "--in", str(tmp_path / "x.npy"), "--in", str(tmp_path / "b.npy"),
            "--attr", "alpha=2", "--out", str(tmp_path / "y.npy")]

    cpu = cli(daemon, *args, "--target", "cpu")
    assert cpu.returncode == 0, cpu.stderr
    assert "on CPU" in cpu.stdout
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), 2 * x + b)
    os.remove(tmp_path / "y.npy")

    for transport in ("shm", "inline"):
        gpu = cli(daemon, *args, "--target", "gpu", "--transport", transport)
        if gpu_available(daemon):
            assert gpu.returncode == 0, gpu.stderr
            assert "on GPU" in gpu.stdout
            np.testing.assert_allclose(np.load(tmp_path / "y.npy"), 2 * x + b)
        else:
            # No GPU here: the daemon's reason, and what to do, on stderr.
            assert gpu.returncode == 1, (gpu.stdout, gpu.stderr)
            assert "UNAVAILABLE" in gpu.stderr and "on GPU" in gpu.stderr, gpu.stderr
            assert "could not run on the GPU" in gpu.stderr
            assert "opjit info" in gpu.stderr
            assert "is opjitd running" not in gpu.stderr
            assert gpu.stdout == ""
            assert not os.path.exists(tmp_path / "y.npy")

    bad = cli(daemon, *args, "--target", "tpu")
    assert bad.returncode == 2
    assert "--target takes cpu or gpu" in bad.stderr
    bad = cli(daemon, "grad", "cli_scale_add", "--in", str(tmp_path / "x.npy"), "--target", "tpu")
    assert bad.returncode == 2
    assert "--target takes cpu or gpu" in bad.stderr


def test_flags_belong_to_their_command(daemon, tmp_path):
    r = cli(daemon, "ops", "--aot")
    assert r.returncode == 2
    assert "unknown option --aot for `ops` (it takes --namespace, --all-versions)" in r.stderr
    r = cli(daemon, "compile", "x.cu", "--target", "gpu")
    assert r.returncode == 2 and "unknown option --target for `compile`" in r.stderr
    r = cli(daemon, "gradcheck", "square", "--target", "gpu")
    assert r.returncode == 2 and "unknown option --target for `gradcheck`" in r.stderr
    r = cli(daemon, "info", "--version", "3")
    assert r.returncode == 2 and "(it takes none)" in r.stderr
    r = cli(daemon, "cache", "stats", "--memory-only")
    assert r.returncode == 2 and "--memory-only goes with `cache clear`" in r.stderr
    r = cli(daemon, "info", "extra")
    assert r.returncode == 2 and "info takes no arguments" in r.stderr
    r = cli(daemon, "frobnicate")
    assert r.returncode == 2 and "unknown command frobnicate" in r.stderr
    r = cli(daemon, "help")
    assert r.returncode == 0, r.stderr
    assert "run" in r.stdout and "gradcheck" in r.stdout
    # COMMAND --help lists that command's flags (test_cli_ops.py checks more).
    r = cli(daemon, "run", "--help")
    assert r.returncode == 0, r.stderr
    assert "opjit run [OPTIONS] OP" in r.stdout and "--target cpu|gpu" in r.stdout
    r = cli(daemon, "compile", "-h")
    assert r.returncode == 0, r.stderr
    assert "--aot" in r.stdout and "--target" not in r.stdout
    # --timeout=N works like --timeout N; --json goes before or after the command.
    r = subprocess.run([opjit_cli(), "--server=" + daemon.unix_address, "--timeout=30",
                        "ops", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)


def test_unreachable_server_hint_only_when_unreachable(tmp_path):
    r = subprocess.run([opjit_cli(), "--server", "unix:%s/none.sock" % tmp_path, "--timeout", "2",
                        "ops"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "is opjitd running" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr  # one line


def test_register_and_describe_print_warnings(daemon, tmp_path):
    # A backward op that is not registered (yet) is a warning, not an error.
    with open(os.path.join(EXAMPLES, "square.json")) as f:
        spec = json.load(f)
    spec["name"] = "cli_square_warned"
    spec["backward"]["op"] = "cli_square_grad_not_registered"
    for impl in spec["implementations"]:
        if "source_file" in impl:
            shutil.copy(os.path.join(EXAMPLES, impl["source_file"]), tmp_path / impl["source_file"])
    r = cli(daemon, "register", write(tmp_path, "warned.json", json.dumps(spec)))
    assert r.returncode == 0, r.stderr
    assert "warning: " in r.stderr, r.stderr
    assert "cli_square_grad_not_registered" in r.stderr
    assert r.stdout.startswith("registered default/cli_square_warned")
    # describe shows what the record says now, the same way.
    d = cli(daemon, "describe", "cli_square_warned")
    assert d.returncode == 0, d.stderr
    assert "warning: " in d.stderr and "cli_square_grad_not_registered" in d.stderr, d.stderr


# opjit verify and opjit bench (issue 31) against the session's daemon, on
# float32 kernels written here: y = 2x as the reference (x + x), a correct
# candidate (x * 2) and a wrong one (2x, but 3x at flat index 3).
VERIFY_OPS = {"cli_v_ref": "+ x[i]", "cli_v_good": "* 2.0f",
              "cli_v_bad": "* (i == 3 ? 3.0f : 2.0f)"}


def evaluator_answers(daemon):
    """Skips (only) when the daemon has no Evaluator service (UNIMPLEMENTED)."""
    r = cli(daemon, "verify", "cli_v_probe_missing", "--against", "cli_v_probe_missing")
    if "UNIMPLEMENTED" in r.stderr:
        pytest.skip("opjitd does not implement opjit.v1.Evaluator yet (UNIMPLEMENTED)")


@pytest.fixture(scope="module")
def verify_ops(daemon, tmp_path_factory):
    from conftest import unary_kernel, unary_spec
    evaluator_answers(daemon)
    d = tmp_path_factory.mktemp("verify_ops")
    for ns in ("", "cli_v_ns"):
        for name, body in VERIFY_OPS.items():
            spec = unary_spec(name, unary_kernel(body),
                              output_rules=[{"kind": "same_as", "input": 0}])
            args = ["register", write(d, name + ".json", json.dumps(spec))]
            r = cli(daemon, *(args + (["--namespace", ns] if ns else [])))
            assert r.returncode == 0, r.stderr
    return True


def verify_rows(stdout):
    """The case rows of `opjit verify`'s table: {index: [cells]} (split on
    two spaces or more)."""
    rows = {}
    for line in stdout.splitlines()[1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if not cells[0].isdigit():
            break
        rows[int(cells[0])] = cells
    return rows


def test_verify_a_correct_candidate_exits_0_with_a_table(daemon, verify_ops):
    r = cli(daemon, "verify", "cli_v_good", "--against", "cli_v_ref", "--seed", "7")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert re.match(r"  #\s+kind\s+dtype\s+shapes\s+result\s+max abs err", lines[0]), r.stdout
    rows = verify_rows(r.stdout)
    assert rows and all(c[4] == "pass" for c in rows.values()), r.stdout
    kinds = {c[1] for c in rows.values()}
    assert "random" in kinds and "special" in kinds, r.stdout
    summary = [l for l in lines if l.startswith("verify cli_v_good against cli_v_ref: ")]
    assert summary and re.search(r": PASS: %d passed, 0 failed, \d+ skipped; deterministic; "
                                 r"seed 7$" % len(rows), summary[0]), summary
    assert any(l.startswith("tolerances: float32: ") for l in lines), r.stdout
    assert lines[-1].startswith("reproduce: opjit verify "), r.stdout


def test_verify_a_wrong_candidate_exits_3_with_the_worst_index(daemon, verify_ops):
    r = cli(daemon, "verify", "cli_v_bad", "--against", "cli_v_ref", "--shape", "8",
            "--no-special", "--low", "1", "--high", "2")
    assert r.returncode == 3, r.stdout + r.stderr
    rows = verify_rows(r.stdout)
    assert rows and all(c[4] == "FAIL" for c in rows.values()), r.stdout
    for cells in rows.values():
        assert cells[3] == "float32[8]" and cells[8] == "out0[3]", cells
        cand, ref = (float(v) for v in cells[9].split(" vs "))
        assert cand == pytest.approx(1.5 * ref, rel=1e-6), cells  # 3x against 2x
    assert re.search(r"^verify cli_v_bad against cli_v_ref: FAIL: 0 passed, %d failed"
                     % len(rows), r.stdout, re.M), r.stdout
    # A shape with no element 3 passes.
    r = cli(daemon, "verify", "cli_v_bad", "--against", "cli_v_ref", "--shape", "3")
    assert r.returncode == 0, r.stdout + r.stderr


def test_verify_json_has_the_cases(daemon, verify_ops):
    r = cli(daemon, "verify", "cli_v_bad", "--against", "cli_v_ref", "--shape", "4", "--shape",
            "2", "--seeds", "1", "--no-special", "--low", "-2", "--high", "-1", "--json")
    assert r.returncode == 3, r.stderr
    out = json.loads(r.stdout)
    assert out["passed"] is False and out["cases_failed"] == 1 and out["cases_passed"] == 1
    assert len(out["cases"]) == 2, out
    failed = [c for c in out["cases"] if not c["passed"]]
    assert failed[0]["shapes"] == "float32[4]" and int(failed[0]["worst_index"]) == 3
    assert out["reproduce"].startswith("opjit verify ")


def test_verify_reproduce_line_runs_the_same_cases(daemon, verify_ops):
    r = cli(daemon, "verify", "cli_v_ns/cli_v_bad", "--against", "cli_v_ref", "--shape", "5:",
            "--shape", "[6]", "--seeds", "1", "--json")
    # A one-input op with a two-input shape set is the server's to refuse.
    assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr, r.stdout + r.stderr
    # |x| >= 1: element 3 is at least 1 off, past atol 0.5, in every random case.
    r = cli(daemon, "verify", "cli_v_ns/cli_v_bad", "--against", "cli_v_ref", "--shape", "5",
            "--shape", "[6]", "--seeds", "1", "--atol", "0.5", "--low", "1", "--high", "2",
            "--json")
    assert r.returncode == 3, r.stdout + r.stderr
    first = json.loads(r.stdout)
    argv = shlex.split(first["reproduce"])
    assert argv[0] == "opjit", argv
    again = cli(daemon, *argv[1:], "--json")
    assert again.returncode == 3, (r.stdout, again.stdout, again.stderr)
    second = json.loads(again.stdout)
    assert second["seed"] == first["seed"]
    strip = lambda cases: [{k: v for k, v in c.items() if k != "candidate_kernel_ms"}
                           for c in cases]
    assert strip(second["cases"]) == strip(first["cases"])


def test_verify_a_given_case(daemon, verify_ops, tmp_path):
    x = np.array([1.0, -2.0, 0.5, 4.0], np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", 2 * x)
    r = cli(daemon, "verify", "cli_v_good", "--in", str(tmp_path / "x.npy"),
            "--expect", str(tmp_path / "y.npy"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^verify cli_v_good: PASS: 1 passed", r.stdout, re.M), r.stdout
    r = cli(daemon, "verify", "cli_v_bad", "--in", str(tmp_path / "x.npy"),
            "--expect", str(tmp_path / "y.npy"))
    assert r.returncode == 3, r.stdout + r.stderr
    (cells,) = verify_rows(r.stdout).values()
    assert cells[1] == "given" and cells[4] == "FAIL" and cells[8] == "out0[3]", cells
    # Its reproduce line names the files (absolute): it reruns the case, same verdict.
    again = run_reproduce_line(daemon, r.stdout)
    assert again.returncode == 3, again.stdout + again.stderr
    assert verify_rows(again.stdout) == verify_rows(r.stdout), (r.stdout, again.stdout)


def run_reproduce_line(daemon, stdout):
    """Runs the `reproduce:` line `opjit verify` printed last, as a shell would."""
    line = stdout.splitlines()[-1]
    assert line.startswith("reproduce: opjit verify "), stdout
    argv = shlex.split(line[len("reproduce: "):])
    return cli(daemon, *argv[1:])


def test_verify_an_output_never_written_says_so(daemon, verify_ops, tmp_path):
    spec = unary_spec_of("cli_v_writes_nothing", "return 0;")
    assert cli(daemon, "register", write(tmp_path, "n.json", json.dumps(spec))).returncode == 0
    r = cli(daemon, "verify", "cli_v_writes_nothing", "--against", "cli_v_ref", "--shape", "5",
            "--seeds", "1", "--no-special")
    assert r.returncode == 3, r.stdout + r.stderr
    (cells,) = verify_rows(r.stdout).values()
    # No "0 vs 0" value columns: nothing was compared.
    assert cells[4] == "FAIL" and cells[9] == "-", cells
    assert cells[10] == ("output y was never written: it still holds the poison pattern it "
                         "starts with"), cells
    again = run_reproduce_line(daemon, r.stdout)
    assert again.returncode == 3 and verify_rows(again.stdout) == verify_rows(r.stdout), (
        r.stdout, again.stdout, again.stderr)


def unary_spec_of(name, pre="", body="* 2.0f", **fields):
    from conftest import unary_kernel, unary_spec
    return unary_spec(name, unary_kernel(body, pre=pre),
                      output_rules=[{"kind": "same_as", "input": 0}], **fields)


def test_verify_fp_contract_off_matches_numpy_bit_for_bit(daemon, verify_ops, tmp_path):
    # y = x*x - 1 near x = 1: an FMA keeps x*x unrounded, so a contracted
    # build differs from numpy's float32 (two roundings) in most elements.
    # -ffp-contract=off is another artifact (the option keys the compile).
    for name, options in (("cli_fma_default", []), ("cli_fma_off", ["-ffp-contract=off"])):
        spec = unary_spec_of(name, body="* x[i] - 1.0f")
        spec["implementations"][0]["compile_options"] = options
        r = cli(daemon, "register", write(tmp_path, name + ".json", json.dumps(spec)))
        assert r.returncode == 0, r.stderr
    x = np.random.default_rng(3).uniform(0.9, 1.1, 1024).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", x * x - np.float32(1))
    given = ["--in", str(tmp_path / "x.npy"), "--expect", str(tmp_path / "y.npy"), "--atol", "0",
             "--rtol", "0"]
    r = cli(daemon, "verify", "cli_fma_off", *given)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "candidate cli_fma_off (cpu): -O3 -march=native, fp-contract=off, no fast-math" in r.stdout
    again = run_reproduce_line(daemon, r.stdout)
    assert again.returncode == 0, again.stdout + again.stderr
    r = cli(daemon, "verify", "cli_fma_default", *given)
    assert "candidate cli_fma_default (cpu): -O3 -march=native, fp-contract=on, " in r.stdout, r.stdout
    with open("/proc/cpuinfo") as f:
        fma = " fma " in f.read().replace("\n", " ")
    assert r.returncode == (3 if fma else 0), r.stdout + r.stderr
    spec = unary_spec_of("cli_fma_bad")
    spec["implementations"][0]["compile_options"] = ["-ffp-contract=fast-honor-pragmas"]
    r = cli(daemon, "register", write(tmp_path, "bad.json", json.dumps(spec)))
    assert r.returncode != 0 and "-ffp-contract= needs off, on or fast" in r.stderr, r.stderr


def test_verify_and_bench_an_unknown_op_is_not_found(daemon, verify_ops):
    for args in (["verify", "cli_v_no_such_op", "--against", "cli_v_ref"],
                 ["verify", "cli_v_good", "--against", "cli_v_no_such_op"],
                 ["verify", "cli_v_good@99", "--against", "cli_v_ref"],
                 ["bench", "cli_v_no_such_op"]):
        r = cli(daemon, *args)
        assert r.returncode == 1, (args, r.returncode, r.stdout, r.stderr)
        line = r.stderr.strip()
        assert "\n" not in line and line.startswith("opjit: NOT_FOUND: "), (args, line)
        assert "cli_v_no_such_op" in line or "99" in line, (args, line)
        assert r.stdout == ""


def test_bench_against_itself_prints_a_ratio(daemon, verify_ops):
    r = cli(daemon, "bench", "cli_v_good", "--against", "cli_v_good", "--shape", "4096",
            "--min-time-ms", "50", "--max-reps", "200", "--seed", "5")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("bench cli_v_good (float32[4096]): warm cache"), r.stdout
    assert re.match(r"\s+time\s+reps\s+median ms\s+p10 ms\s+p90 ms\s+spread$", lines[1]), r.stdout
    assert re.match(r"  cli_v_good\s+end-to-end\s+\d+\s+[0-9.e-]+\s", lines[2]), r.stdout
    m = re.search(r"^ratio cli_v_good / cli_v_good \(kernel time\): ([0-9.e+-]+) "
                  r"\(p10 ([0-9.e+-]+), p90 ([0-9.e+-]+)\)$", r.stdout, re.M)
    assert m, r.stdout
    ratio, p10, p90 = (float(v) for v in m.groups())
    assert 0 < p10 <= ratio <= p90, m.groups()
    assert lines[-1].startswith("reproduce: opjit bench "), r.stdout
    j = cli(daemon, "bench", "cli_v_ns/cli_v_good", "--shape", "256", "--min-time-ms", "20",
            "--json")
    assert j.returncode == 0, j.stderr
    out = json.loads(j.stdout)
    assert out["op"]["reps"] >= 10 and out["op"]["median_ms"] > 0 and "reference" not in out
    argv = shlex.split(out["reproduce"])
    again = cli(daemon, *argv[1:], "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["shapes"] == out["shapes"]


def test_verify_reproduce_line_keeps_the_attrs(daemon, verify_ops):
    assert cli(daemon, "register", os.path.join(EXAMPLES, "leaky_relu.json")).returncode == 0
    r = cli(daemon, "verify", "leaky_relu", "--against", "leaky_relu", "--shape", "3",
            "--seeds", "1", "--attr", "alpha=0.5", "--settle-ms", "20", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    argv = shlex.split(json.loads(r.stdout)["reproduce"])
    assert "alpha=0.5" in argv and "20" in argv, argv


def test_verify_reproduce_line_of_a_scalar_shape_runs(daemon, verify_ops):
    assert cli(daemon, "register", os.path.join(EXAMPLES, "leaky_relu.json")).returncode == 0
    r = cli(daemon, "verify", "leaky_relu", "--against", "leaky_relu", "--shape", "[]",
            "--seeds", "1", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    argv = shlex.split(json.loads(r.stdout)["reproduce"])
    again = cli(daemon, *argv[1:])
    assert again.returncode == 0, again.stdout + again.stderr


def test_grad_without_grad_out_uses_ones_and_says_so(daemon, grad_ops, tmp_path):
    # MindSpore's ms.grad seeds every output with ones (its default
    # sensitivity); `opjit grad` without --grad-out does the same and says so
    # on stderr (issue 40, item 4: it gave zeros, silently).
    x = np.array([1, 2, -3, 0.5], dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    dx = str(tmp_path / "dx.npy")
    r = cli(daemon, "grad", "square", "--in", str(tmp_path / "x.npy"), "--out", dx)
    assert r.returncode == 0, r.stderr
    assert ("--grad-out not given: using ones for every output (MindSpore's default "
            "sensitivity)") in r.stderr, r.stderr
    np.testing.assert_allclose(np.load(dx), 2 * x)
    # Given, it is used, and nothing is said.
    dy = np.array([1, 0, 2, -1], dtype=np.float32)
    np.save(tmp_path / "dy.npy", dy)
    r = cli(daemon, "grad", "square", "--in", str(tmp_path / "x.npy"), "--grad-out",
            str(tmp_path / "dy.npy"), "--out", dx)
    assert r.returncode == 0, r.stderr
    assert "--grad-out not given" not in r.stderr, r.stderr
    np.testing.assert_allclose(np.load(dx), 2 * x * dy)
