// The only translation unit of the CPU compiler that includes clang and LLVM
// headers (they take ~30 s and 1 GB to compile; keep them here).
//
// One compile:
//   driver (fixed flags + user options) -> cc1 arguments (cached per argv)
//   -> CompilerInvocation -> EmitLLVMOnlyAction (parses, runs the -O pipeline)
//   -> lower llvm.global_ctors/dtors into __opjit_run_ctors/__opjit_run_dtors
//   -> clang::EmitBackendOutput with DisableLLVMPasses (codegen only, with
//      clang's own TargetMachine setup) -> object bytes in memory.
// Every file read goes through SandboxFileSystem, an allow-list in front of the
// real file system; the preamble header and its PCH are served from memory
// (ipc::kPchVirtualDir), the PCH from the one descriptor the daemon passed,
// and so are the request's extra files (ipc::kFilesVirtualDir, searched
// first): headers, and translation units that are compiled alike and linked
// (llvm::Linker) into the main module before code generation.
// Code generation runs on a thread locked out of every file
// (sandbox::DenyFilesToThisThread): the integrated assembler opens `.incbin`
// and `.include` files itself, past clang's file system.

#include "server/compiler/cpu/clang_frontend.h"
#include "server/compiler/cpu/preamble.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "clang/Basic/Diagnostic.h"
#include "clang/Basic/DiagnosticOptions.h"
#include "clang/Basic/TargetInfo.h"
#include "clang/Basic/Version.h"
#include "clang/CodeGen/BackendUtil.h"
#include "clang/CodeGen/CodeGenAction.h"
#include "clang/Driver/Compilation.h"
#include "clang/Driver/Driver.h"
#include "clang/Driver/Job.h"
#include "clang/Frontend/CompilerInstance.h"
#include "clang/Frontend/CompilerInvocation.h"
#include "clang/Frontend/FrontendActions.h"
#include "clang/Frontend/MultiplexConsumer.h"
#include "clang/Frontend/TextDiagnosticPrinter.h"
#include "clang/Frontend/Utils.h"
#include "clang/Lex/HeaderSearchOptions.h"
#include "clang/Lex/PreprocessorOptions.h"
#include "clang/Serialization/ASTWriter.h"
#include "clang/Serialization/PCHContainerOperations.h"
#include "llvm/ADT/SmallString.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/IR/Constants.h"
#include "llvm/IR/DiagnosticHandler.h"
#include "llvm/IR/DiagnosticInfo.h"
#include "llvm/IR/DiagnosticPrinter.h"
#include "llvm/IR/Function.h"
#include "llvm/IR/InlineAsm.h"
#include "llvm/IR/Instructions.h"
#include "llvm/IR/GlobalVariable.h"
#include "llvm/IR/IRBuilder.h"
#include "llvm/IR/LLVMContext.h"
#include "llvm/IR/Module.h"
#include "llvm/Linker/Linker.h"
#include "llvm/Support/ErrorHandling.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Host.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/TargetSelect.h"
#include "llvm/Support/VirtualFileSystem.h"
#include "llvm/Support/raw_ostream.h"
#include "server/common/sandbox.h"
#include "server/compiler/compile_options.h"

