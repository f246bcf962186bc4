#include "tests/unit/loader/test_kernels.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace opjit::testing {
namespace {

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string CompileKernel(const std::string& source, const std::string& language,
                          const std::vector<std::string>& extra_flags) {
  static std::atomic<int> counter{0};
  namespace fs = std::filesystem;
  fs::path dir = fs::path(::testing::TempDir()) /
                 ("opjit_loader_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
  fs::create_directories(dir);
  const bool is_c = language == "c";
  fs::path src = dir / (is_c ? "kernel.c" : "kernel.cc");
  fs::path obj = dir / "kernel.o";
  fs::path err = dir / "clang.err";
  std::ofstream(src) << source;

  std::string cmd = std::string("/usr/lib/llvm-16/bin/clang") + (is_c ? "" : "++") +
                    " -c -O2 -march=native -I" OPJIT_SOURCE_DIR "/kernels/include -x " + language +
                    (is_c ? " -std=c11" : " -std=c++17");
  for (const std::string& f : extra_flags) cmd += " " + f;
  cmd += " '" + src.string() + "' -o '" + obj.string() + "' 2> '" + err.string() + "'";
  int rc = std::system(cmd.c_str());
  if (rc != 0) {
    ADD_FAILURE() << "clang failed (" << rc << "): " << cmd << "\n" << ReadFile(err);
    return "";
  }
  std::string bytes = ReadFile(obj);
  fs::remove_all(dir);
  return bytes;
}

}  // namespace opjit::testing
