// Compile-path benchmarks, measured side by side in one run:
//   - opjit cold compile of a small <cmath> kernel vs `g++ -O2 -shared -fPIC`
//     of the same source plus dlopen, as a subprocess;
//   - memory-cache hit; disk-cache hit in a freshly created compiler (what a
//     restarted daemon does);
//   - the JIT'd kernel vs the same source from `g++ -O3 -march=native`: an
//     elementwise op and a row reduction (16K and 16M floats), and a small
//     matmul (64x64 and 256x256).
// Run through bench/run.sh, which turns the medians into the README's table.
#include <dlfcn.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>

#include "server/compiler/kernel_compiler.h"
#include "server/gpu/nvrtc_compiler.h"
#include "server/loader/loader.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using opjit::compiler::CacheTier;
using opjit::compiler::CompileJob;
using opjit::compiler::KernelCompiler;

const char kCmathKernel[] = R"(
#include <cmath>
#include <cstdint>
extern "C" int Softplus(int nparam, void** params, int* ndims, int64_t** shapes,
                        const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = std::log1p(std::exp(x[i]));
  return 0;
}
)";

// Kernel quality: the same sources built by the JIT and by g++. One
// signature, (in0, in1, out, n), so one harness runs all three.
struct QualityKernel {
  const char* name;
  const char* source;
  // Elements of in0, in1 and out for size n.
  int64_t (*in_elems)(int64_t n);
  int64_t (*out_elems)(int64_t n);
};

const char kElementwiseKernel[] = R"(
#include <cstdint>
// y = 1.5 x + 0.25 x^2, clipped at 0
extern "C" void Elementwise(const float* x, const float*, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float v = 1.5f * x[i] + 0.25f * x[i] * x[i];
    y[i] = v > 0.0f ? v : 0.0f;
  }
}
)";

const char kReductionKernel[] = R"(
#include <cstdint>
// Row sums of an [n/256, 256] matrix: the last-axis reduce of reduce_sum.
extern "C" void Reduction(const float* x, const float*, float* y, int64_t n) {
  const int64_t cols = 256, rows = n / cols;
  for (int64_t r = 0; r < rows; ++r) {
    float s = 0.0f;
    for (int64_t c = 0; c < cols; ++c) s += x[r * cols + c];
    y[r] = s;
  }
}
)";

const char kMatmulKernel[] = R"(
#include <cstdint>
// C = A B for n x n row-major matrices (i-k-j order).
extern "C" void Matmul(const float* a, const float* b, float* c, int64_t n) {
  for (int64_t i = 0; i < n * n; ++i) c[i] = 0.0f;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < n; ++k) {
      const float aik = a[i * n + k];
      for (int64_t j = 0; j < n; ++j) c[i * n + j] += aik * b[k * n + j];
    }
}
)";

const QualityKernel kQualityKernels[] = {
    {"Elementwise", kElementwiseKernel, [](int64_t n) { return n; }, [](int64_t n) { return n; }},
    {"Reduction", kReductionKernel, [](int64_t n) { return n; }, [](int64_t n) { return n / 256; }},
    {"Matmul", kMatmulKernel, [](int64_t n) { return n * n; }, [](int64_t n) { return n * n; }},
};

std::string Dir() {
  static const std::string dir = [] {
    std::string tmpl = (fs::temp_directory_path() / "opjit-bench-XXXXXX").string();
    return std::string(mkdtemp(tmpl.data()));
  }();
  return dir;
}

std::string BinDir() { return fs::read_symlink("/proc/self/exe").parent_path().string(); }

opjit::compiler::KernelCompilerOptions Options(const std::string& cache_dir) {
  opjit::compiler::KernelCompilerOptions o;
  o.cache_dir = cache_dir;
  o.worker_path = BinDir() + "/opjit-compile-worker";
  o.kernel_include_dir = OPJIT_KERNEL_INCLUDE_DIR;
  return o;
}

KernelCompiler& Shared() {
  static std::unique_ptr<KernelCompiler> kc = [] {
    auto r = KernelCompiler::Create(Options(Dir() + "/shared-cache"));
    if (!r.ok()) {
      fprintf(stderr, "KernelCompiler: %s\n", r.status().ToString().c_str());
      abort();
    }
    return *std::move(r);
  }();
  return *kc;
}