namespace opjit::compiler {
namespace {

FatalErrorCallback g_on_fatal = nullptr;

void OnLlvmFatalError(void* /*user_data*/, const char* reason, bool /*gen_crash_diag*/) {
  if (g_on_fatal != nullptr) g_on_fatal(reason != nullptr ? reason : "", false);
  _exit(70);
}

void OnLlvmBadAlloc(void* /*user_data*/, const char* reason, bool /*gen_crash_diag*/) {
  if (g_on_fatal != nullptr) g_on_fatal(reason != nullptr ? reason : "", true);
  _exit(71);
}

// Lexically normalised absolute path: `path` made absolute against `cwd`, with
// "." and ".." removed (no file system access).
std::string NormalizePath(llvm::StringRef path, llvm::StringRef cwd) {
  llvm::SmallString<256> p(path);
  if (!llvm::sys::path::is_absolute(p)) {
    llvm::SmallString<256> abs(cwd);
    llvm::sys::path::append(abs, p);
    p = abs;
  }
  llvm::sys::path::remove_dots(p, /*remove_dot_dot=*/true);
  llvm::sys::path::native(p);
  std::string out(p.str());
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

bool IsUnder(llvm::StringRef path, llvm::StringRef dir) {
  if (!path.startswith(dir)) return false;
  return path.size() == dir.size() || path[dir.size()] == '/' || dir == "/";
}

// An allow-list file system: answers "no such file" for every path outside
// the allowed directories and files, checking both the lexically normalised
// path and its real path (symlinks must not escape). `exact` paths (the
// directories that hold the main file and the PCH) may be stat'ed but nothing
// below them is allowed through them.
class SandboxFileSystem : public llvm::vfs::ProxyFileSystem {
 public:
  SandboxFileSystem(llvm::IntrusiveRefCntPtr<llvm::vfs::FileSystem> fs,
                    const std::vector<std::string>& dirs, const std::vector<std::string>& files,
                    const std::vector<std::string>& exact)
      : ProxyFileSystem(std::move(fs)) {
    for (const std::string& d : dirs) {
      std::string n = NormalizePath(d, "/");
      dirs_.push_back(n);
      llvm::SmallString<256> real;
      if (!llvm::sys::fs::real_path(n, real)) real_dirs_.push_back(std::string(real.str()));
    }
    for (const std::string& f : files) {
      std::string n = NormalizePath(f, "/");
      files_.insert(n);
      llvm::SmallString<256> real;
      if (!llvm::sys::fs::real_path(n, real)) files_.insert(std::string(real.str()));
    }
    for (const std::string& e : exact) exact_.insert(NormalizePath(e, "/"));
  }

  llvm::ErrorOr<llvm::vfs::Status> status(const llvm::Twine& path) override {
    if (!Allowed(path)) return std::make_error_code(std::errc::no_such_file_or_directory);
    return ProxyFileSystem::status(path);
  }
  llvm::ErrorOr<std::unique_ptr<llvm::vfs::File>> openFileForRead(
      const llvm::Twine& path) override {
    if (!Allowed(path, /*stat_only=*/false)) {
      return std::make_error_code(std::errc::no_such_file_or_directory);
    }
    return ProxyFileSystem::openFileForRead(path);
  }
  llvm::vfs::directory_iterator dir_begin(const llvm::Twine& dir, std::error_code& ec) override {
    if (!Allowed(dir, /*stat_only=*/false)) {
      ec = std::make_error_code(std::errc::no_such_file_or_directory);
      return {};
    }
    return ProxyFileSystem::dir_begin(dir, ec);
  }
  std::error_code getRealPath(const llvm::Twine& path,
                              llvm::SmallVectorImpl<char>& output) const override {
    if (!const_cast<SandboxFileSystem*>(this)->Allowed(path)) {
      return std::make_error_code(std::errc::no_such_file_or_directory);
    }
    return ProxyFileSystem::getRealPath(path, output);
  }

 private:
  bool Allowed(const llvm::Twine& path_twine, bool stat_only = true) {
    llvm::SmallString<256> storage;
    llvm::StringRef raw = path_twine.toStringRef(storage);
    std::string key = (stat_only ? "s:" : "o:") + raw.str();
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    bool ok = Decide(raw, stat_only);
    cache_[key] = ok;
    return ok;
  }

  bool Decide(llvm::StringRef raw, bool stat_only) {
    llvm::ErrorOr<std::string> cwd = getUnderlyingFS().getCurrentWorkingDirectory();
    std::string path = NormalizePath(raw, cwd ? *cwd : std::string("/"));
    if (stat_only && exact_.count(path) != 0) return true;
    bool lexical_ok = files_.count(path) != 0 ||
                      std::any_of(dirs_.begin(), dirs_.end(),
                                  [&](const std::string& d) { return IsUnder(path, d); });
    if (!lexical_ok) return false;
    llvm::SmallString<256> real;
    // A path that does not resolve does not exist; refusing it costs nothing.
    if (llvm::sys::fs::real_path(path, real)) return false;
    llvm::StringRef r = real.str();
    return files_.count(r.str()) != 0 ||
           std::any_of(real_dirs_.begin(), real_dirs_.end(),
                       [&](const std::string& d) { return IsUnder(r, d); });
  }

  std::vector<std::string> dirs_;
  std::vector<std::string> real_dirs_;
  std::set<std::string> files_;
  std::set<std::string> exact_;
  std::map<std::string, bool> cache_;
};

// Records every file clang read, system headers and PCH inputs included.
class DependencyRecorder : public clang::DependencyCollector {
 public:
  bool needSystemDependencies() override { return true; }
};

// Routes LLVM backend diagnostics (inline asm errors, ...) into the
// diagnostics text instead of stderr, and counts errors.
class BackendDiagnostics : public llvm::DiagnosticHandler {
 public:
  BackendDiagnostics(llvm::raw_ostream& os, int* errors) : os_(os), errors_(errors) {}
  bool handleDiagnostics(const llvm::DiagnosticInfo& di) override {
    if (di.getSeverity() == llvm::DS_Remark || di.getSeverity() == llvm::DS_Note) return true;
    if (di.getSeverity() == llvm::DS_Error) ++*errors_;
    os_ << (di.getSeverity() == llvm::DS_Error ? "error: " : "warning: ");
    llvm::DiagnosticPrinterRawOStream printer(os_);
    di.print(printer);
    os_ << "\n";
    return true;
  }

 private:
  llvm::raw_ostream& os_;
  int* errors_;
};

// Replaces the `array_name` global (llvm.global_ctors or llvm.global_dtors)
// with an exported `void fn_name(void)` that calls each entry in the order the
// ELF runtime would: constructors by ascending priority, destructors by
// descending priority and reverse order. Always defines `fn_name`.
void LowerStructors(llvm::Module& m, llvm::StringRef array_name, llvm::StringRef fn_name,
                    bool destructors) {
  struct Entry {
    uint64_t priority;
    size_t index;
    llvm::Constant* fn;
  };
  std::vector<Entry> entries;
  if (llvm::GlobalVariable* gv = m.getNamedGlobal(array_name)) {
    if (gv->hasInitializer()) {
      if (auto* array = llvm::dyn_cast<llvm::ConstantArray>(gv->getInitializer())) {
        for (unsigned i = 0; i < array->getNumOperands(); ++i) {
          auto* cs = llvm::dyn_cast<llvm::ConstantStruct>(array->getOperand(i));
          if (cs == nullptr || cs->getNumOperands() < 2) continue;
          auto* prio = llvm::dyn_cast<llvm::ConstantInt>(cs->getOperand(0));
          llvm::Constant* fn = cs->getOperand(1);
          if (prio == nullptr || llvm::isa<llvm::ConstantPointerNull>(fn)) continue;
          entries.push_back({prio->getZExtValue(), i, fn});
        }
      }
    }
    gv->eraseFromParent();
  }
  std::stable_sort(entries.begin(), entries.end(), [&](const Entry& a, const Entry& b) {
    if (destructors) {
      return a.priority != b.priority ? a.priority > b.priority : a.index > b.index;
    }
    return a.priority < b.priority;
  });
  llvm::LLVMContext& ctx = m.getContext();
  auto* fn_type = llvm::FunctionType::get(llvm::Type::getVoidTy(ctx), /*isVarArg=*/false);
  llvm::Function* runner =
      llvm::Function::Create(fn_type, llvm::GlobalValue::ExternalLinkage, fn_name, m);
  runner->setVisibility(llvm::GlobalValue::DefaultVisibility);
  // Keep unwind info so an exception thrown by a static constructor can
  // propagate to the loader.
  runner->setUWTableKind(llvm::UWTableKind::Default);
  llvm::IRBuilder<> b(llvm::BasicBlock::Create(ctx, "entry", runner));
  for (const Entry& e : entries) {
    if (auto* f = llvm::dyn_cast<llvm::Function>(e.fn->stripPointerCasts())) {
      b.CreateCall(f->getFunctionType(), f);
    } else {
      b.CreateCall(fn_type, e.fn);
    }
  }
  b.CreateRetVoid();
}

// The preamble header and its PCH, as a compile sees them (in memory).
const std::string& VirtualPreamble() {
  static const std::string* p = new std::string(std::string(ipc::kPchVirtualDir) + "/preamble.h");
  return *p;
}
const std::string& VirtualPch() {
  static const std::string* p = new std::string(std::string(ipc::kPchVirtualDir) + "/preamble.pch");
  return *p;
}

// Where a compile sees the request's extra file `name`.
std::string FilePath(const std::string& name) {
  return std::string(ipc::kFilesVirtualDir) + "/" + name;
}

// Whether an extra file is a translation unit (registry::IsTranslationUnit's
// rule: .c .cc .cpp .cxx), compiled and linked rather than only included.
bool IsUnit(llvm::StringRef name) {
  return name.endswith(".c") || name.endswith(".cc") || name.endswith(".cpp") ||
         name.endswith(".cxx");
}

// Why `name` may not name an extra file ("" when it may): a relative path
// of non-empty parts other than "." and "..", no backslash or control byte.
std::string FileNameRefusal(llvm::StringRef name) {
  if (name.empty() || name.size() > 255) return "must be 1 to 255 bytes";
  if (name.front() == '/') return "must be relative";
  for (char c : name) {
    if (c == '\\' || static_cast<unsigned char>(c) < 0x20) {
      return "must not hold a backslash or a control character";
    }
  }
  llvm::SmallVector<llvm::StringRef, 8> parts;
  name.split(parts, '/');
  for (llvm::StringRef p : parts) {
    if (p.empty() || p == "." || p == "..") return "must not have an empty, \".\" or \"..\" part";
  }
  return "";
}

// Builds a PCH into memory (`*out`) instead of a file: the worker never
// writes the PCH directory; the daemon stores what it returns.
class PchToMemoryAction : public clang::GeneratePCHAction {
 public:
  explicit PchToMemoryAction(std::string* out) : out_(out) {}

 protected:
  std::unique_ptr<clang::ASTConsumer> CreateASTConsumer(clang::CompilerInstance& ci,
                                                        llvm::StringRef) override {
    std::string sysroot;
    if (!ComputeASTConsumerArguments(ci, sysroot)) return nullptr;
    if (!ci.getFrontendOpts().RelocatablePCH) sysroot.clear();
    auto buffer = std::make_shared<clang::PCHBuffer>();
    std::vector<std::unique_ptr<clang::ASTConsumer>> consumers;
    consumers.push_back(std::make_unique<clang::PCHGenerator>(
        ci.getPreprocessor(), ci.getModuleCache(), VirtualPch(), sysroot, buffer,
        ci.getFrontendOpts().ModuleFileExtensions,
        /*AllowASTWithErrors=*/false, static_cast<bool>(ci.getFrontendOpts().IncludeTimestamps)));
    consumers.push_back(std::make_unique<Capture>(buffer, out_));
    return std::make_unique<clang::MultiplexConsumer>(std::move(consumers));
  }

 private:
  // Runs after the generator: keeps its bytes once they are complete.
  class Capture : public clang::ASTConsumer {
   public:
    Capture(std::shared_ptr<clang::PCHBuffer> buffer, std::string* out)
        : buffer_(std::move(buffer)), out_(out) {}
    void HandleTranslationUnit(clang::ASTContext&) override {
      if (buffer_->IsComplete) out_->assign(buffer_->Data.begin(), buffer_->Data.end());
    }

   private:
    std::shared_ptr<clang::PCHBuffer> buffer_;
    std::string* out_;
  };
  std::string* out_;
};

// Runs `fn` on a thread of its own that is locked out of every file
// (sandbox::DenyFilesToThisThread), with a 64 MiB stack (code generation
// recurses). False, with `*error` set, when the lock could not be taken (then
// `fn` did not run).
bool RunWithoutFiles(const std::function<void()>& fn, std::string* error) {
  struct Job {
    const std::function<void()>* fn;
    std::string error;
  } job{&fn, {}};
  auto body = [](void* arg) -> void* {
    Job* j = static_cast<Job*>(arg);
    absl::Status s = sandbox::DenyFilesToThisThread();
    if (!s.ok()) {
      j->error = std::string(s.message());
      return nullptr;
    }
    (*j->fn)();
    return nullptr;
  };
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 64u << 20);
  pthread_t t;
  const int rc = pthread_create(&t, &attr, body, &job);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    *error = "cannot start the code generation thread";
    return false;
  }
  pthread_join(t, nullptr);
  if (!job.error.empty()) {
    *error = job.error;
    return false;
  }
  return true;
}

// Whether an inline assembly text names a directive that reads a file.
bool ReadsAFile(llvm::StringRef text) {
  const std::string lower = text.lower();
  return lower.find(".incbin") != std::string::npos || lower.find(".include") != std::string::npos;
}

// Whether the module's inline assembly (file-scope or in a function) asks the
// assembler to read a file. Macros could spell the directive in pieces; the
// code generation thread has no file access either way (RunWithoutFiles).
bool AsmReadsFiles(const llvm::Module& m) {
  if (ReadsAFile(m.getModuleInlineAsm())) return true;
  for (const llvm::Function& f : m) {
    for (const llvm::BasicBlock& bb : f) {
      for (const llvm::Instruction& i : bb) {
        const auto* call = llvm::dyn_cast<llvm::CallBase>(&i);
        if (call == nullptr || !call->isInlineAsm()) continue;
        const auto* ia = llvm::cast<llvm::InlineAsm>(call->getCalledOperand());
        if (ReadsAFile(ia->getAsmString())) return true;
      }
    }
  }
  return false;
}

}  // namespace

