// Tests of opjit::runner::AotKernelInstance: MindSpore-aot kernels called on
// host buffers through the loader.
#include "server/runner/aot_kernel.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "tests/unit/loader/test_kernels.h"

namespace opjit::runner {
namespace {

using ::opjit::testing::CompileKernel;
using registry::AttrValue;
using ::testing::HasSubstr;

// Several aot entries in one object, as a kernel author would write them.
constexpr char kAotKernels[] = R"(
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>
#include "custom_aot_extra.h"

extern "C" { int g_init_calls = 0; int g_data_live = 0; }

static int64_t Count(int ndim, const int64_t* shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

// --- leaky relu: attr read in Init, kept in KernelData ---
struct LeakyData : public AotKernelData {
  explicit LeakyData(float a) : alpha(a) { ++g_data_live; }
  ~LeakyData() override { --g_data_live; }
  float alpha;
};

extern "C" int CustomLeakyReluInit(int* ndims, int64_t** shapes, const char** dtypes,
                                   AotExtra* extra) {
  ++g_init_calls;
  if (std::strcmp(dtypes[0], "float32") != 0) return 3;
  extra->SetKernelData(new LeakyData(extra->Attr<float>("alpha")));
  return 0;
}

extern "C" int CustomLeakyRelu(int nparam, void** params, int* ndims, int64_t** shapes,
                               const char** dtypes, void* stream, void* extra) {
  if (nparam != 2 || stream != nullptr) return 2;
  auto* data = static_cast<LeakyData*>(static_cast<AotExtra*>(extra)->KernelData());
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0, n = Count(ndims[0], shapes[0]); i < n; ++i)
    y[i] = x[i] > 0 ? x[i] : data->alpha * x[i];
  return 0;
}

// --- libm through the aot ABI ---
extern "C" int CustomSwish(int nparam, void** params, int* ndims, int64_t** shapes,
                           const char** dtypes, void* stream, void* extra) {
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0, n = Count(ndims[0], shapes[0]); i < n; ++i)
    y[i] = tanhf(x[i]) + expf(x[i]);
  return 0;
}

// --- InferShape: sum over attr `axis` ---
extern "C" std::vector<int64_t> CustomReduceSumInferShape(int* ndims, int64_t** shapes,
                                                          AotExtra* extra) {
  int64_t axis = extra->Attr<int64_t>("axis");
  std::vector<int64_t> out;
  for (int i = 0; i < ndims[0]; ++i)
    if (i != axis) out.push_back(shapes[0][i]);
  return out;
}
extern "C" int CustomReduceSumInit(int* ndims, int64_t** shapes, const char** dtypes,
                                   AotExtra* extra) {
  ++g_init_calls;
  return ndims[1] == ndims[0] - 1 ? 0 : 5;  // sees the output
}
extern "C" int CustomReduceSum(int nparam, void** params, int* ndims, int64_t** shapes,
                               const char** dtypes, void* stream, void* extra) {
  // 2-D, axis 1.
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t r = 0; r < shapes[0][0]; ++r) {
    y[r] = 0;
    for (int64_t c = 0; c < shapes[0][1]; ++c) y[r] += x[r * shapes[0][1] + c];
  }
  return 0;
}

// --- every attr type; writes what it read into a float64 output ---
extern "C" int CustomAttrs(int nparam, void** params, int* ndims, int64_t** shapes,
                           const char** dtypes, void* stream, void* extra_ptr) {
  auto* extra = static_cast<AotExtra*>(extra_ptr);
  double* out = static_cast<double*>(params[0]);
  out[0] = extra->Attr<bool>("b") ? 1 : 0;
  out[1] = static_cast<double>(extra->Attr<int64_t>("i"));
  out[2] = extra->Attr<float>("f");
  out[3] = extra->Attr<std::string>("s") == "relu" ? 1 : 0;
  double sum = 0;
  for (int64_t v : extra->Attr<std::vector<int64_t>>("li")) sum += v;
  out[4] = sum;
  sum = 0;
  for (float v : extra->Attr<std::vector<float>>("lf")) sum += v;
  out[5] = sum;
  auto lli = extra->Attr<std::vector<std::vector<int64_t>>>("lli");
  out[6] = lli.size() == 2 && lli[1].size() == 3 ? static_cast<double>(lli[1][2]) : -1;
  auto llf = extra->Attr<std::vector<std::vector<float>>>("llf");
  out[7] = llf.size() == 1 && llf[0].size() == 2 ? llf[0][1] : -1;
  out[8] = extra->HasAttr("b") && !extra->HasAttr("nope") ? 1 : 0;
  auto lb = extra->Attr<std::vector<bool>>("lb");
  out[9] = lb.size() == 2 && !lb[0] && lb[1] ? 1 : 0;
  auto ls = extra->Attr<std::vector<std::string>>("ls");
  out[10] = ls.size() == 2 && ls[1] == "b" ? 1 : 0;
  out[11] = extra->Attr<int>("i") + extra->Attr<double>("f");
  return 0;
}

