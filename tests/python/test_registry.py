"""Registry, compiler and errors through the Python client."""

import json
import os

import grpc
import numpy as np
import pytest

import opjit
from conftest import EXAMPLES

F32 = opjit.DataType.F32_Default
F16 = opjit.DataType.F16_Default


def test_info(client, daemon):
    info = client.info()
    assert info.version
    assert info.kernel_abi_version >= 1
    assert info.cpu.triple
    assert info.state_dir == daemon.state_dir


def test_register_from_json_path(client):
    r = client.register(os.path.join(EXAMPLES, "leaky_relu.json"))
    assert r.record.op.name == "leaky_relu"
    assert r.record.version >= 1
    again = client.register(os.path.join(EXAMPLES, "leaky_relu.json"))
    assert not again.created
    assert again.record.version == r.record.version


def test_register_from_dict_with_base_dir(client):
    with open(os.path.join(EXAMPLES, "scale_bias.json")) as f:
        spec = json.load(f)
    spec["name"] = "scale_bias_dict"
    r = client.register(spec, base_dir=EXAMPLES)
    assert r.record.op.name == "scale_bias_dict"
    # source_file was read by the client into source.
    impl = client.describe("scale_bias_dict").op.implementations[0]
    assert "ScaleBias" in impl.source and not impl.source_file


def test_register_from_dict_relative_to_cwd(client, monkeypatch):
    monkeypatch.chdir(EXAMPLES)
    with open("add_n.json") as f:
        spec = json.load(f)
    spec["name"] = "add_n_cwd"
    assert client.register(spec).record.op.name == "add_n_cwd"


def test_register_camel_case_keys(client):
    with open(os.path.join(EXAMPLES, "leaky_relu.cc")) as f:
        src = f.read()
    spec = {"name": "leaky_relu_camel",
            "inputs": [{"index": 0, "name": "x", "paramType": "required"}],
            "outputs": [{"index": 0, "name": "y"}],
            "attrs": [{"name": "alpha", "paramType": "optional", "valueType": "float",
                       "defaultValue": "0.01"}],
            "dtypeFormats": [{"dtypes": ["float32", "float32"]}],
            "implementations": [{"target": "CPU", "source": src, "entry": "CustomLeakyRelu"}]}
    r = client.register(spec)
    assert r.record.op.attrs[0].default_value == "0.01"


def test_builder_get_op_info_and_register(client):
    b = (opjit.CustomRegOp("leaky_relu_builder")
         .input(0, "x", "required")
         .output(0, "y", "required")
         .attr("alpha", "optional", "float", "0.01")
         .dtype_format(F32, F32)
         .dtype_format(F16, F16)
         .target("CPU")
         .impl(source_file="leaky_relu.cc", entry="CustomLeakyRelu", language="c++")
         .output_rule("same_as", input=0)
         .bprop("leaky_relu_grad"))
    info = b.get_op_info()
    assert info["name"] == "leaky_relu_builder"
    assert info["inputs"] == [{"index": 0, "name": "x", "param_type": "required"}]
    assert info["attrs"][0] == {"name": "alpha", "param_type": "optional", "value_type": "float",
                                "default_value": "0.01"}
    assert info["dtype_formats"][0] == {"dtypes": ["float32", "float32"],
                                        "formats": ["DefaultFormat", "DefaultFormat"]}
    assert info["implementations"][0]["target"] == "CPU"
    assert info["backward"] == {"op": "leaky_relu_grad"}
    json.dumps(info)  # plain JSON
    r = client.register(b, base_dir=EXAMPLES)
    rec = client.describe("leaky_relu_builder", r.record.version)
    assert rec.op.backward.op == "leaky_relu_grad"
    assert [d.dtypes for d in rec.op.dtype_formats] == [["float32", "float32"],
                                                        ["float16", "float16"]]
    y = client.op("leaky_relu_builder")(np.array([-1.0, 2.0], np.float32), alpha=0.5)
    np.testing.assert_allclose(y, [-0.5, 2.0])


def test_datatype_constants():
    assert opjit.DataType.F32_Default == ("float32", "DefaultFormat")
    assert opjit.DataType.I64_NCHW == ("int64", "NCHW")
    assert opjit.DataType.BOOL_Default == ("bool", "DefaultFormat")
    assert opjit.DataType.U8_ND == ("uint8", "ND")
    assert opjit.DataType.F16_None == ("float16", "")


def test_builder_defaults_text():
    info = (opjit.CustomRegOp("x").attr("axes", "optional", "listInt", [1, 2])
            .attr("flag", "optional", "bool", True).attr("n", "required", "int")
            .get_op_info())
    assert info["attrs"][0]["default_value"] == "[1, 2]"
    assert info["attrs"][1]["default_value"] == "true"
    assert "default_value" not in info["attrs"][2]
    with pytest.raises(opjit.InvalidArgument):
        opjit.CustomRegOp("x").attr("a", "optional", "double")
    with pytest.raises(opjit.InvalidArgument):
        opjit.CustomRegOp("x").target("Ascend")