void InitializeLlvm(FatalErrorCallback on_fatal) {
  g_on_fatal = on_fatal;
  llvm::install_fatal_error_handler(OnLlvmFatalError, nullptr);
  llvm::install_bad_alloc_error_handler(OnLlvmBadAlloc, nullptr);
  llvm::InitializeNativeTarget();
  llvm::InitializeNativeTargetAsmPrinter();
  llvm::InitializeNativeTargetAsmParser();
}

struct ClangFrontend::Impl {
  std::string clang_path;
  ipc::Hello hello;
  std::vector<std::string> read_paths;
  // Driver output per driver argv: running the driver probes the GCC
  // installation, which costs more than looking it up.
  std::map<std::vector<std::string>, std::vector<std::string>> cc1_cache;

  // The outcome of one frontend run.
  struct Attempt {
    bool setup_failed = false;  // BeginSourceFile failed (PCH unusable, ...)
    bool ok = false;
    std::string diagnostics;
    std::string object;
    std::vector<std::string> dependencies;
  };

  // The driver command line. Compiles load the PCH (at its virtual path) when
  // `use_pch`; a PCH build (`for_pch`) makes it from the preamble header.
  // Both share every flag but the input and the action, as PCH use requires.
  // `unit` (an extra translation unit's virtual path) replaces the main
  // file as the input, compiled as C for a .c name and C++ otherwise.
  std::vector<std::string> DriverArgs(const ipc::WorkerRequest& req, bool for_pch,
                                      bool use_pch, const std::string& unit = "") const {
    bool cxx = for_pch || req.language == ipc::Language::kCxx;
    if (!unit.empty()) cxx = !llvm::StringRef(unit).endswith(".c");
    std::vector<std::string> a = {clang_path};
    if (for_pch) {
      // Templates the preamble itself instantiates are instantiated once,
      // in the PCH, not again in every kernel that loads it (ATen's
      // headers: -3 s per kernel), as CMake's precompiled headers do.
      a.insert(a.end(), {"-x", "c++-header", "-fpch-instantiate-templates"});
    } else {
      a.insert(a.end(), {"-c", "-x", cxx ? "c++" : "c"});
    }
    a.insert(a.end(), {"-O3", "-march=native", "-fPIC", cxx ? "-std=c++17" : "-std=c17"});
#if defined(__x86_64__)
    // Loops over math calls (expf, logf, ...) vectorize to glibc's libmvec,
    // as g++ does under -ffast-math; clang does it where the call cannot set
    // errno (-fno-math-errno or -ffast-math). Kernel hosts load libmvec.
    // (clang 16 maps sin, cos, exp, log and pow; not tanh.)
    a.push_back("-fveclib=libmvec");
#endif
    const std::vector<std::string>& opts = for_pch ? req.pch_options : req.options;
    a.insert(a.end(), opts.begin(), opts.end());
    if (!req.files.empty()) {
      // The kernel's own files first, as `-I.` beside a source would be;
      // __FILE__ names them by their relative name.
      a.insert(a.end(), {"-I", ipc::kFilesVirtualDir});
      a.push_back(std::string("-fmacro-prefix-map=") + ipc::kFilesVirtualDir + "/=");
    }
    for (const std::string& d : req.include_dirs) a.insert(a.end(), {"-I", d});
    // __FILE__ in a header names its include dir by place ("include0/..."),
    // not by host path: an object is the same bytes under any install prefix,
    // as its cache key is (server/compiler/cache_key.h), and messages built
    // from __FILE__ (TORCH_CHECK's) show no host path. The longest matching
    // prefix wins.
    for (size_t i = 0; i < req.include_dirs.size(); ++i) {
      a.push_back("-fmacro-prefix-map=" + req.include_dirs[i] + "=include" + std::to_string(i));
    }
    if (!for_pch && use_pch) {
      // A header touched but unchanged keeps the PCH valid. (An extra unit
      // loads only a profile's prefix PCH: ipc::WorkerRequest::pch_prefix.)
      a.insert(a.end(), {"-include-pch", VirtualPch(), "-fpch-validate-input-files-content"});
    }
    if (for_pch) {
      a.insert(a.end(), {VirtualPreamble(), "-o", VirtualPch()});
    } else {
      a.push_back(unit.empty() ? req.file_name : unit);
    }
    return a;
  }