extern "C" int CustomWrongAttr(int nparam, void** params, int* ndims, int64_t** shapes,
                               const char** dtypes, void* stream, void* extra) {
  int64_t v = static_cast<AotExtra*>(extra)->Attr<int64_t>("alpha");
  return v == 0 ? 0 : 1;
}
extern "C" int CustomMissingAttr(int nparam, void** params, int* ndims, int64_t** shapes,
                                 const char** dtypes, void* stream, void* extra) {
  return static_cast<AotExtra*>(extra)->Attr<std::vector<float>>("beta").empty() ? 0 : 1;
}

// --- workspaces ---
extern "C" int CustomScratchInit(int* ndims, int64_t** shapes, const char** dtypes,
                                 AotExtra* extra) {
  int64_t n = Count(ndims[0], shapes[0]);
  extra->SetWorkSpace({static_cast<size_t>(n) * sizeof(float), 100});
  return 0;
}
extern "C" int CustomScratch(int nparam, void** params, int* ndims, int64_t** shapes,
                             const char** dtypes, void* stream, void* extra) {
  if (nparam != 4) return 10 + nparam;
  for (int i = 2; i < 4; ++i) {
    if (reinterpret_cast<uintptr_t>(params[i]) % 64 != 0) return 20 + i;
    if (ndims[i] != 1 || std::strcmp(dtypes[i], "uint8") != 0) return 30 + i;
  }
  if (shapes[3][0] != 100) return 40;
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  float* ws = static_cast<float*>(params[2]);
  int64_t n = Count(ndims[0], shapes[0]);
  for (int64_t i = 0; i < n; ++i) ws[i] = 2 * x[i];
  std::memset(params[3], 0xab, 100);
  for (int64_t i = 0; i < n; ++i) y[i] = ws[n - 1 - i];
  return 0;
}

// MindSpore's add_with_attr.cc bug: an N-byte workspace, N*N floats.
extern "C" int CustomOverrunInit(int* ndims, int64_t** shapes, const char** dtypes,
                                 AotExtra* extra) {
  extra->SetWorkSpace({static_cast<size_t>(Count(ndims[0], shapes[0]))});
  return 0;
}
extern "C" int CustomOverrun(int nparam, void** params, int* ndims, int64_t** shapes,
                             const char** dtypes, void* stream, void* extra) {
  int64_t n = Count(ndims[0], shapes[0]);
  float* tmp = static_cast<float*>(params[2]);
  for (int64_t i = 0; i < n * n; ++i) tmp[i] = 1.0f;
  return 0;
}
// One float past a 16-byte workspace (into its alignment slack), when x[0]
// is not 0; returns 5 if the workspace did not start zeroed.
extern "C" int CustomSlackInit(int* ndims, int64_t** shapes, const char** dtypes,
                               AotExtra* extra) {
  extra->SetWorkSpace({16});
  return 0;
}
extern "C" int CustomSlack(int nparam, void** params, int* ndims, int64_t** shapes,
                           const char** dtypes, void* stream, void* extra) {
  float* ws = static_cast<float*>(params[2]);
  for (int i = 0; i < 4; ++i) {
    if (ws[i] != 0) return 5;
    ws[i] = 7.0f;
  }
  if (static_cast<const float*>(params[0])[0] != 0) ws[4] = 1.0f;
  return 0;
}