int Run(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  if (posix_spawnp(&pid, args[0], nullptr, nullptr, args.data(), environ) != 0) return -1;
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void BM_OpjitColdCompileCmath(benchmark::State& state) {
  KernelCompiler& kc = Shared();
  static std::atomic<int> counter{0};
  for (auto _ : state) {
    CompileJob job;
    // A unique comment makes every iteration a cache miss.
    job.source = std::string(kCmathKernel) + "// " + std::to_string(counter++) + "\n";
    job.entry = "Softplus";
    auto r = kc.Compile(job);
    if (!r.ok() || r->cache_hit != CacheTier::kNone)
      state.SkipWithError("compile failed or was a hit");
  }
}
BENCHMARK(BM_OpjitColdCompileCmath)->Unit(benchmark::kMillisecond)->Iterations(10)->Repetitions(3);

void BM_GccSharedDlopenCmath(benchmark::State& state) {
  static std::atomic<int> counter{0};
  for (auto _ : state) {
    const std::string base = Dir() + "/gcc" + std::to_string(counter++);
    std::ofstream(base + ".cc") << kCmathKernel;
    if (Run({"g++", "-O2", "-shared", "-fPIC", "-o", base + ".so", base + ".cc"}) != 0) {
      state.SkipWithError("g++ failed");
      break;
    }
    void* h = dlopen((base + ".so").c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr || dlsym(h, "Softplus") == nullptr) state.SkipWithError("dlopen failed");
    if (h) dlclose(h);
  }
}
BENCHMARK(BM_GccSharedDlopenCmath)->Unit(benchmark::kMillisecond)->Iterations(10)->Repetitions(3);

// ATen kernels (kernels/examples/aten, MindSpore's third-party guide), with
// the include directories the README's config names. Exact preambles: the
// first kernel builds the PCH of its include block; a second, different
// kernel with the same includes loads it.
const std::vector<std::string> kAtenIncludeDirs = {
    "/usr/include/torch/csrc/api/include", "/usr/include/python3.11",
    OPJIT_SOURCE_DIR "/kernels/examples/aten"};
const std::vector<std::string> kAtenLibraries = {"libtorch_cpu.so", "libc10.so"};

bool HaveAten() {
  return fs::exists("/usr/include/torch/csrc/api/include/torch/all.h") &&
         fs::exists("/usr/include/python3.11/Python.h");
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::unique_ptr<KernelCompiler> AtenCompiler(const std::string& cache_dir) {
  auto o = Options(cache_dir);
  o.extra_include_dirs = kAtenIncludeDirs;
  o.allowed_libraries = kAtenLibraries;
  o.timeout_ms = 600000;
  auto r = KernelCompiler::Create(o);
  return r.ok() ? *std::move(r) : nullptr;
}

CompileJob AtenJob(const std::string& file, const std::string& entry, int unique) {
  CompileJob job;
  job.source = ReadText(OPJIT_SOURCE_DIR "/kernels/examples/aten/" + file) + "// " +
               std::to_string(unique) + "\n";
  job.entry = entry;
  job.libraries = kAtenLibraries;
  return job;
}

// First ATen kernel on a fresh cache: its preamble's PCH is built.
void BM_OpjitAtenFirstKernel(benchmark::State& state) {
  if (!HaveAten()) return state.SkipWithError("libtorch-dev/python3-dev not installed");
  static std::atomic<int> counter{0};
  for (auto _ : state) {
    state.PauseTiming();
    const int n = counter++;
    auto kc = AtenCompiler(Dir() + "/aten-first-" + std::to_string(n));
    state.ResumeTiming();
    if (kc == nullptr) return state.SkipWithError("KernelCompiler failed");
    auto r = kc->Compile(AtenJob("leaky_relu.cc", "LeakyRelu", n));
    if (!r.ok()) return state.SkipWithError(r.status().ToString().c_str());
  }
}
BENCHMARK(BM_OpjitAtenFirstKernel)->Unit(benchmark::kMillisecond)->Iterations(1)->Repetitions(2);

// A second, different ATen kernel with the same include block.
void BM_OpjitAtenSecondKernel(benchmark::State& state) {
  if (!HaveAten()) return state.SkipWithError("libtorch-dev/python3-dev not installed");
  static std::unique_ptr<KernelCompiler> kc = [] {
    auto c = AtenCompiler(Dir() + "/aten-shared");
    if (c != nullptr) (void)c->Compile(AtenJob("leaky_relu.cc", "LeakyRelu", -1));  // the PCH
    return c;
  }();
  if (kc == nullptr) return state.SkipWithError("KernelCompiler failed");
  static std::atomic<int> counter{0};
  for (auto _ : state) {
    auto r = kc->Compile(AtenJob("softplus.cc", "Softplus", counter++));
    if (!r.ok() || r->cache_hit != CacheTier::kNone) {
      return state.SkipWithError(r.ok() ? "a cache hit" : r.status().ToString().c_str());
    }
  }
}
BENCHMARK(BM_OpjitAtenSecondKernel)->Unit(benchmark::kMillisecond)->Iterations(3)->Repetitions(2);

// g++ on the same ATen kernel, as torch's cpp_extension would build it.
void BM_GccSharedAten(benchmark::State& state) {
  if (!HaveAten()) return state.SkipWithError("libtorch-dev/python3-dev not installed");
  static std::atomic<int> counter{0};
  for (auto _ : state) {
    const std::string base = Dir() + "/gaten" + std::to_string(counter++);
    std::ofstream(base + ".cc") << AtenJob("leaky_relu.cc", "LeakyRelu", counter).source;
    std::vector<std::string> argv = {"g++", "-O3", "-shared", "-fPIC", "-std=c++17"};
    for (const auto& d : kAtenIncludeDirs) argv.insert(argv.end(), {"-I", d});
    argv.insert(argv.end(), {"-o", base + ".so", base + ".cc"});
    if (Run(argv) != 0) return state.SkipWithError("g++ failed");
  }
}
BENCHMARK(BM_GccSharedAten)->Unit(benchmark::kMillisecond)->Iterations(1)->Repetitions(2);

void BM_OpjitMemoryHit(benchmark::State& state) {
  KernelCompiler& kc = Shared();
  CompileJob job;
  job.source = kCmathKernel;
  job.entry = "Softplus";
  if (!kc.Compile(job).ok()) state.SkipWithError("warm-up compile failed");
  for (auto _ : state) {
    auto r = kc.Compile(job);
    if (!r.ok() || r->cache_hit != CacheTier::kMemory) state.SkipWithError("not a memory hit");
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_OpjitMemoryHit)->Unit(benchmark::kMicrosecond)->Repetitions(3);

// A fresh KernelCompiler over a warm cache dir: what a restarted daemon sees.
void BM_OpjitDiskHitFreshCompiler(benchmark::State& state) {
  const std::string cache = Dir() + "/disk-cache";
  CompileJob job;
  job.source = kCmathKernel;
  job.entry = "Softplus";
  {
    auto kc = KernelCompiler::Create(Options(cache));
    if (!kc.ok() || !(*kc)->Compile(job).ok()) state.SkipWithError("warm-up failed");
  }
  for (auto _ : state) {
    state.PauseTiming();
    auto kc = KernelCompiler::Create(Options(cache));
    if (!kc.ok()) {
      state.SkipWithError("create failed");
      break;
    }
    state.ResumeTiming();
    auto r = (*kc)->Compile(job);
    if (!r.ok() || r->cache_hit != CacheTier::kDisk) state.SkipWithError("not a disk hit");
    state.PauseTiming();
    kc->reset();
    state.ResumeTiming();
  }
}
BENCHMARK(BM_OpjitDiskHitFreshCompiler)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(10)
    ->Repetitions(3);

// NVRTC (compile only; there is no GPU here): raw NVRTC (in this process,
// no sandbox, initialised by a first compile) against opjit's cold compile
// (a cache miss, through the pool of sandboxed NVRTC workers) of the same
// source for the same archs, without and with a prelude of CUDA's half,
// bfloat16 and fp8 headers (which raw NVRTC parses on every compile and a
// worker loads from its PCH), and a cache hit.
const char kSaxpy[] = R"(
extern "C" __global__ void saxpy(float a, const float* x, float* y, long long n) {
  long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
)";
const char kPrelude[] =
    "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n";

// A distinct source per call: every compile is a miss.
std::string Unique(const std::string& source) {
  static std::atomic<int> counter{0};
  return source + "// " + std::to_string(counter++) + "\n";
}

void NvrtcRaw(benchmark::State& state, const std::string& prelude) {
  auto nvrtc = opjit::gpu::NvrtcCompiler::Create({});
  if (!nvrtc.ok()) {
    state.SkipWithError(std::string(nvrtc.status().message()).c_str());
    return;
  }
  opjit::gpu::GpuCompileRequest req;
  req.source = Unique(prelude + kSaxpy);
  req.name_expressions = {"saxpy"};
  if (!(*nvrtc)->Compile(req).ok()) state.SkipWithError("NVRTC warm-up compile failed");
  for (auto _ : state) {
    req.source = Unique(prelude + kSaxpy);
    if (!(*nvrtc)->Compile(req).ok()) state.SkipWithError("NVRTC compile failed");
  }
}
void BM_NvrtcRaw(benchmark::State& state) { NvrtcRaw(state, ""); }
void BM_NvrtcRawPrelude(benchmark::State& state) { NvrtcRaw(state, kPrelude); }
// Five repetitions: on a shared machine three medians of six are noisy.
BENCHMARK(BM_NvrtcRaw)->Unit(benchmark::kMillisecond)->Iterations(6)->Repetitions(5);
BENCHMARK(BM_NvrtcRawPrelude)->Unit(benchmark::kMillisecond)->Iterations(6)->Repetitions(5);

CompileJob GpuJob(const std::string& source) {
  CompileJob job;
  job.target = opjit::registry::Target::kGpu;
  job.language = "cuda";
  job.source = source;
  job.name_expressions = {"saxpy"};
  return job;
}

void OpjitNvrtcCold(benchmark::State& state, const std::string& prelude) {
  // The pool's first compile of this source's kind (and its PCH) is not
  // what is measured: a daemon has compiled before. Nor is the start of the
  // worker that the pool starts ahead after a first compile (NVRTC's load
  // and warm-up take a core for a moment).
  if (!Shared().Compile(GpuJob(Unique(prelude + kSaxpy))).ok()) {
    state.SkipWithError("GPU warm-up compile failed");
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));
  double worker_ms = 0;
  for (auto _ : state) {
    auto r = Shared().Compile(GpuJob(Unique(prelude + kSaxpy)));
    if (!r.ok() || r->cache_hit != CacheTier::kNone)
      state.SkipWithError("GPU compile failed or was a hit");
    else worker_ms += r->kernel->compile_ms;
  }
  state.counters["worker_ms"] = worker_ms / state.iterations();
}
void BM_OpjitNvrtcCold(benchmark::State& state) { OpjitNvrtcCold(state, ""); }
void BM_OpjitNvrtcColdPrelude(benchmark::State& state) { OpjitNvrtcCold(state, kPrelude); }
BENCHMARK(BM_OpjitNvrtcCold)->Unit(benchmark::kMillisecond)->Iterations(6)->Repetitions(5);
BENCHMARK(BM_OpjitNvrtcColdPrelude)->Unit(benchmark::kMillisecond)->Iterations(6)->Repetitions(5);

void BM_OpjitNvrtcMemoryHit(benchmark::State& state) {
  const CompileJob job = GpuJob(kSaxpy);
  if (!Shared().Compile(job).ok()) state.SkipWithError("warm-up GPU compile failed");
  for (auto _ : state) {
    auto r = Shared().Compile(job);
    if (!r.ok() || r->cache_hit != CacheTier::kMemory) state.SkipWithError("not a memory hit");
  }
}
BENCHMARK(BM_OpjitNvrtcMemoryHit)->Unit(benchmark::kMicrosecond)->Repetitions(3);

using QualityFn = void (*)(const float*, const float*, float*, int64_t);

const QualityKernel& Kernel(const std::string& name) {
  for (const auto& k : kQualityKernels) {
    if (name == k.name) return k;
  }
  abort();
}

QualityFn JitQuality(const std::string& name) {
  // The compiler hands out artifacts; the benchmark links them here, as a
  // kernel runner does.
  static auto loader = opjit::loader::JitLoader::Create({});
  static std::map<std::string, std::shared_ptr<const opjit::loader::LoadedKernel>> keep;
  auto& kept = keep[name];
  if (!kept) {
    CompileJob job;
    job.source = Kernel(name).source;
    job.entry = name;
    auto r = Shared().Compile(job);
    if (!r.ok() || !loader.ok()) return nullptr;
    auto loaded = (*loader)->Load(r->kernel->cpu_object()->elf, name, {});
    if (!loaded.ok()) return nullptr;
    kept = *std::move(loaded);
  }
  return kept->FindAs<QualityFn>(name);
}

QualityFn GccQuality(const std::string& name) {
  static std::map<std::string, QualityFn> built;
  if (auto it = built.find(name); it != built.end()) return it->second;
  QualityFn fn = nullptr;
  const std::string base = Dir() + "/quality-" + name;
  std::ofstream(base + ".cc") << Kernel(name).source;
  if (Run({"g++", "-O3", "-march=native", "-shared", "-fPIC", "-o", base + ".so", base + ".cc"}) ==
      0) {
    void* h = dlopen((base + ".so").c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h != nullptr) fn = reinterpret_cast<QualityFn>(dlsym(h, name.c_str()));
  }
  return built[name] = fn;
}

void RunQuality(benchmark::State& state, const std::string& name, QualityFn fn) {
  if (fn == nullptr) {
    state.SkipWithError("kernel unavailable");
    return;
  }
  const QualityKernel& k = Kernel(name);
  const int64_t n = state.range(0);
  // 64-byte aligned, as tensors in opjit's regions are: both sides get the
  // same alignment, so vector loads never split differently between them.
  auto buffer = [](int64_t elems) {
    const size_t bytes = (static_cast<size_t>(elems) * sizeof(float) + 63) / 64 * 64;
    return std::unique_ptr<float, decltype(&std::free)>(
        static_cast<float*>(std::aligned_alloc(64, bytes)), &std::free);
  };
  auto a = buffer(k.in_elems(n)), b = buffer(k.in_elems(n)), out = buffer(k.out_elems(n));
  for (int64_t i = 0; i < k.in_elems(n); ++i) {
    a.get()[i] = static_cast<float>(i % 97) * 0.1f - 4.0f;
    b.get()[i] = static_cast<float>(i % 89) * 0.05f - 2.0f;
  }
  for (auto _ : state) {
    fn(a.get(), b.get(), out.get(), n);
    benchmark::ClobberMemory();
  }
}

// bench/run.sh runs with --benchmark_enable_random_interleaving, so the
// repetitions of the JIT and g++ sides alternate and see the same machine.
void BM_KernelJit(benchmark::State& state, const char* name) {
  RunQuality(state, name, JitQuality(name));
}
void BM_KernelGccO3Native(benchmark::State& state, const char* name) {
  RunQuality(state, name, GccQuality(name));
}
#define OPJIT_QUALITY(kind, small, large)                                                     \
  BENCHMARK_CAPTURE(BM_KernelJit, kind, #kind)                                                \
      ->Arg(small)                                                                            \
      ->Arg(large)                                                                            \
      ->Repetitions(5)                                                                        \
      ->Unit(benchmark::kMicrosecond);                                                        \
  BENCHMARK_CAPTURE(BM_KernelGccO3Native, kind, #kind)                                        \
      ->Arg(small)                                                                            \
      ->Arg(large)                                                                            \
      ->Repetitions(5)                                                                        \
      ->Unit(benchmark::kMicrosecond)
OPJIT_QUALITY(Elementwise, 16 << 10, 16 << 20);
OPJIT_QUALITY(Reduction, 16 << 10, 16 << 20);
OPJIT_QUALITY(Matmul, 64, 256);

}  // namespace

BENCHMARK_MAIN();
