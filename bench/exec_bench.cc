// The executor in-process, with no RPC: the floor under the call-overhead
// rows of call_bench. The same cached tiny op (leaky_relu on 16 float32,
// inline in and out, alpha as text as the CLI sends it) through
// Executor::ForwardAsync, and the kernel instance alone.
//
//   exec_bench [--benchmark_* flags]
//
// Run through bench/run.sh; bench/report.py puts the median next to the
// call-overhead table.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "client/cpp/opjit_client.h"
#include "server/compiler/kernel_compiler.h"
#include "server/exec/executor.h"
#include "server/runner/in_process_runner.h"
#include "server/registry/registry.h"
#include "server/rpc/convert.h"
#include "server/tensor/region_manager.h"

namespace {

namespace fs = std::filesystem;
using namespace opjit;  // NOLINT: a benchmark's own file

constexpr int kTinyFloats = 16;

std::string BinDir() { return fs::read_symlink("/proc/self/exe").parent_path().string(); }

[[noreturn]] void Die(const std::string& what, const absl::Status& s) {
  fprintf(stderr, "exec_bench: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}

// Registry, compiler, regions and executor of one process, with leaky_relu
// registered and compiled.
struct Stack {
  std::string dir;
  std::unique_ptr<registry::Registry> registry;
  std::unique_ptr<compiler::KernelCompiler> compiler;
  std::unique_ptr<tensor::RegionManager> regions;
  std::unique_ptr<runner::KernelRunner> kernel_runner;
  std::unique_ptr<exec::Executor> executor;

  Stack() {
    std::string tmpl = (fs::temp_directory_path() / "opjit-exec-bench-XXXXXX").string();
    dir = mkdtemp(tmpl.data());
    auto reg = registry::Registry::Create({.db_path = dir + "/registry.db"});
    if (!reg.ok()) Die("registry", reg.status());
    registry = *std::move(reg);

    compiler::KernelCompilerOptions copts;
    copts.cache_dir = dir + "/cache";
    copts.worker_path = BinDir() + "/opjit-compile-worker";
    copts.kernel_include_dir = std::string(OPJIT_SOURCE_DIR) + "/kernels/include";
    auto kc = compiler::KernelCompiler::Create(copts);
    if (!kc.ok()) Die("compiler", kc.status());
    compiler = *std::move(kc);

    tensor::RegionManagerOptions ropts;
    ropts.instance_tag = "execbench" + std::to_string(getpid());
    auto rm = tensor::RegionManager::Create(ropts);
    if (!rm.ok()) Die("regions", rm.status());
    regions = *std::move(rm);

    auto rr = runner::InProcessRunner::Create({});
    if (!rr.ok()) Die("runner", rr.status());
    kernel_runner = *std::move(rr);
    auto ex = exec::Executor::Create({}, registry.get(), compiler.get(), regions.get(),
                                     kernel_runner.get());
    if (!ex.ok()) Die("executor", ex.status());
    executor = *std::move(ex);

    auto spec = client::LoadOpSpec(std::string(OPJIT_SOURCE_DIR) +
                                   "/kernels/examples/leaky_relu.json");
    if (!spec.ok()) Die("spec", spec.status());
    auto def = rpc::OpDefFromProto(*spec);
    if (!def.ok()) Die("spec", def.status());
    auto registered = registry->Register(*std::move(def));
    if (!registered.ok()) Die("register", registered.status());
  }
  ~Stack() {
    executor.reset();
    kernel_runner.reset();
    regions.reset();
    compiler.reset();
    registry.reset();
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

Stack& Shared() {
  static Stack* stack = new Stack();  // lives until exit
  return *stack;
}

const std::string& TinyBytes() {
  static const std::string bytes = [] {
    std::vector<float> x(kTinyFloats);
    for (int i = 0; i < kTinyFloats; ++i) x[i] = static_cast<float>(i) - 8.0f;
    return std::string(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(float));
  }();
  return bytes;
}

exec::ForwardCall TinyCall() {
  exec::ForwardCall call;
  call.op = "leaky_relu";
  exec::TensorArg x = exec::TensorArg::Inline({"float32", {kTinyFloats}}, TinyBytes());
  call.inputs = {{x}};
  exec::AttrArg alpha;
  alpha.is_text = true;
  alpha.text = "0.1";
  call.attrs["alpha"] = alpha;
  return call;
}

// What the rpc layer does per call: build the call, run it, take the result.
void BM_ExecutorForwardTiny(benchmark::State& state) {
  exec::Executor& ex = *Shared().executor;
  if (auto warm = ex.Forward(TinyCall()); !warm.ok()) {
    state.SkipWithError(std::string(warm.status().message()).c_str());
    return;
  }
  bool ok = true;
  for (auto _ : state) {
    ex.ForwardAsync(TinyCall(), [&ok](absl::StatusOr<exec::ForwardResult> r) {
      ok = ok && r.ok() && r->ran_inline && r->outputs.size() == 1 &&
           r->outputs[0].inline_bytes() != nullptr &&
           r->outputs[0].inline_bytes()->bytes.size() == kTinyFloats * sizeof(float);
      benchmark::DoNotOptimize(r);
    });
  }
  if (!ok) state.SkipWithError("a call failed or did not run inline");
}
BENCHMARK(BM_ExecutorForwardTiny)->Unit(benchmark::kMicrosecond)->Repetitions(5);

}  // namespace

BENCHMARK_MAIN();