  // Runs the driver for `argv` and returns the cc1 arguments (without
  // "-cc1"). Driver errors go to `diags`.
  bool Cc1Args(const std::vector<std::string>& argv, clang::DiagnosticsEngine& diags,
               std::vector<std::string>* out) {
    auto it = cc1_cache.find(argv);
    if (it != cc1_cache.end()) {
      *out = it->second;
      return true;
    }
    clang::driver::Driver driver(clang_path, llvm::sys::getDefaultTargetTriple(), diags);
    driver.setCheckInputsExist(false);
    std::vector<const char*> cargv;
    for (const std::string& s : argv) cargv.push_back(s.c_str());
    std::unique_ptr<clang::driver::Compilation> c(driver.BuildCompilation(cargv));
    if (!c || c->containsError() || diags.hasErrorOccurred()) return false;
    for (const clang::driver::Command& cmd : c->getJobs()) {
      const llvm::opt::ArgStringList& args = cmd.getArguments();
      if (args.empty() || llvm::StringRef(args[0]) != "-cc1") continue;
      out->assign(args.begin() + 1, args.end());
      if (cc1_cache.size() > 256) cc1_cache.clear();
      cc1_cache[argv] = *out;
      return true;
    }
    return false;
  }

  // Builds the invocation for `argv`; errors are written to `diag_os`.
  std::shared_ptr<clang::CompilerInvocation> MakeInvocation(const std::vector<std::string>& argv,
                                                            llvm::raw_ostream& diag_os) {
    llvm::IntrusiveRefCntPtr<clang::DiagnosticOptions> opts(new clang::DiagnosticOptions);
    opts->ShowColors = false;
    clang::TextDiagnosticPrinter printer(diag_os, opts.get());
    clang::DiagnosticsEngine diags(new clang::DiagnosticIDs, opts, &printer,
                                   /*ShouldOwnClient=*/false);
    std::vector<std::string> cc1;
    if (!Cc1Args(argv, diags, &cc1)) {
      if (!diags.hasErrorOccurred()) diag_os << "error: the clang driver produced no compile job\n";
      return nullptr;
    }
    std::vector<const char*> cargs;
    for (const std::string& s : cc1) cargs.push_back(s.c_str());
    auto inv = std::make_shared<clang::CompilerInvocation>();
    if (!clang::CompilerInvocation::CreateFromArgs(*inv, cargs, diags, clang_path.c_str()) ||
        diags.hasErrorOccurred()) {
      return nullptr;
    }
    // The driver asks for a leaky, fast exit; a long-lived worker must free.
    inv->getFrontendOpts().DisableFree = false;
    inv->getDiagnosticOpts().ShowColors = false;
    return inv;
  }