// --- the typed header on top of the same ABI ---
#include "opjit/kernel.h"
extern "C" int CustomScale(int nparam, void** params, int* ndims, int64_t** shapes,
                           const char** dtypes, void* stream, void* extra) {
  opjit::KernelArgs args(nparam, params, ndims, shapes, dtypes, extra);
  if (args.size() != 2 || !args.IsDtype(0, "float32")) return 1;
  auto x = args.Tensor<const float>(0);
  auto y = args.Tensor<float>(1);
  float alpha = args.extra()->Attr<float>("alpha");
  for (int64_t i = 0; i < x.size(); ++i) y[i] = alpha * x[i];
  return x.dim(-1) == 2 ? 0 : 2;
}

// --- failures ---
extern "C" int CustomFail(int nparam, void** params, int* ndims, int64_t** shapes,
                          const char** dtypes, void* stream, void* extra) {
  return 7;
}
extern "C" int CustomThrow(int nparam, void** params, int* ndims, int64_t** shapes,
                           const char** dtypes, void* stream, void* extra) {
  throw std::runtime_error("kernel exploded");
}
extern "C" int CustomNoWrite(int nparam, void** params, int* ndims, int64_t** shapes,
                             const char** dtypes, void* stream, void* extra) {
  return 0;  // leaves its output as it found it
}
extern "C" int CustomBadInitInit(int* ndims, int64_t** shapes, const char** dtypes,
                                 AotExtra* extra) {
  return 3;
}
extern "C" int CustomBadInit(int nparam, void** params, int* ndims, int64_t** shapes,
                             const char** dtypes, void* stream, void* extra) {
  return 0;
}
)";

class AotKernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto loader = loader::JitLoader::Create({});
    ASSERT_TRUE(loader.ok()) << loader.status();
    loader_ = std::move(*loader);
    auto kernel = loader_->Load(CompileKernel(kAotKernels), "aot", {});
    ASSERT_TRUE(kernel.ok()) << kernel.status();
    kernel_ = *kernel;
  }

  int Global(const char* name) { return *kernel_->FindAs<int*>(name); }

  std::unique_ptr<loader::JitLoader> loader_;
  std::shared_ptr<const loader::LoadedKernel> kernel_;
};

TensorDesc F32(std::vector<int64_t> shape) { return TensorDesc{"float32", std::move(shape)}; }

TEST_F(AotKernelTest, LeakyReluWithInitAndKernelData) {
  {
    auto inst = AotKernelInstance::Create(kernel_, "CustomLeakyRelu", {F32({2, 2})}, {F32({2, 2})},
                                          {{"alpha", AttrValue(0.5)}});
    ASSERT_TRUE(inst.ok()) << inst.status();
    EXPECT_TRUE((*inst)->has_init());
    EXPECT_FALSE((*inst)->has_infer_shape());
    EXPECT_EQ(Global("g_init_calls"), 1);
    EXPECT_EQ(Global("g_data_live"), 1);
    float x[4] = {-2, -1, 0, 3}, y[4] = {};
    for (int run = 0; run < 3; ++run) {
      ASSERT_TRUE((*inst)->Run({{x, F32({2, 2})}}, {{y, F32({2, 2})}}).ok());
    }
    EXPECT_EQ(Global("g_init_calls"), 1) << "Init runs once per instance";
    EXPECT_FLOAT_EQ(y[0], -1.0f);
    EXPECT_FLOAT_EQ(y[1], -0.5f);
    EXPECT_FLOAT_EQ(y[3], 3.0f);
  }
  EXPECT_EQ(Global("g_data_live"), 0) << "KernelData destroyed with the instance";
}

TEST_F(AotKernelTest, InstanceKeepsTheKernelLoaded) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomLeakyRelu", {F32({1})}, {F32({1})},
                                        {{"alpha", AttrValue(0.25)}});
  ASSERT_TRUE(inst.ok()) << inst.status();
  kernel_.reset();
  EXPECT_EQ(loader_->GetStats().live, 1u);
  float x = -4, y = 0;
  ASSERT_TRUE((*inst)->Run({{&x, F32({1})}}, {{&y, F32({1})}}).ok());
  EXPECT_FLOAT_EQ(y, -1.0f);
  inst->reset();  // KernelData's vtable is in the kernel: deleted before unload
  EXPECT_EQ(loader_->GetStats().live, 0u);
}

