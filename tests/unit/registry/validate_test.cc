#include "server/registry/validate.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>

#include "server/common/error_info.h"
#include "server/compiler/compile_options.h"
#include "tests/unit/registry/test_util.h"

namespace opjit::registry {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using testing::ValidDef;

// Applies `mutate` to a valid def and expects INVALID_ARGUMENT whose message
// starts with `field` and contains `what`.
void ExpectInvalid(const std::function<void(OpDef&)>& mutate, const std::string& field,
                   const std::string& what = "") {
  OpDef def = ValidDef();
  mutate(def);
  absl::Status s = ValidateOpDef(def);
  ASSERT_FALSE(s.ok()) << "expected an error at " << field;
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  auto reason = GetReason(s);
  ASSERT_TRUE(reason.has_value()) << s;
  EXPECT_EQ(reason->reason, "INVALID_SPEC");
  EXPECT_THAT(std::string(s.message()), StartsWith(field));
  EXPECT_THAT(std::string(s.message()), HasSubstr(what));
}

void ExpectValid(const std::function<void(OpDef&)>& mutate) {
  OpDef def = ValidDef();
  mutate(def);
  absl::Status s = ValidateOpDef(def);
  EXPECT_TRUE(s.ok()) << s;
}

Implementation GpuImpl() {
  Implementation impl;
  impl.target = Target::kGpu;
  impl.language = "cuda";
  impl.entry = "CustomLeakyReluGpu";
  impl.source = "extern \"C\" __global__ void k() {}";
  return impl;
}

TEST(ValidateTest, ValidDefPasses) {
  ExpectValid([](OpDef&) {});
}

TEST(ValidateTest, Names) {
  ExpectInvalid([](OpDef& d) { d.ns = ""; }, "ns", "[a-z0-9_-]{1,64}");
  ExpectInvalid([](OpDef& d) { d.ns = "Default"; }, "ns");
  ExpectInvalid([](OpDef& d) { d.ns = std::string(65, 'a'); }, "ns");
  ExpectValid([](OpDef& d) { d.ns = "team-a_2"; });
  ExpectInvalid([](OpDef& d) { d.name = ""; }, "name", "not a valid op name");
  ExpectInvalid([](OpDef& d) { d.name = "1abc"; }, "name");
  ExpectInvalid([](OpDef& d) { d.name = "a-b"; }, "name");
  ExpectInvalid([](OpDef& d) { d.name = std::string(129, 'a'); }, "name");
  ExpectValid([](OpDef& d) { d.name = "nn.Leaky_Relu2"; });
  ExpectValid([](OpDef& d) { d.name = std::string(128, 'a'); });
}

TEST(ValidateTest, InputsAndOutputs) {
  ExpectInvalid([](OpDef& d) { d.outputs.clear(); }, "outputs", "at least one output");
  ExpectInvalid([](OpDef& d) { d.inputs[0].index = 1; }, "inputs[0].index", "is 1, expected 0");
  ExpectInvalid(
      [](OpDef& d) {
        d.inputs.push_back({2, "z", ParamType::kRequired});
        for (auto& df : d.dtype_formats) df.io.insert(df.io.begin(), {"float32", "ND"});
      },
      "inputs[1].index");
  ExpectInvalid([](OpDef& d) { d.outputs[0].index = 3; }, "outputs[0].index");
  ExpectInvalid([](OpDef& d) { d.inputs[0].name = ""; }, "inputs[0].name", "must not be empty");
  ExpectInvalid([](OpDef& d) { d.inputs[0].name = "x y"; }, "inputs[0].name", "not an identifier");
  ExpectInvalid([](OpDef& d) { d.outputs[0].name = "x"; }, "outputs[0].name", "used twice");
  ExpectInvalid([](OpDef& d) { d.outputs[0].param_type = ParamType::kOptional; },
                "outputs[0].param_type", "cannot be optional");
  ExpectValid([](OpDef& d) { d.outputs[0].param_type = ParamType::kDynamic; });
  ExpectValid([](OpDef& d) { d.inputs[0].param_type = ParamType::kOptional; });
  ExpectValid([](OpDef& d) { d.inputs[0].param_type = ParamType::kDynamic; });
}

TEST(ValidateTest, Attrs) {
  ExpectInvalid([](OpDef& d) { d.attrs[0].name = ""; }, "attrs[0].name", "must not be empty");
  ExpectInvalid([](OpDef& d) { d.attrs[0].name = "a.b"; }, "attrs[0].name", "not an identifier");
  ExpectInvalid([](OpDef& d) { d.attrs.push_back(d.attrs[0]); }, "attrs[1].name", "used twice");
  ExpectInvalid([](OpDef& d) { d.attrs[0].param_type = ParamType::kDynamic; },
                "attrs[0].param_type", "required or optional");
  ExpectInvalid([](OpDef& d) { d.attrs[0].default_value = "abc"; }, "attrs[0].default_value",
                "not a valid float");
  ExpectInvalid(
      [](OpDef& d) {
        d.attrs.push_back({"axis", ParamType::kRequired, ValueType::kListInt, "[0, 1.5]"});
      },
      "attrs[1].default_value", "element [1] is a float");
  ExpectInvalid(
      [](OpDef& d) {
        d.attrs.push_back({"n", ParamType::kOptional, ValueType::kInt, "2.0"});
      },
      "attrs[1].default_value", "expected an int, got a float");
  // A required attr with a default is fine; an attr without one too.
  ExpectValid([](OpDef& d) { d.attrs[0].param_type = ParamType::kRequired; });
  ExpectValid([](OpDef& d) { d.attrs[0].default_value = ""; });
  ExpectValid([](OpDef& d) {
    d.attrs.push_back({"mode", ParamType::kOptional, ValueType::kStr, "relu"});
    d.attrs.push_back({"shape", ParamType::kOptional, ValueType::kListListInt, "[[1], [2, 3]]"});
  });
  // An attr may share a name with a tensor.
  ExpectValid([](OpDef& d) { d.attrs[0].name = "x"; });
}

TEST(ValidateTest, DtypeFormats) {
  ExpectInvalid([](OpDef& d) { d.dtype_formats.clear(); }, "dtype_formats", "at least one");
  ExpectInvalid(
      [](OpDef& d) {
        d.inputs.push_back({1, "b", ParamType::kRequired});
        d.dtype_formats = {
            {{{"float32", ""}, {"float32", ""}, {"float32", ""}}},
            {{{"float16", ""}, {"float16", ""}, {"float16", ""}}},
            {{{"float64", ""}, {"float64", ""}}},
        };
      },
      "dtype_formats[2]",
      "dtype_formats[2] has 2 (dtype, format) pairs, but the op has 2 inputs + 1 outputs = 3");
  ExpectInvalid([](OpDef& d) { d.dtype_formats[1].io[1].first = "float"; },
                "dtype_formats[1][1] (output y)",
                "unknown dtype \"float\"; known dtypes: float16, float32, float64, int8");
  ExpectInvalid([](OpDef& d) { d.dtype_formats[0].io[0].second = "NC1HWC0"; },
                "dtype_formats[0][0] (input x)", "unknown format \"NC1HWC0\"");
  ExpectInvalid([](OpDef& d) { d.dtype_formats.push_back(d.dtype_formats[0]); }, "dtype_formats[2]",
                "duplicates dtype_formats[0]");
  ExpectValid([](OpDef& d) {
    d.dtype_formats[0].io = {{"float32", ""}, {"float32", "ND"}};
    d.dtype_formats[1].io = {{"float16", "NCHW"}, {"float16", "NHWC"}};
    d.dtype_formats.push_back({{{"bool", "NCDHW"}, {"bool", "DefaultFormat"}}});
  });
}

// MindSpore's DataType.None_None: an empty dtype is any dtype at a required or
// dynamic input, an absent optional input, and at an output the output rule's
// dtype or else the call's first input's (issue 29).
TEST(ValidateTest, EmptyDtypes) {
  auto with_bias = [](OpDef& d) {
    d.inputs.push_back({1, "bias", ParamType::kOptional});
    d.dtype_formats = {
        {{{"float32", ""}, {"float32", ""}, {"float32", ""}}},
        {{{"float32", ""}, {"", ""}, {"float32", ""}}},
        {{{"float16", "DefaultFormat"}, {"", "DefaultFormat"}, {"float16", "DefaultFormat"}}},
    };
  };
  ExpectValid(with_bias);
  // Any dtype at a required input, and an output that takes the first input's.
  ExpectValid([&](OpDef& d) {
    with_bias(d);
    d.dtype_formats[1].io[0].first = "";
    d.dtype_formats[1].io[2].first = "";
  });
  // MindSpore's all-None row (add_cpu_info), and at a dynamic input.
  ExpectValid([](OpDef& d) { d.dtype_formats[0].io = {{"", ""}, {"", ""}}; });
  ExpectValid([](OpDef& d) {
    d.inputs[0].param_type = ParamType::kDynamic;
    d.dtype_formats[0].io[0].first = "";
  });
  // An output with no input to take a dtype from needs its rule's dtype.
  auto no_inputs = [](OpDef& d) {
    d.inputs.clear();
    d.dtype_formats = {{{{"", ""}}}};
  };
  ExpectInvalid(no_inputs, "dtype_formats[0][0] (output y)",
                "dtype_formats[0][0] (output y): an empty dtype (MindSpore's DataType.None_None) "
                "at an output means its output rule's dtype, else the dtype of the call's first "
                "input; the op has no inputs and no output rule dtype for output \"y\"; known "
                "dtypes: float16, float32, float64, int8, int16, int32, int64, uint8, uint16, "
                "uint32, uint64, bool");
  ExpectValid([&](OpDef& d) {
    no_inputs(d);
    OutputRule r;
    r.kind = OutputRule::Kind::kExplicit;
    r.shape = {2};
    r.dtype = "int32";
    d.output_rules = {r};
  });
  // Other bad rows keep their errors; an all-None row still counts for duplicates.
  ExpectInvalid([](OpDef& d) { d.dtype_formats[0].io[0].first = "complex64"; },
                "dtype_formats[0][0] (input x)", "unknown dtype \"complex64\"");
  ExpectInvalid(
      [&](OpDef& d) {
        with_bias(d);
        d.dtype_formats.push_back(d.dtype_formats[1]);
      },
      "dtype_formats[3]", "duplicates dtype_formats[1]");
  ExpectInvalid(
      [](OpDef& d) {
        d.dtype_formats[0].io = {{"", ""}, {"", ""}};
        d.dtype_formats[1].io = {{"", ""}, {"", ""}};
      },
      "dtype_formats[1]", "duplicates dtype_formats[0]");
  ExpectInvalid([](OpDef& d) { d.dtype_formats[0].io = {{"", ""}}; }, "dtype_formats[0]",
                "has 1 (dtype, format) pairs, but the op has 1 inputs + 1 outputs = 2");
}

// An attr-only registration is told how to merge it.
TEST(ValidateTest, AttrOnlyRegistrationIsToldToMerge) {
  ExpectInvalid(
      [](OpDef& d) {
        d.inputs.clear();
        d.outputs.clear();
        d.dtype_formats.clear();
      },
      "outputs",
      "outputs: an op needs at least one output; an attr-only registration (like MindSpore's "
      "attr-only reg_info) is merged with one that declares the op's inputs and outputs before "
      "it is registered: in Python, client.register([io_info, attr_info])");
}

TEST(ValidateTest, PlainLayoutFormatsAreLabels) {
  for (const char* f : {"NDHWC", "HWCN", "DHWCN", "ChannelLast", "NCDHW", "ND"}) {
    ExpectValid([f](OpDef& d) { d.dtype_formats[0].io[0].second = f; });
  }
  for (const char* f : {"NC1HWC0", "FRACTAL_Z", "FRACTAL_NZ", "C1HWNCoC0", "NDC1HWC0", "Default"}) {
    ExpectInvalid([f](OpDef& d) { d.dtype_formats[0].io[0].second = f; },
                  "dtype_formats[0][0] (input x)",
                  "; known formats: DefaultFormat, ND, NCHW, NHWC, NCDHW, NDHWC, HWCN, DHWCN, "
                  "ChannelLast (empty means DefaultFormat)");
  }
}

TEST(ValidateTest, AttrOfAnyKind) {
  ExpectValid([](OpDef& d) {
    d.attrs.push_back({"axis", ParamType::kRequired, ValueType::kAll, "1"});
    d.attrs.push_back({"paddings", ParamType::kRequired, ValueType::kAll, "[1.0, 2.0]"});
    d.attrs.push_back({"mode", ParamType::kOptional, ValueType::kAll, "relu"});
    d.attrs.push_back({"any", ParamType::kOptional, ValueType::kAll, ""});
  });
  ExpectInvalid(
      [](OpDef& d) { d.attrs.push_back({"p", ParamType::kRequired, ValueType::kAll, "[1, \"a\"]"}); },
      "attrs[1].default_value",
      "attrs[1].default_value: \"[1, \"a\"]\" is not a valid all (expected a value of any kind "
      "(bool, int, float, str or a list of one kind), got a list that mixes kinds \"[1, \"a\"]\")");
  // A reduce rule needs an int or listInt axis attr, not one of any kind.
  ExpectInvalid(
      [](OpDef& d) {
        d.attrs.push_back({"axis", ParamType::kRequired, ValueType::kAll, "1"});
        d.output_rules = {{.kind = OutputRule::Kind::kReduce, .input = 0, .axis_attr = "axis"}};
      },
      "output_rules[0].axis_attr", "is all; reduce axes need int or listInt");
}

TEST(ValidateTest, ImplementationsBasics) {
  ExpectInvalid([](OpDef& d) { d.implementations.clear(); }, "implementations", "at least one");
  ExpectInvalid([](OpDef& d) { d.implementations.push_back(d.implementations[0]); },
                "implementations[1].target", "CPU already has implementations[0]");
  ExpectInvalid([](OpDef& d) { d.implementations[0].language = "cpp"; },
                "implementations[0].language", "not a CPU language");
  ExpectInvalid([](OpDef& d) { d.implementations[0].language = "cuda"; },
                "implementations[0].language");
  ExpectInvalid(
      [](OpDef& d) {
        Implementation g = GpuImpl();
        g.language = "c++";
        d.implementations.push_back(g);
      },
      "implementations[1].language", "not a GPU language");
  ExpectInvalid([](OpDef& d) { d.implementations[0].entry = "my-kernel"; },
                "implementations[0].entry", "not a C identifier");
  ExpectInvalid([](OpDef& d) { d.implementations[0].entry = ""; }, "implementations[0].entry");
  ExpectInvalid([](OpDef& d) { d.implementations[0].source = ""; }, "implementations[0].source",
                "must not be empty");
  ExpectInvalid(
      [](OpDef& d) { d.implementations[0].source = std::string(kMaxSourceBytes + 1, 'x'); },
      "implementations[0].source", "limit is 1048576");
  ExpectValid([](OpDef& d) { d.implementations[0].source = std::string(kMaxSourceBytes, ' '); });
  ExpectInvalid([](OpDef& d) { d.implementations[0].source = "int x; // \xff\xfe"; },
                "implementations[0].source", "not valid UTF-8");
  ExpectInvalid(
      [](OpDef& d) {
        d.implementations[0].libraries = {"libm.so", ""};
      },
      "implementations[0].libraries[1]", "must not be empty");
  ExpectValid([](OpDef& d) {
    d.implementations[0].language = "c";
    d.implementations.push_back(GpuImpl());
  });
}

// The floating-point mode Verify reports, as the clang driver and NVRTC
// read the options: the last word wins.
TEST(ValidateTest, FpModeOfCompileOptions) {
  using compiler::CpuFpMode;
  using compiler::CudaFpMode;
  EXPECT_EQ(CpuFpMode({}), "fp-contract=on, no fast-math");
  EXPECT_EQ(CpuFpMode({"-O2", "-ffp-contract=off"}), "fp-contract=off, no fast-math");
  EXPECT_EQ(CpuFpMode({"-ffast-math"}), "fp-contract=fast, fast-math");
  EXPECT_EQ(CpuFpMode({"-ffast-math", "-ffp-contract=off"}), "fp-contract=off, fast-math");
  EXPECT_EQ(CpuFpMode({"-ffast-math", "-fno-fast-math"}), "fp-contract=on, no fast-math");
  EXPECT_EQ(CudaFpMode({}), "fmad=true, no fast-math");
  EXPECT_EQ(CudaFpMode({"--fmad=false"}), "fmad=false, no fast-math");
  EXPECT_EQ(CudaFpMode({"--use_fast_math"}), "fmad=true, use_fast_math");
  EXPECT_EQ(CudaFpMode({"--use_fast_math", "--fmad=false"}), "fmad=false, use_fast_math");
}

TEST(ValidateTest, CpuCompileOptions) {
  for (const char* ok :
       {"-DN=4", "-DDEBUG", "-DNAME=a b", "-UNDEBUG", "-O0", "-O3", "-ffast-math", "-fno-fast-math",
        "-ffp-contract=off", "-ffp-contract=on", "-ffp-contract=fast", "-std=c++17", "-std=c++20", "-Wall", "-Wno-unused-variable", "-Werror=return-type", "-w"}) {
    ExpectValid([&](OpDef& d) { d.implementations[0].compile_options = {ok}; });
  }
  for (const char* bad : {"-fopenmp",
                          "-I/etc",
                          "-L/tmp",
                          "-lssl",
                          "-o/tmp/x",
                          "-include/etc/passwd",
                          "-Xclang",
                          "-fplugin=x.so",
                          "-Wl,-rpath,/tmp",
                          "-Wa,x",
                          "-Wp,-MD,/tmp/x",
                          "-O4",
                          "-Os",
                          "-D",
                          "-D1X",
                          "-DX=\n",
                          "-UX=1",
                          "-std=gnu++17",
                          "-std=c11",
                          "--sysroot=/",
                          "-march=native",
                          "-ffp-contract=fast-honor-pragmas",
                          "-ffp-contract=",
                          "-DX"
                          "\x01"}) {
    ExpectInvalid(
        [&](OpDef& d) {
          d.implementations[0].compile_options = {"-O2", bad};
        },
        "implementations[0].compile_options[1]", "is refused");
  }
  // The message names the option.
  ExpectInvalid([](OpDef& d) { d.implementations[0].compile_options = {"-fopenmp"}; },
                "implementations[0].compile_options[0]", "option \"-fopenmp\" is refused");
  // -std must fit the language.
  ExpectValid([](OpDef& d) {
    d.implementations[0].language = "c";
    d.implementations[0].compile_options = {"-std=c11", "-std=c17"};
  });
  ExpectInvalid(
      [](OpDef& d) {
        d.implementations[0].language = "c";
        d.implementations[0].compile_options = {"-std=c++17"};
      },
      "implementations[0].compile_options[0]", "allowed for c: -std=c11, -std=c17");
}

TEST(ValidateTest, CudaCompileOptions) {
  for (const char* ok : {"--use_fast_math",
                         "-use_fast_math",
                         "-arch=sm_90",
                         "-arch=sm_90a",
                         "-arch=compute_80",
                         "--gpu-architecture=sm_120",
                         "-std=c++17",
                         "--std=c++20",
                         "-DBLOCK=256",
                         "-UX",
                         "--ftz=true",
                         "--prec-div=false",
                         "--prec-sqrt=true",
                         "--fmad=false",
                         "-lineinfo",
                         "--generate-line-info",
                         "--maxrregcount=64",
                         "-maxrregcount=32",
                         "--extra-device-vectorization",
                         "--restrict",
                         "-w",
                         "--disable-warnings"}) {
    ExpectValid([&](OpDef& d) {
      Implementation g = GpuImpl();
      g.compile_options = {ok};
      d.implementations.push_back(g);
    });
  }
  for (const char* bad :
       {"-O3", "-ffast-math", "-Wall", "-arch=native", "-arch=sm_x", "--ftz=yes",
        "--maxrregcount=0", "-I/usr/include", "-G", "--include-path=/etc", "-fopenmp"}) {
    ExpectInvalid(
        [&](OpDef& d) {
          Implementation g = GpuImpl();
          g.compile_options = {bad};
          d.implementations.push_back(g);
        },
        "implementations[1].compile_options[0]", "is refused");
  }
}

TEST(ValidateTest, ImplementationAttrNames) {
  ExpectValid([](OpDef& d) { d.implementations[0].attr_names = {"alpha"}; });
  ExpectInvalid(
      [](OpDef& d) {
        d.implementations[0].attr_names = {"alpha", "beta"};
      },
      "implementations[0].attr_names",
      "the CPU implementation reads attr \"beta\", which the op does not declare");
  ExpectInvalid(
      [](OpDef& d) {
        d.implementations[0].attr_names = {"alpha", "alpha"};
      },
      "implementations[0].attr_names[1]", "listed twice");
  ExpectInvalid(
      [](OpDef& d) {
        d.attrs.push_back({"beta", ParamType::kOptional, ValueType::kInt, "1"});
        d.implementations[0].attr_names = {"alpha", "beta"};
        Implementation g = GpuImpl();
        g.attr_names = {"beta"};
        d.implementations.push_back(g);
      },
      "implementations[1].attr_names",
      "the GPU implementation does not read attr \"alpha\", which the op declares");
}

TEST(ValidateTest, OutputRules) {
  ExpectInvalid(
      [](OpDef& d) {
        d.inputs.clear();
        for (auto& df : d.dtype_formats) df.io.erase(df.io.begin());
      },
      "output_rules", "the op has no inputs");
  ExpectValid([](OpDef& d) {
    d.inputs.clear();
    d.dtype_formats = {{{{"float32", ""}}}};
    d.output_rules = {{.kind = OutputRule::Kind::kExplicit, .shape = {2, 0}, .dtype = "float32"}};
  });
  ExpectInvalid(
      [](OpDef& d) {
        d.output_rules = {{}, {}};
      },
      "output_rules", "has 2 rules, but the op has 1 outputs");
  ExpectInvalid([](OpDef& d) { d.output_rules = {{.input = 1}}; }, "output_rules[0].input",
                "input 1 is out of range; the op has 1 inputs");
  ExpectInvalid(
      [](OpDef& d) {
        d.output_rules = {{.kind = OutputRule::Kind::kBroadcast, .inputs = {0, 5}}};
      },
      "output_rules[0].inputs[1]", "out of range");
  ExpectValid([](OpDef& d) { d.output_rules = {{.kind = OutputRule::Kind::kBroadcast}}; });
  ExpectInvalid(
      [](OpDef& d) { d.output_rules = {{.kind = OutputRule::Kind::kReduce, .axis_attr = "axis"}}; },
      "output_rules[0].axis_attr", "\"axis\" is not an attr of the op");
  ExpectInvalid(
      [](OpDef& d) {
        d.output_rules = {{.kind = OutputRule::Kind::kReduce, .axis_attr = "alpha"}};
      },
      "output_rules[0].axis_attr", "attr \"alpha\" is float; reduce axes need int or listInt");
  auto reduce = [](OpDef& d) {
    d.attrs.push_back({"axis", ParamType::kRequired, ValueType::kListInt, "[0]"});
    d.attrs.push_back({"keep", ParamType::kOptional, ValueType::kBool, "false"});
    d.output_rules = {
        {.kind = OutputRule::Kind::kReduce, .axis_attr = "axis", .keep_dim_attr = "keep"}};
  };
  ExpectValid(reduce);
  ExpectInvalid(
      [&](OpDef& d) {
        reduce(d);
        d.output_rules[0].keep_dim_attr = "alpha";
      },
      "output_rules[0].keep_dim_attr", "attr \"alpha\" is float; expected bool");
  ExpectInvalid(
      [&](OpDef& d) {
        reduce(d);
        d.output_rules[0].keep_dim_attr = "nope";
      },
      "output_rules[0].keep_dim_attr", "not an attr");
  ExpectInvalid(
      [](OpDef& d) {
        d.output_rules = {{.kind = OutputRule::Kind::kExplicit, .shape = {2}, .dtype = ""}};
      },
      "output_rules[0].dtype", "an explicit rule needs a dtype");
  ExpectInvalid(
      [](OpDef& d) {
        d.output_rules = {{.kind = OutputRule::Kind::kExplicit, .shape = {2}, .dtype = "f32"}};
      },
      "output_rules[0].dtype", "unknown dtype \"f32\"");
  ExpectInvalid(
      [](OpDef& d) {
        d.output_rules = {
            {.kind = OutputRule::Kind::kExplicit, .shape = {2, -1}, .dtype = "float32"}};
      },
      "output_rules[0].shape[1]", "is -1; explicit dims must be >= 0");
  ExpectInvalid([](OpDef& d) { d.output_rules = {{.dtype = "complex64"}}; },
                "output_rules[0].dtype", "unknown dtype \"complex64\"");
  ExpectValid([](OpDef& d) { d.output_rules = {{.dtype = "int32"}}; });
  ExpectValid([](OpDef& d) { d.output_rules = {{.kind = OutputRule::Kind::kInferShape}}; });
}

TEST(ValidateTest, Backward) {
  ExpectValid([](OpDef& d) {
    d.backward.op = "leaky_relu_grad";
    d.backward.save_for_backward = {"x", "y"};
    d.backward.non_differentiable = {"y"};
  });
  ExpectInvalid([](OpDef& d) { d.backward.op = "bad name"; }, "backward.op", "not a valid op name");
  ExpectInvalid([](OpDef& d) { d.backward.op = d.name; }, "backward.op", "its own backward");
  ExpectInvalid(
      [](OpDef& d) {
        d.backward.save_for_backward = {"x", "alpha"};
      },
      "backward.save_for_backward[1]", "\"alpha\" is not an input or output");
  ExpectInvalid(
      [](OpDef& d) {
        d.backward.save_for_backward = {"x", "x"};
      },
      "backward.save_for_backward[1]", "listed twice");
  ExpectInvalid([](OpDef& d) { d.backward.non_differentiable = {"x"}; },
                "backward.non_differentiable[0]", "\"x\" is not an output");
  ExpectInvalid(
      [](OpDef& d) {
        d.backward.non_differentiable = {"y", "y"};
      },
      "backward.non_differentiable[1]", "listed twice");
}

TEST(ValidateTest, Doc) {
  ExpectValid([](OpDef& d) { d.doc = std::string(kMaxDocBytes, 'd'); });
  ExpectInvalid([](OpDef& d) { d.doc = std::string(kMaxDocBytes + 1, 'd'); }, "doc",
                "limit is 65536");
  ExpectInvalid([](OpDef& d) { d.doc = "\xc3"; }, "doc", "not valid UTF-8");
  ExpectValid([](OpDef& d) { d.doc = "ünïcødé ✓ 𝔸"; });
}

}  // namespace
}  // namespace opjit::registry
