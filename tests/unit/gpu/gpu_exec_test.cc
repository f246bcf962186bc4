// Tests that run kernels on a real GPU. Without a CUDA driver or a device
// every test skips with the reason.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "server/gpu/cuda_driver.h"
#include "server/gpu/launch_spec.h"
#include "server/gpu/nvcc_compiler.h"
#include "server/gpu/nvrtc_compiler.h"
#include "tests/unit/gpu/test_util.h"

namespace opjit::gpu {
namespace {

class GpuExecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<CudaDriver*> driver = CudaDriver::Get();
    // The status says why: "no CUDA driver: libcuda.so.1 not found (...)",
    // a failed cuInit, or no devices.
    if (!driver.ok()) {
      // `make test-gpu` sets OPJIT_REQUIRE_GPU=1: there a missing GPU is a
      // failure, never a quiet skip.
      const char* require = std::getenv("OPJIT_REQUIRE_GPU");
      if (require != nullptr && std::string(require) == "1") {
        FAIL() << "OPJIT_REQUIRE_GPU=1 but no GPU: " << driver.status().message();
      }
      GTEST_SKIP() << std::string(driver.status().message());
    }
    absl::StatusOr<Device*> dev = (*driver)->GetDevice(0);
    ASSERT_TRUE(dev.ok()) << dev.status();
    device_ = *dev;
    NvrtcOptions o;
    o.cuda_root = OPJIT_TEST_CUDA_ROOT;
    o.archs = {device_->Arch()};
    auto c = NvrtcCompiler::Create(o);
    ASSERT_TRUE(c.ok()) << c.status();
    compiler_ = std::move(*c);
  }

  Device* device_ = nullptr;
  std::unique_ptr<NvrtcCompiler> compiler_;
};

constexpr char kAxpy[] = R"(
template <typename T>
__global__ void axpy(T a, const T* x, T* y, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}
)";

TEST_F(GpuExecTest, NvrtcCubinRunsWithALaunchSpec) {
  GpuCompileRequest req;
  req.source = kAxpy;
  req.name_expressions = {"axpy<float>"};
  auto out = compiler_->Compile(req);
  ASSERT_TRUE(out.ok()) << out.status();

  LaunchSpec spec;
  spec.kernel = "axpy<float>";
  spec.grid = {"ceil_div(numel(x), 256)"};
  spec.block = {"256"};
  spec.args = {"attr:alpha", "x", "y", "numel(x)"};
  ASSERT_TRUE(ValidateLaunchSpec(spec, {"x", "y"}, {}, {"alpha"}).ok());
  const int64_t n = 100000;
  LaunchEnv env;
  env.input_names = {"x", "y"};
  env.input_shapes = {{n}, {n}};
  env.attrs = {{"alpha", 2.0}};
  env.float_attrs = {"alpha"};
  auto cfg = Resolve(spec, env);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto args = ResolveArgs(spec, env);
  ASSERT_TRUE(args.ok()) << args.status();

  auto module = Module::Load(*device_, out->cubins[device_->Arch()]);
  ASSERT_TRUE(module.ok()) << module.status();
  auto kernel = (*module)->GetKernel(out->lowered_names[spec.kernel]);
  ASSERT_TRUE(kernel.ok()) << kernel.status();
  auto stream = Stream::Create(*device_);
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::vector<float> x(n), y(n);
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(i), y[i] = 1.0f;
  auto dx = DeviceBuffer::Allocate(*device_, n * sizeof(float));
  auto dy = DeviceBuffer::Allocate(*device_, n * sizeof(float));
  ASSERT_TRUE(dx.ok() && dy.ok());
  ASSERT_TRUE(dx->CopyFromHost(x.data(), n * sizeof(float), *stream).ok());
  ASSERT_TRUE(dy->CopyFromHost(y.data(), n * sizeof(float), *stream).ok());

  // Bind the resolved args to storage the launch can point at.
  std::vector<uint64_t> ptrs(args->size());
  std::vector<int64_t> ints(args->size());
  std::vector<float> floats(args->size());
  std::vector<void*> params;
  for (size_t i = 0; i < args->size(); ++i) {
    const KernelArg& a = (*args)[i];
    switch (a.kind) {
      case KernelArg::Kind::kInputPointer:
        ptrs[i] = a.tensor == 0 ? dx->ptr() : dy->ptr();
        params.push_back(&ptrs[i]);
        break;
      case KernelArg::Kind::kOutputPointer:
        FAIL() << "no outputs here";
      case KernelArg::Kind::kInt64:
        ints[i] = a.i64;
        params.push_back(&ints[i]);
        break;
      case KernelArg::Kind::kFloat32:
        floats[i] = a.f32;
        params.push_back(&floats[i]);
        break;
    }
  }
  ASSERT_TRUE(kernel->Launch(*cfg, *stream, params.data()).ok());
  ASSERT_TRUE(dy->CopyToHost(y.data(), n * sizeof(float), *stream).ok());
  ASSERT_TRUE(stream->Synchronize().ok());
  for (int64_t i = 0; i < n; i += 997)
    ASSERT_FLOAT_EQ(y[i], 1.0f + 2.0f * static_cast<float>(i)) << i;
}