TEST_F(AotKernelTest, TypedKernelHeader) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomScale", {F32({2, 2})}, {F32({2, 2})},
                                        {{"alpha", AttrValue(3.0)}});
  ASSERT_TRUE(inst.ok()) << inst.status();
  float x[4] = {1, 2, 3, 4}, y[4] = {};
  absl::Status status = (*inst)->Run({{x, F32({2, 2})}}, {{y, F32({2, 2})}});
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_FLOAT_EQ(y[3], 12.0f);
}

TEST_F(AotKernelTest, LoadTimeOfARealisticObject) {
  std::string obj = CompileKernel(kAotKernels);
  std::vector<double> ms;
  for (int i = 0; i < 30; ++i) {
    auto start = std::chrono::steady_clock::now();
    auto kernel = loader_->Load(obj, "timed", {});
    ASSERT_TRUE(kernel.ok()) << kernel.status();
    ASSERT_NE((*kernel)->Find("CustomLeakyRelu"), nullptr);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf("aot object (%zu bytes, %zu symbols) -> Load -> Find: median %.3f ms, max %.3f ms\n",
              obj.size(), kernel_->defined_symbols().size(), ms[ms.size() / 2], ms.back());
}

TEST_F(AotKernelTest, LibmFunctions) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomSwish", {F32({3})}, {F32({3})}, {});
  ASSERT_TRUE(inst.ok()) << inst.status();
  EXPECT_FALSE((*inst)->has_init());
  float x[3] = {-1, 0, 0.5f}, y[3] = {};
  ASSERT_TRUE((*inst)->Run({{x, F32({3})}}, {{y, F32({3})}}).ok());
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(y[i], std::tanh(x[i]) + std::exp(x[i]), 1e-6);
}

// A kernel whose expf loop vectorized to libmvec (-fveclib=libmvec, as the
// compile worker builds, with -fno-math-errno) loads: the loader resolves
// glibc's vector math from the process; results stay within libmvec's few ULP.
TEST(AotKernelVecMathTest, LibmvecCallsResolveAndAgreeWithLibm) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "libmvec is glibc's x86-64 vector math";
#endif
  const std::string src = R"(
#include <cmath>
#include <cstdint>
extern "C" int VecExp(int nparam, void** params, int* ndims, int64_t** shapes,
                       const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int d = 0; d < ndims[0]; ++d) n *= shapes[0][d];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = std::exp(x[i]);
  return 0;
}
)";
  auto loader = loader::JitLoader::Create({});
  ASSERT_TRUE(loader.ok()) << loader.status();
  std::string object = CompileKernel(src, "c++", {"-O3", "-fveclib=libmvec", "-fno-math-errno"});
  ASSERT_NE(object.find("_expf"), std::string::npos);
  ASSERT_NE(object.find("_ZGV"), std::string::npos) << "the loop did not vectorize";
  auto kernel = (*loader)->Load(object, "vec_exp", {});
  ASSERT_TRUE(kernel.ok()) << kernel.status();
  constexpr int kN = 4099;  // not a multiple of any vector width
  auto inst = AotKernelInstance::Create(*kernel, "VecExp", {F32({kN})}, {F32({kN})}, {});
  ASSERT_TRUE(inst.ok()) << inst.status();
  std::vector<float> x(kN), y(kN);
  for (int i = 0; i < kN; ++i) x[i] = -9.0f + 18.0f * static_cast<float>(i) / kN;
  ASSERT_TRUE((*inst)->Run({{x.data(), F32({kN})}}, {{y.data(), F32({kN})}}).ok());
  for (int i = 0; i < kN; ++i) {
    const float want = std::exp(x[i]);
    EXPECT_NEAR(y[i], want, 4 * std::abs(std::nextafter(want, HUGE_VALF) - want)) << x[i];
  }
}

