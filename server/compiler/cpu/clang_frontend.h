// The clang/LLVM side of `opjit-compile-worker`: turns one WorkerRequest into
// one WorkerResponse, in-process, with clang 16's libraries. This header is
// free of LLVM and clang headers; clang_frontend.cc is the only translation
// unit of opjit that includes them for the CPU compiler.
//
// Not thread-safe: the worker serves one request at a time.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "server/compiler/cpu/ipc.h"

namespace opjit::compiler {

// Called when LLVM reports a fatal error or an allocation fails; must not
// return. `message` is NUL-terminated and may be empty.
using FatalErrorCallback = void (*)(const char* message, bool out_of_memory);

// Registers the native target with LLVM and installs `on_fatal` as LLVM's
// fatal-error and bad-alloc handler. Call once, before ClangFrontend::Create.
void InitializeLlvm(FatalErrorCallback on_fatal);

class ClangFrontend {
 public:
  // `clang_path` is the real clang binary; the driver derives the resource
  // directory and the system include directories from it. Returns null and
  // sets `*error` when the driver cannot produce a compile job.
  static std::unique_ptr<ClangFrontend> Create(const std::string& clang_path, std::string* error);
  ~ClangFrontend();

  // The toolchain facts that change object bytes (see ipc::Hello).
  const ipc::Hello& Describe() const;

  // The files and directories compiles read (besides the request's include
  // directories): the toolchain's tree, the system include directories and
  // the GCC installation the driver found. The worker's Landlock rules allow
  // these and nothing else of the file system.
  const std::vector<std::string>& ReadPaths() const;

  // Runs one request. `pch_fd` is the descriptor that came with it (-1: none;
  // see ipc::PchUse), closed before returning. Never throws; compile errors
  // come back as kCompileError with clang's diagnostics.
  ipc::WorkerResponse Handle(const ipc::WorkerRequest& request, int pch_fd);

 private:
  struct Impl;
  explicit ClangFrontend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace opjit::compiler