  // Sets up a CompilerInstance reading through the sandbox, with the
  // preamble header (when `req` has one) and `pch` (when not null) in memory.
  std::shared_ptr<DependencyRecorder> Prepare(clang::CompilerInstance& ci,
                                              std::shared_ptr<clang::CompilerInvocation> inv,
                                              llvm::raw_ostream& diag_os,
                                              const ipc::WorkerRequest& req,
                                              const llvm::MemoryBuffer* pch) {
    ci.setInvocation(inv);
    ci.setVerboseOutputStream(std::make_unique<llvm::raw_null_ostream>());
    ci.createDiagnostics(new clang::TextDiagnosticPrinter(diag_os, &inv->getDiagnosticOpts()),
                         /*ShouldOwnClient=*/true);
    std::vector<std::string> dirs;
    for (const auto& e : inv->getHeaderSearchOpts().UserEntries) dirs.push_back(e.Path);
    dirs.push_back(inv->getHeaderSearchOpts().ResourceDir + "/include");
    llvm::IntrusiveRefCntPtr<llvm::vfs::FileSystem> sandbox(
        new SandboxFileSystem(llvm::vfs::getRealFileSystem(), dirs, {}, {"/"}));
    llvm::IntrusiveRefCntPtr<llvm::vfs::OverlayFileSystem> fs(
        new llvm::vfs::OverlayFileSystem(sandbox));
    if (!req.preamble.empty() || !req.files.empty() || pch != nullptr) {
      // The same time stamp whenever the PCH is built or loaded: the PCH
      // records it, and the content is the key's (the files' too: the
      // daemon keys a PCH by them).
      llvm::IntrusiveRefCntPtr<llvm::vfs::InMemoryFileSystem> memory(
          new llvm::vfs::InMemoryFileSystem);
      for (const ipc::File& f : req.files) {
        const std::string path = FilePath(f.name);
        memory->addFile(path, /*ModificationTime=*/1,
                        llvm::MemoryBuffer::getMemBufferCopy(f.content, path));
      }
      if (!req.preamble.empty()) {
        memory->addFile(VirtualPreamble(), /*ModificationTime=*/1,
                        llvm::MemoryBuffer::getMemBufferCopy(req.preamble, VirtualPreamble()));
      }
      if (pch != nullptr) {
        memory->addFile(VirtualPch(), /*ModificationTime=*/1,
                        llvm::MemoryBuffer::getMemBuffer(pch->getBuffer(), VirtualPch(),
                                                         /*RequiresNullTerminator=*/false));
      }
      fs->pushOverlay(memory);
    }
    ci.createFileManager(fs);
    auto deps = std::make_shared<DependencyRecorder>();
    ci.addDependencyCollector(deps);
    return deps;
  }