TEST_F(AotKernelTest, InferShapeThenDeferredInit) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomReduceSum", {F32({2, 3})}, {},
                                        {{"axis", AttrValue(int64_t{1})}});
  ASSERT_TRUE(inst.ok()) << inst.status();
  EXPECT_EQ(Global("g_init_calls"), 0) << "Init waits for the outputs";
  auto shape = (*inst)->InferShape();
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_EQ(*shape, (std::vector<int64_t>{2}));
  float x[6] = {1, 2, 3, 4, 5, 6}, y[2] = {};
  ASSERT_TRUE((*inst)->Run({{x, F32({2, 3})}}, {{y, F32(*shape)}}).ok());
  ASSERT_TRUE((*inst)->Run({{x, F32({2, 3})}}, {{y, F32(*shape)}}).ok());
  EXPECT_EQ(Global("g_init_calls"), 1);
  EXPECT_FLOAT_EQ(y[0], 6.0f);
  EXPECT_FLOAT_EQ(y[1], 15.0f);
  EXPECT_EQ((*inst)->outputs(), (std::vector<TensorDesc>{F32({2})}));
  // Outputs are fixed once Init has seen them.
  float z[3];
  auto bad = (*inst)->Run({{x, F32({2, 3})}}, {{z, F32({3})}});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AotKernelTest, InferShapeMissing) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomSwish", {F32({3})}, {F32({3})}, {});
  ASSERT_TRUE(inst.ok());
  EXPECT_EQ((*inst)->InferShape().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(AotKernelTest, EveryAttrType) {
  std::map<std::string, AttrValue> attrs = {
      {"b", AttrValue(true)},
      {"i", AttrValue(int64_t{-7})},
      {"f", AttrValue(0.25)},
      {"s", AttrValue(std::string("relu"))},
      {"li", AttrValue(std::vector<int64_t>{1, 2, 3})},
      {"lf", AttrValue(std::vector<double>{0.5, 1.5})},
      {"lb", AttrValue(std::vector<bool>{false, true})},
      {"ls", AttrValue(std::vector<std::string>{"a", "b"})},
      {"lli", AttrValue(std::vector<std::vector<int64_t>>{{1}, {2, 3, 4}})},
      {"llf", AttrValue(std::vector<std::vector<double>>{{0.5, 2.5}})},
  };
  TensorDesc out{"float64", {12}};
  auto inst = AotKernelInstance::Create(kernel_, "CustomAttrs", {}, {out}, attrs);
  ASSERT_TRUE(inst.ok()) << inst.status();
  double y[12] = {};
  absl::Status status = (*inst)->Run({}, {{y, out}});
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(y[0], 1);
  EXPECT_EQ(y[1], -7);
  EXPECT_EQ(y[2], 0.25);
  EXPECT_EQ(y[3], 1);
  EXPECT_EQ(y[4], 6);
  EXPECT_EQ(y[5], 2.0);
  EXPECT_EQ(y[6], 4);
  EXPECT_EQ(y[7], 2.5);
  EXPECT_EQ(y[8], 1);
  EXPECT_EQ(y[9], 1);
  EXPECT_EQ(y[10], 1);
  EXPECT_EQ(y[11], -6.75);
}

TEST_F(AotKernelTest, WrongAttrTypeIsAnErrorNotACrash) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomWrongAttr", {}, {F32({1})},
                                        {{"alpha", AttrValue(0.5)}});
  ASSERT_TRUE(inst.ok()) << inst.status();
  float y;
  absl::Status status = (*inst)->Run({}, {{&y, F32({1})}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("kernel read attr 'alpha' as int64_t but it is float"));
  // The error belongs to that call only.
  auto ok_inst = AotKernelInstance::Create(kernel_, "CustomWrongAttr", {}, {F32({1})},
                                           {{"alpha", AttrValue(int64_t{0})}});
  ASSERT_TRUE(ok_inst.ok());
  EXPECT_TRUE((*ok_inst)->Run({}, {{&y, F32({1})}}).ok());
}

