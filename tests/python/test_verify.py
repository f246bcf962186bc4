"""opjit.verify and opjit.bench (the Evaluator service, issue 31): a correct
kernel passes every generated case, wrong ones and cheats fail with their
worst case shown, bench of an op against itself gives a ratio around 1, and
bad requests raise opjit's errors. The kernels are kernels/verify/scale_add.cc
(see the README there)."""

import json
import math
import os
import re

import numpy as np
import pytest

import opjit
from conftest import REPO

KERNELS = os.path.join(REPO, "kernels", "verify")

# Op name -> entry in scale_add.cc. Every op takes x and gives y, float32 and float64.
OPS = {
    "vf_scale_add": "ScaleAdd",
    "vf_ulp3": "ScaleAddUlp3",
    "vf_off_by_one": "ScaleAddOffByOne",
    "vf_nan_to_zero": "ScaleAddNanToZero",
    "vf_wrong_at_1031": "ScaleAddWrongAt1031",
    "vf_clobber": "ScaleAddClobber",
    "vf_flaky": "ScaleAddFlaky",
    "vf_writes_nothing": "CheatWritesNothing",
    "vf_stale": "CheatStale",
    "vf_cached": "CheatCached",
    "vf_late_write": "CheatLateWrite",
    "vf_test_shape": "CheatTestShape",
    "vf_first_calls": "CheatFirstCalls",
}
REF = "vf_scale_add_ref"
CHEATS = ["vf_writes_nothing", "vf_stale", "vf_cached", "vf_late_write", "vf_test_shape",
          "vf_first_calls"]


def spec(name, entry, dtypes=("float32", "float64"), inputs=("x",)):
    with open(os.path.join(KERNELS, "scale_add.json")) as f:
        s = json.load(f)
    s.update(name=name, doc="kernels/verify/scale_add.cc " + entry,
             inputs=[{"index": i, "name": n} for i, n in enumerate(inputs)],
             dtype_formats=[{"dtypes": [d] * (len(inputs) + 1)} for d in dtypes])
    s["implementations"][0]["entry"] = entry
    return s


@pytest.fixture(scope="module")
def ops(daemon):
    with opjit.Client(daemon.unix_address, timeout=300) as c:
        c.register(os.path.join(KERNELS, "scale_add_ref.json"), name=REF)
        for name, entry in OPS.items():
            c.register(spec(name, entry), base_dir=KERNELS)
        c.register(spec("vf_bias", "ScaleAddBias", dtypes=["float32"], inputs=("x", "b")),
                   base_dir=KERNELS)
        c.register(spec("vf_scale_add_f32", "ScaleAdd", dtypes=["float32"]), base_dir=KERNELS)
    return True


@pytest.fixture
def vclient(daemon, ops):
    c = opjit.Client(daemon.unix_address, timeout=300)
    yield c
    c.close()


def elements(shapes):
    """The element count of the first tensor of a case's shapes ("float32[7], ...")."""
    dims = re.match(r"\w+\[([0-9, ]*)\]", shapes).group(1)
    return int(np.prod([int(d) for d in dims.split(",") if d.strip()] or [1]))


def shown(case):
    """The case names its worst element or says what went wrong."""
    return case.worst_index >= 0 or bool(case.message)


# ---- correct kernels ------------------------------------------------------------------

def test_the_correct_candidate_passes_every_case(vclient):
    r = opjit.verify("vf_scale_add", REF, client=vclient)
    assert r, r.table()
    assert r.passed and r.deterministic and r.seed != 0
    assert r.cases and r.cases_passed == len(r.cases) and r.cases_failed == 0
    for c in r.cases:
        assert c.passed and c.deterministic and not c.skipped and not c.message, c
        assert c.max_abs_error == 0 and c.max_ulp_error == 0, c  # the same bits
    assert {c.kind for c in r.cases} == {"random", "special"}
    assert {c.dtype for c in r.cases} == {"float32", "float64"}
    # The server's edge cases: an empty tensor, one element, odd and large sizes.
    sizes = {elements(c.shapes) for c in r.cases}
    assert 0 in sizes and 1 in sizes and max(sizes) >= 1024, sizes
    assert r.tolerances and any(t.startswith("float32") for t in r.tolerances)
    assert "vf_scale_add" in r.reproduce and str(r.seed) in r.reproduce
    # The result's forms: cases as objects and as dicts, JSON, a table.
    c = r.cases[0]
    assert c["dtype"] == c.dtype and c.to_dict()["shapes"] == c.shapes
    assert set(c.keys()) >= {"index", "kind", "dtype", "shapes", "seed", "passed", "worst_index",
                             "candidate_value", "reference_value", "message"}
    d = json.loads(r.to_json())
    assert d["passed"] is True and len(d["cases"]) == len(r.cases) and d["seed"] == r.seed
    table = r.table()
    assert table.splitlines()[0].startswith("passed") and "FAIL" not in table
    assert "reproduce: " + r.reproduce in table