TEST_F(GpuExecTest, PtxIsJitCompiledByTheDriver) {
  GpuCompileRequest req;
  req.source = "extern \"C\" __global__ void fill(int* p) { p[threadIdx.x] = threadIdx.x * 3; }\n";
  auto out = compiler_->Compile(req);
  ASSERT_TRUE(out.ok()) << out.status();
  auto module = Module::Load(*device_, out->ptx);
  ASSERT_TRUE(module.ok()) << module.status();
  auto kernel = (*module)->GetKernel("fill");
  ASSERT_TRUE(kernel.ok()) << kernel.status();
  auto stream = Stream::Create(*device_);
  auto buf = DeviceBuffer::Allocate(*device_, 32 * sizeof(int));
  ASSERT_TRUE(stream.ok() && buf.ok());
  uint64_t p = buf->ptr();
  void* params[] = {&p};
  LaunchConfig cfg;
  cfg.block[0] = 32;
  ASSERT_TRUE(kernel->Launch(cfg, *stream, params).ok());
  std::vector<int> host(32);
  ASSERT_TRUE(buf->CopyToHost(host.data(), 32 * sizeof(int), *stream).ok());
  ASSERT_TRUE(stream->Synchronize().ok());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(host[i], 3 * i);
}

TEST_F(GpuExecTest, OutOfMemoryIsResourceExhausted) {
  auto buf = DeviceBuffer::Allocate(*device_, device_->total_memory() * 2);
  ASSERT_FALSE(buf.ok());
  EXPECT_EQ(buf.status().code(), absl::StatusCode::kResourceExhausted) << buf.status();
}

// The nvcc-built aot .so, called through its exported entry with a CUDA stream.
TEST_F(GpuExecTest, NvccAotSharedObjectRuns) {
  NvccRequest r;
  r.cuda_root = OPJIT_TEST_CUDA_ROOT;
  r.kernel_include_dir = OPJIT_TEST_KERNEL_INCLUDE_DIR;
  r.archs = {device_->Arch()};
  r.source = R"(
#include <cstdint>
#include "custom_aot_extra.h"
__global__ void Add(const float* a, const float* b, float* c, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}
extern "C" int CustomAdd(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                         void* stream, void* extra) {
  int64_t n = shapes[0][0];
  Add<<<(n + 255) / 256, 256, 0, (cudaStream_t)stream>>>((const float*)params[0], (const float*)params[1],
                                                         (float*)params[2], n);
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
)";
  auto out = CompileAotSharedObject(r);
  ASSERT_TRUE(out.ok()) << out.status();
  testing::TempDir dir;
  const std::string so = dir.path() + "/k.so";
  testing::WriteFile(so, out->shared_object);
  void* lib = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << dlerror();
  using Fn = int (*)(int, void**, int*, int64_t**, const char**, void*, void*);
  auto fn = reinterpret_cast<Fn>(dlsym(lib, "CustomAdd"));
  ASSERT_NE(fn, nullptr);

  const int64_t n = 5000;
  auto stream = Stream::Create(*device_);
  ASSERT_TRUE(stream.ok());
  std::vector<float> a(n, 1.5f), b(n, 2.0f), c(n, 0);
  auto da = DeviceBuffer::Allocate(*device_, n * 4);
  auto db = DeviceBuffer::Allocate(*device_, n * 4);
  auto dc = DeviceBuffer::Allocate(*device_, n * 4);
  ASSERT_TRUE(da.ok() && db.ok() && dc.ok());
  ASSERT_TRUE(da->CopyFromHost(a.data(), n * 4, *stream).ok());
  ASSERT_TRUE(db->CopyFromHost(b.data(), n * 4, *stream).ok());
  void* params[] = {reinterpret_cast<void*>(da->ptr()), reinterpret_cast<void*>(db->ptr()),
                    reinterpret_cast<void*>(dc->ptr())};
  int ndims[] = {1, 1, 1};
  int64_t shape[] = {n};
  int64_t* shapes[] = {shape, shape, shape};
  const char* dtypes[] = {"float32", "float32", "float32"};
  ASSERT_EQ(fn(3, params, ndims, shapes, dtypes, stream->get(), nullptr), 0);
  ASSERT_TRUE(dc->CopyToHost(c.data(), n * 4, *stream).ok());
  ASSERT_TRUE(stream->Synchronize().ok());
  for (int64_t i = 0; i < n; i += 499) ASSERT_FLOAT_EQ(c[i], 3.5f);
  dlclose(lib);
}

}  // namespace
}  // namespace opjit::gpu
