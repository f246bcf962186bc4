"""CustomRegOp parity with MindSpore (issue 16): what MindSpore's builder accepts, opjit
accepts or refuses on the client with the server's own message; and a dangling
backward.op is a warning, not an error."""

import contextlib
import warnings

import numpy as np
import pytest

import opjit
from opjit.client import OpjitWarning
from opjit.regop import CustomRegOp, DataType
from conftest import EXAMPLES

F32 = DataType.F32_Default
NOP = ('#include <cstdint>\nextern "C" int K(int n, void** p, int* nd, int64_t** s, '
       'const char** d, void* st, void* e) { return 0; }\n')


def scale_bias(name, **attr_kwargs):
    """scale_bias.cc (y = scale * x [+ b]) with an optional bias input."""
    attr = dict(name="scale", param_type="optional", value_type="float")
    attr.update(attr_kwargs)
    return (CustomRegOp(name).input(0, "x").input(1, "b", "optional").output(0, "y")
            .attr(**attr).target("CPU").impl(source_file="scale_bias.cc", entry="ScaleBias"))


def server_message(client, info):
    """What the server says about `info` (a dict the builder would have refused)."""
    with pytest.raises(opjit.InvalidArgument) as e:
        client.register(info, base_dir=EXAMPLES)
    assert e.value.reason == "INVALID_SPEC", e.value
    return e.value.message


@contextlib.contextmanager
def unchecked():
    """get_op_info() without the builder's local checks: what would reach the server."""
    real = CustomRegOp._check
    CustomRegOp._check = lambda self, inputs, outputs: None
    try:
        yield
    finally:
        CustomRegOp._check = real


# --- attr(..., value=...) ---------------------------------------------------------------

def test_attr_value_kwarg_is_the_attr_default(client):
    b = scale_bias("ms_value_kwarg", value=3.0).dtype_format(F32, F32, F32)
    info = b.get_op_info()
    assert info["attrs"] == [{"name": "scale", "param_type": "optional", "value_type": "float",
                              "default_value": "3.0"}]
    client.register(b, base_dir=EXAMPLES)
    assert client.describe("ms_value_kwarg").op.attrs[0].default_value == "3.0"
    op = client.op("ms_value_kwarg")
    x = np.array([1.0, -2.0], np.float32)
    np.testing.assert_allclose(op(x), [3.0, -6.0])          # the value= is used
    np.testing.assert_allclose(op(x, scale=0.5), [0.5, -1.0])  # a call may still pass one


def test_attr_value_and_default_value():
    # The same value both ways is fine; different ones are refused, not silently picked.
    b = CustomRegOp("a").attr("n", "required", "int", "2", value=2)
    assert b._attrs[0]["default_value"] == "2"
    with pytest.raises(opjit.InvalidArgument, match="value=3 and default_value='2' disagree"):
        CustomRegOp("a").attr("n", "required", "int", "2", value=3)
    # value= of every kind becomes the registry's text form.
    b = (CustomRegOp("a").attr("flag", "required", "bool", value=True)
         .attr("axes", "required", "listInt", value=(1, 2))
         .attr("pads", "required", "listListInt", value=[[1, 1], [2, 2]])
         .attr("mode", "optional", "str", value="relu")
         .attr("k", "required", "int", value=np.int64(4)))
    assert [a["default_value"] for a in b._attrs] == ["true", "[1, 2]", "[[1, 1], [2, 2]]",
                                                      "relu", "4"]
    # value=None is no value (MindSpore drops None keys too).
    assert "default_value" not in CustomRegOp("a").attr("n", "required", "int",
                                                        value=None)._attrs[0]


def test_other_attr_kwargs_warn_instead_of_vanishing():
    with pytest.warns(UserWarning, match=r"attr\(n\): opjit does not use foo=1"):
        CustomRegOp("a").attr("n", "required", "int", foo=1)
    with pytest.warns(UserWarning, match=r"input\(x\): opjit does not use shape='all'"):
        CustomRegOp("a").input(0, "x", shape="all")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CustomRegOp("a").attr("n", "required", "int", value=1)  # value= is used: no warning