def test_op_objects_names_and_namespaces(vclient):
    r = opjit.verify(vclient.op("vf_scale_add"), vclient.op(REF), shapes=[7], seeds=1)
    assert r, r.table()
    # The client of an Op is used; "ns/name" names the namespace.
    assert opjit.verify(vclient.op("vf_scale_add"), "default/" + REF, shapes=[7], seeds=1)
    assert opjit.verify("default/vf_scale_add", REF, shapes=[7], seeds=1, client=vclient)
    assert opjit.verify("vf_scale_add", REF, shapes=[7], seeds=1, namespace="default",
                        client=vclient)
    # A bare name is of the client's namespace (or `namespace`), as client.op names it.
    with pytest.raises(opjit.InvalidArgument) as e:
        opjit.verify("vf_scale_add", "elsewhere/" + REF, client=vclient)
    assert "namespace" in e.value.message
    with pytest.raises(opjit.InvalidArgument):
        opjit.verify(vclient.op("vf_scale_add"), REF, namespace="elsewhere")
    with pytest.raises(opjit.NotFound):  # both in "elsewhere", where neither is
        opjit.verify("vf_scale_add", REF, namespace="elsewhere", client=vclient)


def test_seed_reproduces_the_cases(vclient):
    first = opjit.verify("vf_scale_add", REF, shapes=[5, [3, 4]], seeds=3, client=vclient)
    again = opjit.verify("vf_scale_add", REF, shapes=[5, [3, 4]], seeds=3, seed=first.seed,
                         client=vclient)
    assert again.seed == first.seed
    assert [(c.kind, c.dtype, c.shapes, c.seed) for c in again.cases] == \
        [(c.kind, c.dtype, c.shapes, c.seed) for c in first.cases]
    # 2 shapes x 2 dtypes x (3 random + 1 special).
    assert len(first.cases) == 16
    assert {elements(c.shapes) for c in first.cases} == {5, 12}


def test_dtypes_limit_the_rows(vclient):
    r = opjit.verify("vf_scale_add", REF, dtypes=["float32"], shapes=[7], client=vclient)
    assert r and {c.dtype for c in r.cases} == {"float32"}
    r = opjit.verify("vf_scale_add", REF, dtypes=np.float64, shapes=[7], client=vclient)
    assert r and {c.dtype for c in r.cases} == {"float64"}


def test_fp64_reference(vclient):
    r = opjit.verify("vf_scale_add_f32", REF, fp64_reference=True, special_values=False,
                     client=vclient)
    assert r, r.table()
    assert {c.dtype for c in r.cases} == {"float32"}
    assert any("float64" in t for t in r.tolerances), r.tolerances


def test_fp64_reference_on_special_values(vclient):
    r = opjit.verify("vf_scale_add_f32", REF, fp64_reference=True, client=vclient)
    assert r, r.table()


def test_a_shape_for_every_input_or_one_each(vclient):
    """A one-shape set stands for every input; a set may give each input its own."""
    r = opjit.verify("vf_bias", "vf_bias", shapes=[[7], [[2, 3], [2, 3]]], client=vclient)
    assert r, r.table()
    assert [c.shapes for c in r.cases if c.kind == "random"][0].count("[7]") == 2
    with pytest.raises(opjit.InvalidArgument):  # three shapes for two inputs
        opjit.verify("vf_bias", "vf_bias", shapes=[[[7], [7], [7]]], client=vclient)


def test_given_cases(vclient):
    x = np.array([0.5, -1.0, 3.0, np.nan], np.float32)
    assert opjit.verify("vf_scale_add", given=[([x], [2 * x + 1])], client=vclient)
    assert opjit.verify("vf_scale_add", given=[{"inputs": [x.astype(np.float64)],
                                                "outputs": 2 * x.astype(np.float64) + 1}],
                        client=vclient)
    wrong = 2 * x + 1
    wrong[2] = 0
    r = opjit.verify("vf_scale_add", given=[([x], wrong)], atol=0, rtol=0, client=vclient)
    assert not r and r.cases[0].kind == "given"
    assert r.cases[0].worst_index == 2 and r.cases[0].candidate_value == 7
    assert r.cases[0].reference_value == 0
    with pytest.raises(opjit.InvalidArgument):  # two inputs for a one-input op
        opjit.verify("vf_scale_add", given=[([x, x], [x])], client=vclient)