TEST_F(AotKernelTest, MissingAttrIsAnError) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomMissingAttr", {}, {F32({1})}, {});
  ASSERT_TRUE(inst.ok()) << inst.status();
  float y;
  absl::Status status = (*inst)->Run({}, {{&y, F32({1})}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("'beta'"));
}

TEST_F(AotKernelTest, AttrErrorInInitFailsCreate) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomLeakyRelu", {F32({1})}, {F32({1})},
                                        {{"alpha", AttrValue(std::string("x"))}});
  ASSERT_FALSE(inst.ok());
  EXPECT_EQ(inst.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(inst.status().message()),
              HasSubstr("kernel read attr 'alpha' as float but it is str"));
}

TEST_F(AotKernelTest, Workspaces) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomScratch", {F32({5})}, {F32({5})}, {});
  ASSERT_TRUE(inst.ok()) << inst.status();
  EXPECT_EQ((*inst)->workspace_sizes(), (std::vector<size_t>{20, 100}));
  float x[5] = {1, 2, 3, 4, 5}, y[5] = {};
  absl::Status status = (*inst)->Run({{x, F32({5})}}, {{y, F32({5})}});
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_FLOAT_EQ(y[0], 10.0f);
  EXPECT_FLOAT_EQ(y[4], 2.0f);
}

TEST_F(AotKernelTest, AWriteFarPastAWorkspaceFaultsInItsOwnCall) {
  // add_with_attr's pattern (256 floats into 16 bytes) ends at the guard
  // page after the workspace, in this call, instead of corrupting the heap.
  auto inst = AotKernelInstance::Create(kernel_, "CustomOverrun", {F32({16})}, {F32({16})}, {});
  ASSERT_TRUE(inst.ok()) << inst.status();
  float x[16] = {}, y[16] = {};
  EXPECT_DEATH((void)(*inst)->Run({{x, F32({16})}}, {{y, F32({16})}}), "");
  // 4 bytes and 16 floats stay inside its 64-byte alignment: seen after the
  // call instead.
  auto small = AotKernelInstance::Create(kernel_, "CustomOverrun", {F32({4})}, {F32({4})}, {});
  ASSERT_TRUE(small.ok()) << small.status();
  absl::Status st = (*small)->Run({{x, F32({4})}}, {{y, F32({4})}});
  EXPECT_EQ(st.code(), absl::StatusCode::kAborted) << st;
}

TEST_F(AotKernelTest, AWriteIntoAWorkspacesSlackFailsTheCall) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomSlack", {F32({1})}, {F32({1})}, {});
  ASSERT_TRUE(inst.ok()) << inst.status();
  float good = 0, bad = 1, y = 0;
  absl::Status st = (*inst)->Run({{&bad, F32({1})}}, {{&y, F32({1})}});
  EXPECT_EQ(st.code(), absl::StatusCode::kAborted) << st;
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("kernel CustomSlack wrote past the end (or before the start) of its "
                        "workspace 0 (16 bytes"));
  // The same (kept) workspace, zeroed again, slack included: the next call
  // is clean.
  for (int i = 0; i < 3; ++i) {
    st = (*inst)->Run({{&good, F32({1})}}, {{&y, F32({1})}});
    EXPECT_TRUE(st.ok()) << st;
  }
}

TEST_F(AotKernelTest, OutputsStartZeroed) {
  // Earlier bytes in an output's memory (a reused shm range, an arena) never
  // reach the caller through a kernel that writes less than all of it.
  auto inst = AotKernelInstance::Create(kernel_, "CustomNoWrite", {F32({4})}, {F32({1024})}, {});
  ASSERT_TRUE(inst.ok()) << inst.status();
  float x[4] = {}, y[1024];
  std::fill(std::begin(y), std::end(y), 1234.5f);
  ASSERT_TRUE((*inst)->Run({{x, F32({4})}}, {{y, F32({1024})}}).ok());
  EXPECT_EQ(std::count(std::begin(y), std::end(y), 0.0f), 1024);
  // The benchmark's switch leaves them as they are.
  auto as_is = AotKernelInstance::Create(kernel_, "CustomNoWrite", {F32({4})}, {F32({1024})}, {},
                                         {.zero_outputs = false});
  ASSERT_TRUE(as_is.ok()) << as_is.status();
  std::fill(std::begin(y), std::end(y), 1234.5f);
  ASSERT_TRUE((*as_is)->Run({{x, F32({4})}}, {{y, F32({1024})}}).ok());
  EXPECT_EQ(std::count(std::begin(y), std::end(y), 1234.5f), 1024);
}