def test_mindspore_list_default_form():
    b = (CustomRegOp("a").attr("axes", "optional", "listInt", "1,2,3")
         .attr("w", "optional", "listFloat", "0.5, 1")
         .attr("on", "optional", "listBool", "True,false")
         .attr("names", "optional", "listStr", "a, b")
         .attr("json", "optional", "listInt", "[4, 5]"))
    assert [a["default_value"] for a in b._attrs] == [
        "[1, 2, 3]", "[0.5, 1]", "[true, false]", '["a", "b"]', "[4, 5]"]


# --- value_type "all" -------------------------------------------------------------------

def test_value_type_all_is_accepted(client):
    # MindSpore's aot examples: .attr("axis", "required", "all", value=axis)
    b = scale_bias("ms_value_all", param_type="required", value_type="all",
                   value=3.0).dtype_format(F32, F32, F32)
    r = client.register(b, base_dir=EXAMPLES)
    a = r.record.op.attrs[0]
    assert (a.value_type, a.default_value) == ("all", "3.0")
    op = client.op("ms_value_all")
    x = np.array([1.0, 2.0], np.float32)
    np.testing.assert_allclose(op(x), [3.0, 6.0])
    np.testing.assert_allclose(op(x, scale=0.5), [0.5, 1.0])
    np.testing.assert_allclose(op(x, scale=2), [2.0, 4.0])  # an int: the kernel reads a float
    # A kind the kernel cannot read is the kernel's error, named.
    with pytest.raises(opjit.OpjitError, match="kernel read attr 'scale' as float but it is str"):
        op(x, scale="big")


def test_value_type_all_kinds(client):
    b = CustomRegOp("a")
    for name, value, text in (("i", 1, "1"), ("f", 1.5, "1.5"), ("t", True, "true"),
                              ("s", "relu", "relu"), ("l", [1.0, 2.0], "[1.0, 2.0]"),
                              ("ll", [[1, 1], [2, 2]], "[[1, 1], [2, 2]]")):
        b.attr(name, "required", "all", value=value)
        assert b._attrs[-1]["default_value"] == text
    # A str whose text reads as another kind cannot be an "all" value.
    with pytest.raises(opjit.InvalidArgument, match='reads as an int; declare value_type "str"'):
        CustomRegOp("a").attr("s", "required", "all", value="3")
    # A list mixing kinds: refused here with the server's message.
    with pytest.raises(opjit.InvalidArgument) as local:
        CustomRegOp("a").attr("p", "required", "all", value=[1, "a"])
    info = scale_bias("ms_all_mixed").dtype_format(F32, F32, F32).get_op_info()
    info["attrs"].append({"name": "p", "param_type": "required", "value_type": "all",
                          "default_value": '[1, "a"]'})
    msg = server_message(client, info)
    assert local.value.message == msg.replace("attrs[1]", "attrs[0]")
    assert "got a list that mixes kinds" in msg


def test_unknown_value_type_message_is_the_servers(client):
    with pytest.raises(opjit.InvalidArgument) as local:
        CustomRegOp("a").attr("n", "required", "double")
    info = scale_bias("ms_bad_vt").dtype_format(F32, F32, F32).get_op_info()
    info["attrs"][0]["value_type"] = "double"
    assert server_message(client, info) == local.value.message
    assert local.value.message.endswith("listListInt, listListFloat or all)")


# --- DataType, dtype_format ----------------------------------------------------------------