  std::vector<std::string> CleanDependencies(const std::vector<std::string>& raw,
                                             const ipc::WorkerRequest& req) const {
    std::set<std::string> out;
    for (const std::string& d : raw) {
      if (d == req.file_name) continue;  // the in-memory main file
      std::string n = NormalizePath(d, "/");
      if (IsUnder(n, ipc::kPchVirtualDir)) continue;  // the preamble and its PCH
      if (IsUnder(n, ipc::kFilesVirtualDir)) continue;  // the request's files (in its key)
      llvm::SmallString<256> real;
      if (!llvm::sys::fs::real_path(n, real)) n = std::string(real.str());
      out.insert(n);
    }
    return {out.begin(), out.end()};
  }

  // Compiles `req`, with `pch` (the PCH of its preamble, or a profile's
  // prefix PCH for the units the request names) when not null.
  Attempt Compile(const ipc::WorkerRequest& req, const llvm::MemoryBuffer* pch) {
    Attempt at;
    llvm::raw_string_ostream diag_os(at.diagnostics);
    const bool main_pch = pch != nullptr && (!req.pch_prefix || req.prefix_main);
    std::shared_ptr<clang::CompilerInvocation> inv =
        MakeInvocation(DriverArgs(req, /*for_pch=*/false, main_pch), diag_os);
    if (inv == nullptr) return at;
    // With the preamble's PCH, the preamble it stands for is blanked (lines
    // stay put); a prefix PCH stands for no bytes of the source.
    const std::string source = pch == nullptr || req.pch_prefix
                                   ? req.source
                                   : BlankPreamble(req.source, req.preamble_bytes);
    inv->getPreprocessorOpts().addRemappedFile(
        req.file_name, llvm::MemoryBuffer::getMemBufferCopy(source, req.file_name).release());

    clang::CompilerInstance ci;
    std::shared_ptr<DependencyRecorder> deps = Prepare(ci, inv, diag_os, req, pch);
    if (!ci.createTarget()) return at;
    llvm::LLVMContext ctx;
    clang::EmitLLVMOnlyAction action(&ctx);
    const clang::FrontendInputFile& input = inv->getFrontendOpts().Inputs[0];
    if (!action.BeginSourceFile(ci, input)) {
      at.setup_failed = true;
      return at;
    }
    if (llvm::Error e = action.Execute()) {
      diag_os << "error: " << llvm::toString(std::move(e)) << "\n";
      action.EndSourceFile();
      return at;
    }
    action.EndSourceFile();
    std::unique_ptr<llvm::Module> module = action.takeModule();
    if (ci.getDiagnostics().hasErrorOccurred() || module == nullptr) return at;
    std::vector<std::string> dependencies = deps->getDependencies();
    // The extra translation units, each compiled alike (without the PCH)
    // and linked into the main module: one object, as before.
    int link_errors = 0;
    for (const ipc::File& f : req.files) {
      if (!IsUnit(f.name)) continue;
      const bool unit_pch = pch != nullptr && req.pch_prefix &&
                            std::find(req.prefix_units.begin(), req.prefix_units.end(),
                                      f.name) != req.prefix_units.end();
      std::unique_ptr<llvm::Module> unit =
          CompileUnit(req, f.name, ctx, diag_os, &dependencies, unit_pch ? pch : nullptr,
                      &at.setup_failed);
      if (unit == nullptr) return at;
      ctx.setDiagnosticHandler(std::make_unique<BackendDiagnostics>(diag_os, &link_errors));
      if (llvm::Linker::linkModules(*module, std::move(unit)) || link_errors > 0) {
        diag_os << f.name << ": error: cannot link it with " << req.file_name
                << " (a symbol defined in both?)\n";
        return at;
      }
    }
    if (AsmReadsFiles(*module)) {
      diag_os << req.file_name
              << ": error: inline assembly may not read files (.incbin, .include): a kernel "
                 "is compiled from its source and the allowed headers only\n";
      return at;
    }

    LowerStructors(*module, "llvm.global_ctors", "__opjit_run_ctors", /*destructors=*/false);
    LowerStructors(*module, "llvm.global_dtors", "__opjit_run_dtors", /*destructors=*/true);

    // Code generation only: the -O pipeline already ran inside the action.
    int backend_errors = 0;
    ctx.setDiagnosticHandler(std::make_unique<BackendDiagnostics>(diag_os, &backend_errors));
    clang::CodeGenOptions& cg = ci.getCodeGenOpts();
    cg.DisableLLVMPasses = true;
    llvm::SmallVector<char, 0> object;
    // On a thread that can open no file: inline assembly is assembled here.
    std::string no_thread;
    if (!RunWithoutFiles(
            [&] {
              clang::EmitBackendOutput(ci.getDiagnostics(), ci.getHeaderSearchOpts(), cg,
                                       ci.getTargetOpts(), ci.getLangOpts(),
                                       module->getDataLayoutStr(), module.get(),
                                       clang::Backend_EmitObj,
                                       std::make_unique<llvm::raw_svector_ostream>(object));
            },
            &no_thread)) {
      diag_os << "error: code generation could not be confined: " << no_thread << "\n";
      return at;
    }
    if (backend_errors > 0 || ci.getDiagnostics().hasErrorOccurred()) return at;
    at.ok = true;
    at.object.assign(object.begin(), object.end());
    at.dependencies = CleanDependencies(dependencies, req);
    return at;
  }