def test_versions_list_describe_delete(client):
    base = (opjit.CustomRegOp("versioned").input(0, "x").output(0, "y").dtype_format(F32, F32)
            .target("CPU"))
    src = open(os.path.join(EXAMPLES, "leaky_relu.cc")).read()
    v1 = client.register(opjit.CustomRegOp("versioned").input(0, "x").output(0, "y")
                         .attr("alpha", "optional", "float", "0.01").dtype_format(F32, F32)
                         .target("CPU").impl(source=src, entry="CustomLeakyRelu"))
    v2 = client.register(opjit.CustomRegOp("versioned").input(0, "x").output(0, "y")
                         .attr("alpha", "optional", "float", "0.5").dtype_format(F32, F32)
                         .target("CPU").impl(source=src, entry="CustomLeakyRelu"))
    del base
    assert v2.created and v2.record.version == v1.record.version + 1
    assert client.describe("versioned").version == v2.record.version
    assert client.describe("versioned", version=v1.record.version).op.attrs[0].default_value == \
        "0.01"
    names = [r.op.name for r in client.ops()]
    assert names.count("versioned") == 1
    all_v = [r.version for r in client.ops(all_versions=True) if r.op.name == "versioned"]
    assert sorted(all_v) == [v1.record.version, v2.record.version]
    x = np.array([-2.0], np.float32)
    np.testing.assert_allclose(client.op("versioned")(x), [-1.0])
    np.testing.assert_allclose(client.op("versioned")(x, version=v1.record.version), [-0.02])
    assert client.delete("versioned", version=v1.record.version) == 1
    assert client.delete("versioned") == 1
    with pytest.raises(opjit.NotFound):
        client.describe("versioned")


def test_namespaces(client, daemon):
    src = open(os.path.join(EXAMPLES, "leaky_relu.cc")).read()
    with opjit.Client(daemon.unix_address, namespace="team_a") as a:
        a.register(opjit.CustomRegOp("ns_op").input(0, "x").output(0, "y")
                   .attr("alpha", "optional", "float", "0.25").dtype_format(F32, F32)
                   .target("CPU").impl(source=src, entry="CustomLeakyRelu"))
        assert [r.op.name for r in a.ops()] == ["ns_op"]
        np.testing.assert_allclose(a.op("ns_op")(np.array([-4.0], np.float32)), [-1.0])
    assert client.describe("team_a/ns_op").op.namespace == "team_a"
    assert [r.op.name for r in client.ops(namespace="team_a")] == ["ns_op"]
    np.testing.assert_allclose(client.op("team_a/ns_op")(np.array([-4.0], np.float32)), [-1.0])
    with pytest.raises(opjit.NotFound):
        client.describe("ns_op")


def test_errors_carry_codes_and_messages(client):
    with pytest.raises(opjit.NotFound) as e:
        client.describe("no_such_op")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert "no_such_op" in e.value.message
    assert isinstance(e.value, opjit.OpjitError) and isinstance(e.value, LookupError)

    bad = {"name": "bad_dtype_formats", "inputs": [{"index": 0, "name": "x"}],
           "outputs": [{"index": 0, "name": "y"}],
           "dtype_formats": [{"dtypes": ["float32", "float32", "float32"]}],
           "implementations": [{"target": "CPU", "source": "int f;", "entry": "f"}]}
    with pytest.raises(opjit.InvalidArgument) as e:
        client.register(bad)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "dtype_formats[0]" in e.value.message


def test_compile_error_has_diagnostics(client):
    with pytest.raises(opjit.InvalidArgument) as e:
        client.compile('extern "C" int F() { return undefined_name; }', entry="F")
    assert "undefined_name" in e.value.message


def test_compile_ok(client):
    r = client.compile('extern "C" int Fine(int n) { return n + 1; }', entry="Fine")
    assert r.cache_key
    assert "Fine" in list(r.defined_symbols)
    again = client.compile('extern "C" int Fine(int n) { return n + 1; }', entry="Fine")
    assert again.cache_hit in ("memory", "disk")


def test_client_side_spec_errors(client, tmp_path):
    with pytest.raises(opjit.InvalidArgument) as e:
        client.register({"name": "x", "no_such_field": 1})
    assert "no_such_field" in e.value.message
    with pytest.raises(opjit.NotFound):
        client.register(str(tmp_path / "missing.json"))
    spec = {"name": "x", "implementations": [{"target": "CPU", "source_file": "nope.cc"}]}
    with pytest.raises(opjit.NotFound) as e:
        client.register(spec, base_dir=str(tmp_path))
    assert "nope.cc" in e.value.message
    with pytest.raises(opjit.InvalidArgument):
        client.register(42)


def test_unavailable_server(tmp_path):
    with opjit.Client("unix:" + str(tmp_path / "nobody.sock"), timeout=5) as c:
        with pytest.raises(opjit.Unavailable) as e:
            c.info()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_default_address(monkeypatch):
    monkeypatch.delenv("OPJIT_SERVER", raising=False)
    monkeypatch.setenv("OPJIT_STATE_DIR", "/srv/opjit")
    assert opjit.default_address() == "unix:/srv/opjit/opjitd.sock"
    monkeypatch.delenv("OPJIT_STATE_DIR")
    monkeypatch.setenv("HOME", "/home/u")
    assert opjit.default_address() == "unix:/home/u/.opjit/opjitd.sock"
    monkeypatch.setenv("OPJIT_SERVER", "/tmp/x.sock")
    assert opjit.default_address() == "unix:/tmp/x.sock"
    monkeypatch.setenv("OPJIT_SERVER", "gpu-box:7878")
    assert opjit.Client().address == "gpu-box:7878"