def test_every_mindspore_datatype_constant_exists():
    for name, pair in (("None_None", ("", "")), ("None_Default", ("", "DefaultFormat")),
                       ("F32_Default", ("float32", "DefaultFormat")), ("F16_None", ("float16", "")),
                       ("F32_5HD", ("float32", "NC1HWC0")), ("I8_NC1HWC0", ("int8", "NC1HWC0")),
                       ("F16_FracZ", ("float16", "FRACTAL_Z")),
                       ("F16_FracNZ", ("float16", "FRACTAL_NZ")),
                       ("U8_C1HWNCoC0", ("uint8", "C1HWNCoC0")), ("I64_HWCN", ("int64", "HWCN")),
                       ("BOOL_NDHWC", ("bool", "NDHWC")), ("F32_NCDHW", ("float32", "NCDHW")),
                       ("F32_DHWCN", ("float32", "DHWCN")),
                       ("F16_NDC1HWC0", ("float16", "NDC1HWC0")),
                       ("F32_FRACTAL_Z_3D", ("float32", "FRACTAL_Z_3D")),
                       ("F32_FracZNLSTM", ("float32", "FRACTAL_ZN_LSTM")),
                       ("F16_FracZNRNN", ("float16", "FRACTAL_ZN_RNN")),
                       ("F32_ND_RNNBIAS", ("float32", "ND_RNN_BIAS")),
                       ("U64_ChannelLast", ("uint64", "ChannelLast")),
                       ("C64_Default", ("complex64", "DefaultFormat")),
                       ("C128_Default", ("complex128", "DefaultFormat"))):
        assert getattr(DataType, name) == pair, name


def test_plain_layouts_register(client):
    b = (CustomRegOp("ms_layouts").input(0, "x").input(1, "b", "optional").output(0, "y")
         .dtype_format(DataType.F32_NDHWC, DataType.F32_HWCN, DataType.F32_ChannelLast)
         .target("CPU").impl(source_file="scale_bias.cc", entry="ScaleBias")
         .attr("scale", "optional", "float", "1.0"))
    r = client.register(b, base_dir=EXAMPLES)
    assert list(r.record.op.dtype_formats[0].formats) == ["NDHWC", "HWCN", "ChannelLast"]


@pytest.mark.parametrize("pair", [DataType.F32_5HD, DataType.F16_FracZ, DataType.C64_Default,
                                  DataType.BF16_Default])
def test_unserved_datatype_is_refused_locally_with_the_servers_message(client, pair):
    b = (CustomRegOp("ms_unserved").input(0, "x").input(1, "b", "optional")
         .output(0, "y").attr("scale", "optional", "float", "1.0")
         .dtype_format(F32, F32, F32).dtype_format(pair, F32, F32)
         .target("CPU").impl(source_file="scale_bias.cc", entry="ScaleBias"))
    with unchecked():
        msg = server_message(client, b.get_op_info())
    assert msg.startswith("dtype_formats[1][0] (input x): ")
    with pytest.raises(opjit.InvalidArgument) as local:
        b.get_op_info()
    assert local.value.message == msg


def test_none_none_marks_an_absent_optional_input(client):
    """MindSpore's DataType.None_None at an optional input: the row applies when it is absent."""
    b = (scale_bias("ms_none_none", value=2.0)
         .dtype_format(F32, DataType.None_None, F32))
    info = b.get_op_info()
    assert info["dtype_formats"] == [{"dtypes": ["float32", "", "float32"],
                                      "formats": ["DefaultFormat", "DefaultFormat",
                                                  "DefaultFormat"]}]
    r = client.register(b, base_dir=EXAMPLES)
    assert list(r.record.op.dtype_formats[0].dtypes) == ["float32", "", "float32"]
    op = client.op("ms_none_none")
    x = np.array([1.0, 2.0], np.float32)
    np.testing.assert_allclose(op(x), [2.0, 4.0])
    # The only combination says b is absent: a float32 b matches none.
    with pytest.raises(opjit.InvalidArgument, match="does not accept input dtypes"):
        op(x, np.ones(2, np.float32))
    # With a row for a present b as well, both calls work.
    b.dtype_format(F32, F32, F32)
    client.register(b, base_dir=EXAMPLES)
    op = client.op("ms_none_none")
    np.testing.assert_allclose(op(x), [2.0, 4.0])
    np.testing.assert_allclose(op(x, np.ones(2, np.float32)), [3.0, 5.0])


