// Shared fixtures for the registry tests.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>

#include "server/registry/op_def.h"

namespace opjit::registry::testing {

// A valid op: LeakyRelu-like, one input, one output, one float attr, CPU only.
inline OpDef ValidDef(const std::string& name = "leaky_relu") {
  OpDef def;
  def.ns = "default";
  def.name = name;
  def.inputs = {{0, "x", ParamType::kRequired}};
  def.outputs = {{0, "y", ParamType::kRequired}};
  def.attrs = {{"alpha", ParamType::kOptional, ValueType::kFloat, "0.1"}};
  def.dtype_formats = {{{{"float32", "DefaultFormat"}, {"float32", "DefaultFormat"}}},
                       {{{"float16", "DefaultFormat"}, {"float16", "DefaultFormat"}}}};
  Implementation impl;
  impl.target = Target::kCpu;
  impl.language = "c++";
  impl.entry = "CustomLeakyRelu";
  impl.source =
      "#include \"custom_aot_extra.h\"\n"
      "extern \"C\" int CustomLeakyRelu(int nparam, void** params, int* ndims, "
      "int64_t** shapes, const char** dtypes, void* stream, void* extra) { return 0; }\n";
  impl.compile_options = {"-O2"};
  def.implementations = {impl};
  def.doc = "y = x > 0 ? x : alpha * x";
  return def;
}

// A fresh directory under $TMPDIR (or /tmp), removed when the object dies.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "opjit_registry_XXXXXX");
    char* p = mkdtemp(tmpl.data());
    EXPECT_NE(p, nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace opjit::registry::testing
