#include "tests/unit/testing/core_stack.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "server/common/status_macros.h"
#include "server/runner/in_process_runner.h"

namespace opjit::testing {

namespace fs = std::filesystem;

absl::StatusOr<std::unique_ptr<CoreStack>> CoreStack::Create(const std::string& tag,
                                                             int compile_workers) {
  auto s = std::make_unique<CoreStack>();
  std::string tmpl = (fs::temp_directory_path() / ("opjit-" + tag + "-XXXXXX")).string();
  if (::mkdtemp(tmpl.data()) == nullptr) return absl::InternalError("mkdtemp failed");
  s->dir = tmpl;
  OPJIT_ASSIGN_OR_RETURN(s->registry, registry::Registry::Create({.db_path = s->dir + "/registry.db"}));
  compiler::KernelCompilerOptions co;
  co.cache_dir = s->dir + "/cache";
  co.worker_path = OPJIT_BINARY_DIR "/bin/opjit-compile-worker";
  co.kernel_include_dir = OPJIT_SOURCE_DIR "/kernels/include";
  co.workers = compile_workers;
  OPJIT_ASSIGN_OR_RETURN(s->compiler, compiler::KernelCompiler::Create(co));
  tensor::RegionManagerOptions ro;
  ro.instance_tag = absl::StrCat(tag, ::getpid());
  OPJIT_ASSIGN_OR_RETURN(s->regions, tensor::RegionManager::Create(ro));
  return s;
}

absl::Status CoreStack::AddExecutor(std::unique_ptr<runner::KernelRunner> with) {
  if (with == nullptr) {
    OPJIT_ASSIGN_OR_RETURN(std::unique_ptr<runner::InProcessRunner> in_process,
                           runner::InProcessRunner::Create({}));
    with = std::move(in_process);
  }
  runner = std::move(with);
  OPJIT_ASSIGN_OR_RETURN(executor, exec::Executor::Create({}, registry.get(), compiler.get(),
                                                          regions.get(), runner.get()));
  return absl::OkStatus();
}

CoreStack::~CoreStack() {
  executor.reset();
  runner.reset();
  regions.reset();
  compiler.reset();
  registry.reset();
  std::error_code ec;
  if (!dir.empty()) fs::remove_all(dir, ec);
}

registry::OpDef FloatOp(const std::string& name, const std::vector<std::string>& inputs,
                        const std::vector<std::string>& outputs, const std::string& source,
                        const std::string& entry) {
  registry::OpDef d;
  d.name = name;
  for (size_t i = 0; i < inputs.size(); ++i) {
    d.inputs.push_back({static_cast<int>(i), inputs[i], registry::ParamType::kRequired});
  }
  for (size_t j = 0; j < outputs.size(); ++j) {
    d.outputs.push_back({static_cast<int>(j), outputs[j], registry::ParamType::kRequired});
  }
  registry::DtypeFormat df;
  for (size_t k = 0; k < inputs.size() + outputs.size(); ++k) {
    df.io.emplace_back("float32", "DefaultFormat");
  }
  d.dtype_formats.push_back(df);
  registry::Implementation impl;
  impl.language = "c++";
  impl.source = source;
  impl.entry = entry;
  d.implementations.push_back(impl);
  return d;
}

std::string ExampleSource(const std::string& name) {
  std::ifstream in(std::string(OPJIT_SOURCE_DIR "/kernels/examples/") + name);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

std::vector<float> Floats(const std::string& bytes) {
  std::vector<float> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), out.size() * 4);
  return out;
}

}  // namespace opjit::testing