def test_none_none_elsewhere_means_any_dtype(client):
    # MindSpore's aot examples use all-None rows ("any dtype"; the kernel checks):
    # accepted (issue 29; tests/python/test_mindspore_registrations.py runs them).
    b = (CustomRegOp("ms_all_none").input(0, "x1").input(1, "x2").output(0, "y")
         .dtype_format(DataType.None_None, DataType.None_None, DataType.None_None)
         .target("CPU").impl(source=NOP, entry="K"))
    r = client.register(b)
    assert list(r.record.op.dtype_formats[0].dtypes) == ["", "", ""]
    # An output with no input to take its dtype from is refused, here and by the server alike.
    b = (CustomRegOp("ms_none_out").output(0, "y").dtype_format(DataType.None_None)
         .target("CPU").impl(source=NOP, entry="K"))
    with unchecked():
        msg = server_message(client, b.get_op_info())
    assert msg == ('dtype_formats[0][0] (output y): an empty dtype (MindSpore\'s '
                   'DataType.None_None) at an output means its output rule\'s dtype, else the '
                   'dtype of the call\'s first input; the op has no inputs and no output rule '
                   'dtype for output "y"; known dtypes: float16, float32, float64, int8, int16, '
                   'int32, int64, uint8, uint16, uint32, uint64, bool')
    with pytest.raises(opjit.InvalidArgument) as local:
        b.get_op_info()
    assert local.value.message == msg
    # With the rule's dtype it registers.
    b.output_rule("explicit", shape=[2], dtype="int32")
    assert client.register(b).record.op.output_rules[0].dtype == "int32"


def test_dtype_format_arity_and_index_messages_are_the_servers(client):
    # MindSpore's own aot example declares .input(0, "x1").input(0, "x2"): MindSpore takes
    # inputs in declaration order (the k-th declared input reads column k of each
    # dtype_format row), and so does the builder (issue 40): x1 and x2, indexed 0 and 1.
    dup = (CustomRegOp("ms_dup_index").input(0, "x1").input(0, "x2").output(0, "y")
           .dtype_format(F32, F32, F32).target("CPU").impl(source=NOP, entry="K"))
    info = dup.get_op_info()
    assert [(p["index"], p["name"]) for p in info["inputs"]] == [(0, "x1"), (1, "x2")]
    assert client.register(dup).record.op.inputs[1].name == "x2"
    # The server stays strict: a hand-written spec indexes them 0..n-1 in order.
    info["inputs"][1]["index"] = 0
    info["name"] = "ms_dup_index_raw"
    short = (CustomRegOp("ms_short_row").input(0, "x").output(0, "y").dtype_format(F32)
             .target("CPU").impl(source=NOP, entry="K"))
    with unchecked():
        msgs = [server_message(client, i) for i in (info, short.get_op_info())]
    assert msgs[0] == "inputs[1].index: is 0, expected 1 (inputs are indexed 0..n-1 in order)"
    assert msgs[1] == ("dtype_formats[0] has 1 (dtype, format) pairs, but the op has 1 inputs + "
                       "1 outputs = 2")
    with pytest.raises(opjit.InvalidArgument) as local:
        short.get_op_info()
    assert local.value.message == msgs[1]


# --- names, targets, params -----------------------------------------------------------------