  // The extra translation unit `name` of `req` as a module of `ctx` (the -O
  // pipeline run), its reads added to `*dependencies`; null after errors,
  // which go to `diag_os`. With `pch` (a profile's prefix PCH) loaded
  // ahead of it; `*setup_failed` is set when that PCH could not be loaded.
  std::unique_ptr<llvm::Module> CompileUnit(const ipc::WorkerRequest& req, const std::string& name,
                                            llvm::LLVMContext& ctx, llvm::raw_ostream& diag_os,
                                            std::vector<std::string>* dependencies,
                                            const llvm::MemoryBuffer* pch, bool* setup_failed) {
    std::shared_ptr<clang::CompilerInvocation> inv = MakeInvocation(
        DriverArgs(req, /*for_pch=*/false, pch != nullptr, FilePath(name)), diag_os);
    if (inv == nullptr) return nullptr;
    clang::CompilerInstance ci;
    std::shared_ptr<DependencyRecorder> deps = Prepare(ci, inv, diag_os, req, pch);
    if (!ci.createTarget()) return nullptr;
    clang::EmitLLVMOnlyAction action(&ctx);
    if (!action.BeginSourceFile(ci, inv->getFrontendOpts().Inputs[0])) {
      *setup_failed = pch != nullptr;
      return nullptr;
    }
    if (llvm::Error e = action.Execute()) {
      diag_os << "error: " << llvm::toString(std::move(e)) << "\n";
      action.EndSourceFile();
      return nullptr;
    }
    action.EndSourceFile();
    std::unique_ptr<llvm::Module> module = action.takeModule();
    if (ci.getDiagnostics().hasErrorOccurred()) return nullptr;
    const std::vector<std::string>& read = deps->getDependencies();
    dependencies->insert(dependencies->end(), read.begin(), read.end());
    return module;
  }

  // Builds the PCH of req.preamble into memory. Returns null and sets
  // `*error` when it cannot.
  std::unique_ptr<llvm::MemoryBuffer> BuildPch(const ipc::WorkerRequest& req, std::string* error) {
    std::string diagnostics;
    llvm::raw_string_ostream diag_os(diagnostics);
    std::string bytes;
    std::shared_ptr<clang::CompilerInvocation> inv =
        MakeInvocation(DriverArgs(req, /*for_pch=*/true, false), diag_os);
    bool ok = false;
    if (inv != nullptr) {
      clang::CompilerInstance ci;
      Prepare(ci, inv, diag_os, req, nullptr);
      PchToMemoryAction action(&bytes);
      ok = ci.ExecuteAction(action) && !ci.getDiagnostics().hasErrorOccurred() && !bytes.empty();
    }
    if (!ok) {
      *error = diagnostics.empty() ? "building the PCH failed" : diagnostics;
      return nullptr;
    }
    return llvm::MemoryBuffer::getMemBufferCopy(bytes, VirtualPch());
  }
};

ClangFrontend::ClangFrontend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ClangFrontend::~ClangFrontend() = default;

std::unique_ptr<ClangFrontend> ClangFrontend::Create(const std::string& clang_path,
                                                     std::string* error) {
  auto impl = std::make_unique<Impl>();
  impl->clang_path = clang_path;
  // Ask the driver once for the fixed flags, to learn the target it picks.
  ipc::WorkerRequest probe;
  probe.file_name = "probe.cc";
  std::string diagnostics;
  llvm::raw_string_ostream diag_os(diagnostics);
  std::vector<std::string> argv = impl->DriverArgs(probe, /*for_pch=*/false, false);
  std::shared_ptr<clang::CompilerInvocation> inv = impl->MakeInvocation(argv, diag_os);
  if (inv == nullptr) {
    *error = "the clang driver failed for " + clang_path + ": " + diagnostics;
    return nullptr;
  }
  ipc::Hello& h = impl->hello;
  h.clang_version = clang::getClangFullVersion();
  h.triple = inv->getTargetOpts().Triple;
  h.cpu = inv->getTargetOpts().CPU;
  h.features = inv->getTargetOpts().FeaturesAsWritten;
  std::sort(h.features.begin(), h.features.end());
  h.features.erase(std::unique(h.features.begin(), h.features.end()), h.features.end());
  for (size_t i = 1; i + 1 < argv.size(); ++i) {  // without the clang path and input
    if (!h.fixed_flags.empty()) h.fixed_flags += ' ';
    h.fixed_flags += argv[i];
  }
  h.fixed_flags += " [c: -std=c17]";
  // What compiles read: the toolchain's own tree (the resource directory
  // and the driver's configuration are under it), the system include
  // directories the driver chose, and the GCC installation the driver scans
  // when it runs again for new options.
  std::set<std::string> read;
  llvm::SmallString<256> real_clang;
  if (!llvm::sys::fs::real_path(clang_path, real_clang)) {
    read.insert(std::string(llvm::sys::path::parent_path(llvm::sys::path::parent_path(real_clang))));
  }
  read.insert(inv->getHeaderSearchOpts().ResourceDir);
  for (const auto& e : inv->getHeaderSearchOpts().UserEntries) {
    read.insert(NormalizePath(e.Path, "/"));
    const size_t gcc = e.Path.find("/lib/gcc/");
    if (gcc != std::string::npos) read.insert(e.Path.substr(0, gcc + 8));
  }
  impl->read_paths.assign(read.begin(), read.end());
  return std::unique_ptr<ClangFrontend>(new ClangFrontend(std::move(impl)));
}

