// Toolchain profiles: named sets of include directories and libraries a
// kernel may use, which opjit knows how to find on the host, so that an
// operator enables them by name ([compiler] profiles = ["aten"]) instead of
// listing host paths, and a tenant selects one by naming one of its
// libraries in a compile or an implementation (`"libraries":
// ["libtorch_cpu.so", "libc10.so"]`), where the operator's policy lets its
// namespace ([toolchains.<name>] namespaces).
//
// The one built-in profile is "aten": PyTorch's ATen/libtorch C++ API as
// Debian's libtorch-dev installs it (with python3-dev's and pybind11-dev's
// headers, which <torch/extension.h> includes), for MindSpore's guide to
// third-party operator libraries (seed 003). Its prefix header,
// <torch/extension.h>, is precompiled once per daemon from that header alone
// and shared read-only by every compile that selects the profile
// (server/compiler/cpu/cpu_compiler.h, "profile PCH").
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace opjit::compiler {

struct ToolchainProfile {
  std::string name;                       // "aten"
  std::vector<std::string> include_dirs;  // host directories, searched after the configured ones
  std::vector<std::string> libraries;     // sonames kernels of the profile may link
  // The header a shared PCH is built from ("torch/extension.h"; "": none).
  std::string prefix_header;
  // Namespaces that may select it ("*": every one).
  std::vector<std::string> namespaces = {"*"};
  // Build the shared PCH when the daemon starts (else at the first compile
  // that selects the profile).
  bool pch_at_start = false;

  bool AllowsNamespace(const std::string& ns) const;
};

// The names of the built-in profiles, for the config's check.
const std::vector<std::string>& BuiltinProfileNames();

// The built-in profile `name` that names library `lib` ("libtorch_cpu.so" ->
// "aten"), found on this host or not; "" for none. Lets an error tell a
// tenant which profile a library needs.
std::string BuiltinProfileOfLibrary(const std::string& lib);

// Looks for the built-in profile `name` on this host (below `root`, "/" but
// for tests). NOT_FOUND, saying what is missing (host paths in it are for the
// operator's log only), when it is not installed; INVALID_ARGUMENT for an
// unknown name.
absl::StatusOr<ToolchainProfile> DetectProfile(const std::string& name,
                                               const std::string& root = "/");

}  // namespace opjit::compiler
