#include "server/compiler/toolchain_profile.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace opjit::compiler {
namespace {

namespace fs = std::filesystem;

// The libraries of the "aten" profile; the first two are required.
const std::vector<std::string>& AtenLibraries() {
  static const std::vector<std::string>* libs =
      new std::vector<std::string>{"libtorch_cpu.so", "libc10.so", "libtorch.so"};
  return *libs;
}

bool IsFile(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// Where the dynamic linker finds a Debian package's libraries.
std::vector<fs::path> LibraryDirs(const fs::path& root) {
  std::vector<fs::path> dirs;
#if defined(__x86_64__)
  dirs.push_back(root / "usr/lib/x86_64-linux-gnu");
#elif defined(__aarch64__)
  dirs.push_back(root / "usr/lib/aarch64-linux-gnu");
#endif
  for (const char* d : {"usr/lib64", "usr/lib", "usr/local/lib"}) dirs.push_back(root / d);
  return dirs;
}

bool FindLibrary(const fs::path& root, const std::string& soname) {
  for (const fs::path& d : LibraryDirs(root)) {
    std::error_code ec;
    if (fs::exists(d / soname, ec)) return true;
  }
  return false;
}

// The newest usr/include/python3.N holding Python.h (python3-dev), or "".
std::string PythonIncludeDir(const fs::path& root) {
  int best_minor = -1;
  std::string best;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root / "usr/include", ec)) {
    const std::string name = e.path().filename().string();
    int minor = 0;
    if (!absl::StartsWith(name, "python3.") ||
        !absl::SimpleAtoi(name.substr(sizeof("python3.") - 1), &minor)) {
      continue;
    }
    if (minor > best_minor && IsFile(e.path() / "Python.h")) {
      best_minor = minor;
      best = e.path().string();
    }
  }
  return best;
}

absl::StatusOr<ToolchainProfile> DetectAten(const fs::path& root) {
  ToolchainProfile p;
  p.name = "aten";
  p.prefix_header = "torch/extension.h";
  const fs::path api = root / "usr/include/torch/csrc/api/include";
  std::vector<std::string> missing;
  if (!IsFile(root / "usr/include/torch/extension.h") || !IsFile(api / "torch/all.h") ||
      !IsFile(root / "usr/include/ATen/ATen.h")) {
    missing.push_back("libtorch's headers (libtorch-dev)");
  }
  const std::string python = PythonIncludeDir(root);
  if (python.empty()) missing.push_back("Python's headers (python3-dev)");
  if (!IsFile(root / "usr/include/pybind11/pybind11.h")) {
    missing.push_back("pybind11's headers (pybind11-dev)");
  }
  for (const std::string& lib : AtenLibraries()) {
    if (FindLibrary(root, lib)) {
      p.libraries.push_back(lib);
    } else if (lib != "libtorch.so") {
      missing.push_back(absl::StrCat(lib, " (libtorch-dev)"));
    }
  }
  if (!missing.empty()) {
    return absl::NotFoundError(absl::StrCat("not installed: ", absl::StrJoin(missing, ", ")));
  }
  p.include_dirs = {api.lexically_normal().string(), fs::path(python).lexically_normal().string()};
  return p;
}

}  // namespace

bool ToolchainProfile::AllowsNamespace(const std::string& ns) const {
  return std::any_of(namespaces.begin(), namespaces.end(),
                     [&](const std::string& n) { return n == "*" || n == ns; });
}

const std::vector<std::string>& BuiltinProfileNames() {
  static const std::vector<std::string>* names = new std::vector<std::string>{"aten"};
  return *names;
}

std::string BuiltinProfileOfLibrary(const std::string& lib) {
  const auto& aten = AtenLibraries();
  return std::find(aten.begin(), aten.end(), lib) != aten.end() ? "aten" : "";
}

absl::StatusOr<ToolchainProfile> DetectProfile(const std::string& name, const std::string& root) {
  if (name == "aten") return DetectAten(fs::path(root));
  return absl::InvalidArgumentError(absl::StrCat("unknown toolchain profile \"", name,
                                                 "\" (known: ",
                                                 absl::StrJoin(BuiltinProfileNames(), ", "), ")"));
}

}  // namespace opjit::compiler