const std::vector<std::string>& ClangFrontend::ReadPaths() const { return impl_->read_paths; }

const ipc::Hello& ClangFrontend::Describe() const { return impl_->hello; }

namespace {

// Writes all of `data` to `fd` (from offset 0). False on any error.
bool WriteAll(int fd, llvm::StringRef data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t w = ::pwrite(fd, data.data() + done, data.size() - done,
                               static_cast<off_t>(done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    done += static_cast<size_t>(w);
  }
  return true;
}

// Closes a descriptor when it goes out of scope.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

ipc::WorkerResponse ClangFrontend::Handle(const ipc::WorkerRequest& req, int pch_fd) {
  FdCloser closer{pch_fd};
  ipc::WorkerResponse resp;
  // The registry's rule, the one copy (compile_options.h).
  const char* language = req.language == ipc::Language::kC ? "c" : "c++";
  for (const std::string& o : req.options) {
    if (!CpuOptionRefusal(language, o).empty()) {
      resp.kind = ipc::ResponseKind::kBadRequest;
      resp.diagnostics = "option '" + o + "' is not allowed";
      return resp;
    }
  }
  if (req.file_name.empty() || req.file_name.find('/') != std::string::npos) {
    resp.kind = ipc::ResponseKind::kBadRequest;
    resp.diagnostics = "file name must be a bare name";
    return resp;
  }
  {
    std::set<std::string> names;
    for (const ipc::File& f : req.files) {
      std::string why = FileNameRefusal(f.name);
      if (why.empty() && !names.insert(f.name).second) why = "is given twice";
      if (!why.empty()) {
        resp.kind = ipc::ResponseKind::kBadRequest;
        resp.diagnostics = "extra file name " + why;
        return resp;
      }
    }
  }
  const bool cxx = req.language == ipc::Language::kCxx;
  if (req.pch != ipc::PchUse::kNone &&
      (pch_fd < 0 || (req.pch_prefix ? req.pch != ipc::PchUse::kLoad
                                     : !cxx || req.preamble.empty()))) {
    resp.kind = ipc::ResponseKind::kBadRequest;
    resp.diagnostics = "a PCH request needs a C++ source, a preamble and a descriptor "
                       "(a prefix PCH: a descriptor to load)";
    return resp;
  }

  std::unique_ptr<llvm::MemoryBuffer> pch;
  if (req.pch == ipc::PchUse::kBuild) {
    std::string error;
    pch = impl_->BuildPch(req, &error);
    if (pch == nullptr) {
      resp.pch_note = "building the PCH failed: " + error;
    } else {
      resp.pch_built = WriteAll(pch_fd, pch->getBuffer());
      if (!resp.pch_built) resp.pch_note = "the PCH could not be stored";
    }
  } else if (req.pch == ipc::PchUse::kLoad) {
    struct stat st;
    if (::fstat(pch_fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
      llvm::ErrorOr<std::unique_ptr<llvm::MemoryBuffer>> mapped = llvm::MemoryBuffer::getOpenFile(
          llvm::sys::fs::convertFDToNativeFile(pch_fd), VirtualPch(),
          static_cast<uint64_t>(st.st_size), /*RequiresNullTerminator=*/false);
      if (mapped) pch = std::move(*mapped);
    }
    if (pch == nullptr) {
      resp.pch_stale = true;
      resp.pch_note = "the PCH could not be read";
    }
  }
  Impl::Attempt at = impl_->Compile(req, pch.get());
  if (pch != nullptr && at.setup_failed) {
    // A stale or broken PCH: compile without it; the daemon drops it.
    resp.pch_note = "the PCH could not be loaded: " + at.diagnostics;
    resp.pch_stale = req.pch == ipc::PchUse::kLoad;
    pch.reset();
    at = impl_->Compile(req, nullptr);
  }
  resp.pch_used = pch != nullptr;
  resp.diagnostics = std::move(at.diagnostics);
  if (!req.files.empty()) {
    // "helper.h:3:5: error", not the virtual directory's path.
    const std::string prefix = std::string(ipc::kFilesVirtualDir) + "/";
    std::string& d = resp.diagnostics;
    for (size_t p = 0; (p = d.find(prefix, p)) != std::string::npos;) d.erase(p, prefix.size());
  }
  if (!at.ok) {
    resp.kind = ipc::ResponseKind::kCompileError;
    return resp;
  }
  resp.kind = ipc::ResponseKind::kOk;
  resp.object = std::move(at.object);
  resp.dependencies = std::move(at.dependencies);
  return resp;
}

}  // namespace opjit::compiler