TEST_F(AotKernelTest, KeptOutputsKeepTheirBytes) {
  // keep_bytes (ForwardRequest.keep_output_bytes, for the caller's own
  // shared memory): that output is left as it is; without it, zeroed.
  auto inst = AotKernelInstance::Create(kernel_, "CustomNoWrite", {F32({4})}, {F32({1024})}, {});
  ASSERT_TRUE(inst.ok()) << inst.status();
  float x[4] = {}, y[1024];
  std::fill(std::begin(y), std::end(y), 1234.5f);
  HostTensor kept{y, F32({1024})};
  kept.keep_bytes = true;
  ASSERT_TRUE((*inst)->Run({{x, F32({4})}}, {kept}).ok());
  EXPECT_EQ(std::count(std::begin(y), std::end(y), 1234.5f), 1024);
  kept.keep_bytes = false;
  ASSERT_TRUE((*inst)->Run({{x, F32({4})}}, {kept}).ok());
  EXPECT_EQ(std::count(std::begin(y), std::end(y), 0.0f), 1024);
}

TEST_F(AotKernelTest, NonZeroReturnIsAborted) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomFail", {}, {F32({1})}, {});
  ASSERT_TRUE(inst.ok());
  float y;
  absl::Status status = (*inst)->Run({}, {{&y, F32({1})}});
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(status.message(), "kernel CustomFail returned 7");
}

TEST_F(AotKernelTest, ThrownExceptionIsInternal) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomThrow", {}, {F32({1})}, {});
  ASSERT_TRUE(inst.ok());
  float y;
  absl::Status status = (*inst)->Run({}, {{&y, F32({1})}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(status.message()), HasSubstr("kernel exploded"));
  // The daemon carries on.
  EXPECT_EQ((*inst)->Run({}, {{&y, F32({1})}}).code(), absl::StatusCode::kInternal);
}

TEST_F(AotKernelTest, InitFailure) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomBadInit", {}, {F32({1})}, {});
  ASSERT_FALSE(inst.ok());
  EXPECT_EQ(inst.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(inst.status().message(), "CustomBadInit Init returned 3");
}

TEST_F(AotKernelTest, MissingEntryListsDefinedSymbols) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomNope", {}, {}, {});
  ASSERT_FALSE(inst.ok());
  EXPECT_EQ(inst.status().code(), absl::StatusCode::kInvalidArgument);
  std::string message(inst.status().message());
  EXPECT_THAT(message, HasSubstr("entry symbol 'CustomNope' not found; the object defines: "));
  EXPECT_THAT(message, HasSubstr("CustomLeakyRelu, CustomLeakyReluInit"));
}

TEST_F(AotKernelTest, MismatchedTensorsAreRefused) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomSwish", {F32({3})}, {F32({3})}, {});
  ASSERT_TRUE(inst.ok());
  float x[4], y[4];
  EXPECT_EQ((*inst)->Run({{x, F32({4})}}, {{y, F32({4})}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*inst)->Run({{x, TensorDesc{"float64", {3}}}}, {{y, F32({3})}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*inst)->Run({}, {{y, F32({3})}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*inst)->Run({{nullptr, F32({3})}}, {{y, F32({3})}}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(AotKernelTest, ConcurrentRuns) {
  auto inst = AotKernelInstance::Create(kernel_, "CustomScratch", {F32({64})}, {F32({64})}, {});
  ASSERT_TRUE(inst.ok());
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<float> x(64, static_cast<float>(t)), y(64);
      for (int i = 0; i < 50; ++i) {
        if ((*inst)->Run({{x.data(), F32({64})}}, {{y.data(), F32({64})}}).ok() &&
            y[7] == 2.0f * t) {
          ++good;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(good.load(), 200);
}

}  // namespace
}  // namespace opjit::runner