def test_attrs(vclient, examples_registered):
    r = opjit.verify("leaky_relu", "leaky_relu", attrs={"alpha": 0.2}, dtypes=["float32"],
                     shapes=[64], client=vclient)
    assert r, r.table()


# ---- wrong kernels --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_ulps(vclient, dtype):
    """Every result 3 units in the last place off: ulps=2 fails, ulps=3 passes."""
    exact = dict(atol=0, rtol=0, shapes=[1031], dtypes=[dtype], client=vclient)
    r = opjit.verify("vf_ulp3", REF, ulps=2, **exact)
    assert not r and not any(c.passed for c in r.cases), r.table()
    for c in r.cases:
        assert c.dtype == dtype and c.max_ulp_error == 3 and c.worst_index >= 0, c
        assert abs(c.candidate_value) < abs(c.reference_value), c
    r = opjit.verify("vf_ulp3", REF, ulps=3, **exact)
    assert r, r.table()
    assert all(c.max_ulp_error == 3 for c in r.cases), r.table()
    assert any("ulps=3" in t for t in r.tolerances), r.tolerances


def test_off_by_one(vclient):
    r = opjit.verify("vf_off_by_one", REF, client=vclient)
    assert not r and r.failures, r.table()
    for c in r.failures:
        assert c.worst_index == elements(c.shapes) - 1, c  # the last element
    assert all(c.passed for c in r.cases if elements(c.shapes) == 0)


def test_nan_mapped_to_zero(vclient):
    assert opjit.verify("vf_nan_to_zero", REF, special_values=False, client=vclient)
    r = opjit.verify("vf_nan_to_zero", REF, client=vclient)
    assert not r, r.table()
    assert {c.kind for c in r.failures} == {"special"}
    for c in r.failures:
        assert c.candidate_value == 0 and math.isnan(c.reference_value), c


def test_wrong_on_one_size(vclient):
    assert opjit.verify("vf_wrong_at_1031", REF, shapes=[1024, 7, [3, 5]], client=vclient)
    # The server's own shapes include odd and prime sizes no test would single out.
    assert not opjit.verify("vf_wrong_at_1031", REF, client=vclient)
    r = opjit.verify("vf_wrong_at_1031", REF, shapes=[1031], client=vclient)
    assert not r and r.failures and all(shown(c) for c in r.failures), r.table()


def test_inputs_must_come_back_unchanged(vclient):
    r = opjit.verify("vf_clobber", REF, shapes=[7], client=vclient)
    assert not r and all(shown(c) for c in r.failures), r.table()
    assert any("input" in c.message for c in r.failures), r.table()
    assert opjit.verify("vf_clobber", REF, shapes=[7], inplace=["x"], client=vclient)
    assert opjit.verify("vf_clobber", REF, shapes=[7], inplace=[0], client=vclient)
    with pytest.raises(opjit.InvalidArgument):
        opjit.verify("vf_clobber", REF, shapes=[7], inplace=["nope"], client=vclient)


def test_nondeterminism_is_reported(vclient):
    r = opjit.verify("vf_flaky", REF, shapes=[64], client=vclient)
    assert not r.deterministic, r.table()
    assert any(not c.deterministic for c in r.cases)


# ---- cheats ---------------------------------------------------------------------------

@pytest.mark.parametrize("cheat", CHEATS)
def test_cheats_fail(vclient, cheat):
    r = opjit.verify(cheat, REF, client=vclient)
    assert not r and r.cases_failed > 0, "%s passed:\n%s" % (cheat, r.table())
    assert r.failures and all(shown(c) for c in r.failures), r.table()
    assert "FAIL" in r.table() and r.summary().startswith("FAILED")
    # Also on the one shape a tester might pick, with many seeds.
    r = opjit.verify(cheat, REF, shapes=[1024], seeds=8, dtypes=["float32"], client=vclient)
    if cheat != "vf_test_shape":
        assert not r, "%s passed on [1024]:\n%s" % (cheat, r.table())


def test_an_output_never_written_is_said_in_words(vclient):
    r = opjit.verify("vf_writes_nothing", REF, shapes=[5], seeds=1, special_values=False,
                     dtypes=["float32"], client=vclient)
    (c,) = r.failures
    assert c.message == ("output y was never written: it still holds the poison pattern it "
                         "starts with"), c
    # No value was compared: none is shown ("candidate 0 vs reference 0" read as a pass).
    assert not c.compared and c.worst() == "output 0 [0]", c
    assert " vs " not in r.summary() and " vs " not in repr(c), r.summary()


