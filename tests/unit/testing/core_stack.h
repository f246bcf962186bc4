// What unit tests above the compiler share: a registry, a compiler and a
// region manager in a temp directory of their own, optionally an executor
// over them, float32 op definitions, the example kernels' text, and float32
// byte helpers.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/compiler/kernel_compiler.h"
#include "server/exec/executor.h"
#include "server/registry/registry.h"
#include "server/runner/kernel_runner.h"
#include "server/tensor/region_manager.h"

namespace opjit::testing {

// Everything lives under `dir` (registry.db, cache/) and is removed with the
// object; shm regions carry an instance tag of `tag` and this process's pid,
// so tests running beside each other never see each other's.
struct CoreStack {
  static absl::StatusOr<std::unique_ptr<CoreStack>> Create(const std::string& tag,
                                                           int compile_workers = 2);
  ~CoreStack();

  // Creates `executor` over this stack with `runner` (kernels in this
  // process, an InProcessRunner, when null). Both go before the rest.
  absl::Status AddExecutor(std::unique_ptr<runner::KernelRunner> runner = nullptr);

  std::string dir;
  std::unique_ptr<registry::Registry> registry;
  std::unique_ptr<compiler::KernelCompiler> compiler;
  std::unique_ptr<tensor::RegionManager> regions;
  std::unique_ptr<runner::KernelRunner> runner;  // set by AddExecutor
  std::unique_ptr<exec::Executor> executor;      // set by AddExecutor
};

// An op of float32 tensors: required inputs and outputs by name, one CPU
// implementation (c++) of `source` with `entry`, no output rules.
registry::OpDef FloatOp(const std::string& name, const std::vector<std::string>& inputs,
                        const std::vector<std::string>& outputs, const std::string& source,
                        const std::string& entry);

// The text of kernels/examples/<name>: tests use the examples, not copies.
std::string ExampleSource(const std::string& name);

// float32 values as bytes, and back.
std::string Bytes(const std::vector<float>& v);
std::vector<float> Floats(const std::string& bytes);

}  // namespace opjit::testing