def test_unnamed_custom_regop_takes_a_name_when_registered(client):
    # "Custom" is MindSpore's placeholder: an unnamed op is named at registration, after
    # its implementation's entry or register(..., name=) (issue 29); with neither, refused.
    for b in (CustomRegOp(), CustomRegOp(op_name="Custom")):
        b.input(0, "x").output(0, "y").dtype_format(F32, F32)
        assert "name" not in b.get_op_info()
        with pytest.raises(opjit.InvalidArgument, match="CustomRegOp: the op has no name"):
            client.register(b)
    with pytest.raises(opjit.NotFound):
        client.describe("Custom")
    assert CustomRegOp("team/my_op").get_op_info() == {"name": "my_op", "namespace": "team"}


def test_target_and_param_type_messages_are_the_servers(client):
    with pytest.raises(opjit.InvalidArgument) as local:
        CustomRegOp("a").target("Ascend")
    info = scale_bias("ms_ascend").dtype_format(F32, F32, F32).get_op_info()
    info["implementations"][0]["target"] = "Ascend"
    assert server_message(client, info) == local.value.message
    assert CustomRegOp("a").target(None).impl(source="s", entry="K")._impls[0]["target"] == "CPU"
    assert CustomRegOp("a").target("gpu")._target == "GPU"

    with pytest.raises(opjit.InvalidArgument) as local:
        CustomRegOp("a").input(0, "x", "sometimes")
    info = scale_bias("ms_param").dtype_format(F32, F32, F32).get_op_info()
    info["inputs"][0]["param_type"] = "sometimes"
    assert server_message(client, info) == local.value.message

    with pytest.raises(opjit.InvalidArgument) as local:
        CustomRegOp("a").input(0, "x").output(0, "y", "optional")
    info = scale_bias("ms_opt_out").dtype_format(F32, F32, F32).get_op_info()
    info["outputs"][0]["param_type"] = "optional"
    assert server_message(client, info) == local.value.message

    with pytest.raises(opjit.InvalidArgument) as local:
        CustomRegOp("a").attr("n", "dynamic", "int")
    info = scale_bias("ms_dyn_attr").dtype_format(F32, F32, F32).get_op_info()
    info["attrs"][0]["param_type"] = "dynamic"
    assert server_message(client, info) == local.value.message

    # MindSpore's param_type None means required.
    assert CustomRegOp("a").input(0, "x", None)._inputs[0]["param_type"] == "required"


# --- a dangling backward.op ------------------------------------------------------------------

def test_dangling_backward_op_is_a_warning_until_it_is_registered(client):
    # Output rules given: registering without one is a warning of its own (issue 29).
    fwd = (scale_bias("ms_fwd", value=2.0).dtype_format(F32, F32, F32).output_rule()
           .bprop("ms_fwd_grad"))
    want = ('backward.op: "ms_fwd_grad" is not a registered op in namespace "default"; the op '
            'is registered, but its backward fails until "ms_fwd_grad" is registered')
    with pytest.warns(OpjitWarning) as caught:
        r = client.register(fwd, base_dir=EXAMPLES)
    assert r.created
    assert list(r.warnings) == [want]
    assert list(r.record.warnings) == [want]
    assert [str(w.message) for w in caught] == ["register default/ms_fwd: " + want]
    assert list(client.describe("ms_fwd").warnings) == [want]
    listed = [o for o in client.ops() if o.op.name == "ms_fwd"]
    assert [list(o.warnings) for o in listed] == [[want]]
    # Registering the backward op clears it (nothing stored: it is computed when served).
    grad = (CustomRegOp("ms_fwd_grad").input(0, "x").input(1, "b", "optional")
            .input(2, "y").input(3, "dy").output(0, "dx").output(1, "db")
            .output_rule().output_rule(input=1)
            .dtype_format(F32, F32, F32, F32, F32, F32).target("CPU")
            .impl(source=NOP, entry="K"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = client.register(grad)
        again = client.register(fwd, base_dir=EXAMPLES)
    assert list(g.warnings) == []
    assert not again.created and list(again.warnings) == []
    assert list(client.describe("ms_fwd").warnings) == []