def test_the_test_shape_cheat_is_right_on_its_shape(vclient):
    """What makes it a cheat: a test on [1024] alone would pass it."""
    assert opjit.verify("vf_test_shape", REF, shapes=[1024], client=vclient)


# ---- errors ---------------------------------------------------------------------------

def test_unknown_ops(vclient):
    with pytest.raises(opjit.NotFound):
        opjit.verify("vf_no_such_op", REF, client=vclient)
    with pytest.raises(opjit.NotFound):
        opjit.verify("vf_scale_add", "vf_no_such_ref", client=vclient)
    with pytest.raises(opjit.NotFound):
        opjit.bench("vf_no_such_op", client=vclient)


def test_a_reference_of_another_arity(vclient):
    with pytest.raises(opjit.InvalidArgument) as e:
        opjit.verify("vf_scale_add", "vf_bias", client=vclient)
    assert "vf_bias" in e.value.message


def test_limits(vclient):
    with pytest.raises(opjit.ResourceExhausted):  # 7 shapes x 2 dtypes x 1001 cases
        opjit.verify("vf_scale_add", REF, seeds=1000, client=vclient)
    with pytest.raises(opjit.ResourceExhausted):  # 2^26 elements
        opjit.verify("vf_scale_add", REF, shapes=[[1 << 13, 1 << 13]], client=vclient)
    with pytest.raises((opjit.InvalidArgument, opjit.ResourceExhausted)):  # at most 1000
        opjit.verify("vf_scale_add", REF, shapes=[7], settle_ms=5000, client=vclient)
    with pytest.raises(opjit.ResourceExhausted):  # at most 100000
        opjit.bench("vf_scale_add", shape=[7], max_reps=200000, client=vclient)
    with pytest.raises(opjit.ResourceExhausted):  # at most 60000
        opjit.bench("vf_scale_add", shape=[7], min_time_ms=100000, client=vclient)


def test_bad_requests_found_by_the_client(vclient):
    x = np.ones(3, np.float32)
    with pytest.raises(opjit.InvalidArgument):
        opjit.verify("vf_scale_add", client=vclient)  # nothing to compare with
    with pytest.raises(opjit.InvalidArgument):
        opjit.verify("vf_scale_add", REF, given=[([x], [x])], client=vclient)
    with pytest.raises(opjit.InvalidArgument):
        opjit.verify("vf_scale_add", REF, low=-1, client=vclient)
    with pytest.raises(opjit.InvalidArgument):
        opjit.verify("vf_scale_add", REF, shapes=[["a"]], client=vclient)
    with pytest.raises(opjit.InvalidArgument):
        opjit.verify(42, REF, client=vclient)
    with pytest.raises(opjit.InvalidArgument):  # low above high
        opjit.verify("vf_scale_add", REF, low=1, high=-1, shapes=[7], client=vclient)


def test_low_and_high(vclient):
    r = opjit.verify("vf_scale_add", REF, low=100, high=200, shapes=[64], special_values=False,
                     client=vclient)
    assert r, r.table()


# ---- bench ----------------------------------------------------------------------------

def test_bench_against_itself(vclient):
    t = opjit.bench("vf_scale_add", "vf_scale_add", shape=[1 << 16], min_time_ms=300,
                    client=vclient)
    assert t.reference is not None, t.table()
    assert t.op.reps >= 10 and t.reference.reps >= 10
    for s in (t.op, t.reference):
        assert 0 < s.p10_ms <= s.median_ms <= s.p90_ms, t.table()
        assert 0 < s.kernel_p10_ms <= s.kernel_median_ms <= s.kernel_p90_ms, t.table()
    # The same kernel in alternation: the ratio's p10..p90 holds 1, or the
    # median ratio is near 1 (a noisy 2-core machine can shift a whole run).
    assert t.ratio_p10 <= t.ratio <= t.ratio_p90, t.table()
    assert t.ratio_p10 <= 1.0 <= t.ratio_p90 or abs(t.ratio - 1) < 0.2, t.table()
    assert "65536" in t.shapes and "vf_scale_add" in t.reproduce
    d = json.loads(t.to_json())
    assert d["op"]["reps"] == t.op.reps and d["reference"]["reps"] == t.reference.reps
    assert "ratio op/reference" in t.table()


def test_bench_alone_and_options(vclient):
    t = opjit.bench(vclient.op("vf_scale_add"), shape=1024, dtype="float64", warmup=2,
                    min_reps=5, max_reps=20, min_time_ms=1, flush_cache=True, seed=7)
    assert t.reference is None and t.ratio == 0
    assert 5 <= t.op.reps <= 20 and t.op.median_ms > 0
    assert "float64" in t.shapes and t.flush_bytes > 0
    assert json.loads(t.to_json())["reference"] is None
