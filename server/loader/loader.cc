// LLVM ORC glue for the CPU kernel loader. The only translation unit of the
// loader that sees LLVM headers.
#include "server/loader/loader.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "llvm/ExecutionEngine/JITLink/EHFrameSupport.h"
#include "llvm/ExecutionEngine/JITLink/JITLink.h"
#include "llvm/ExecutionEngine/Orc/Core.h"
#include "llvm/ExecutionEngine/Orc/ExecutionUtils.h"
#include "llvm/ExecutionEngine/Orc/JITTargetMachineBuilder.h"
#include "llvm/ExecutionEngine/Orc/LLJIT.h"
#include "llvm/ExecutionEngine/Orc/ObjectFileInterface.h"
#include "llvm/ExecutionEngine/Orc/ObjectLinkingLayer.h"
#include "llvm/Object/ELFObjectFile.h"
#include "llvm/Object/ObjectFile.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/TargetSelect.h"
#include "llvm/TargetParser/Host.h"
#include "server/common/logging.h"
#include "server/common/mutex.h"
#include "server/common/vector_math.h"

namespace opjit::loader {
namespace {

namespace orc = llvm::orc;
namespace jitlink = llvm::jitlink;

// orc::MemProt's operator| lives in namespace llvm.
LLVM_ENABLE_BITMASK_ENUMS_IN_NAMESPACE();

constexpr char kRunCtors[] = "__opjit_run_ctors";
constexpr char kRunDtors[] = "__opjit_run_dtors";
constexpr char kDsoHandle[] = "__dso_handle";

std::string ToString(llvm::Error err) { return llvm::toString(std::move(err)); }

void InitLlvmOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    llvm::InitializeNativeTarget();
    llvm::InitializeNativeTargetAsmPrinter();
  });
}

// ---------------------------------------------------------------------------
// Static destructors of kernels.
//
// A kernel's static objects register their destructors with
// __cxa_atexit(fn, obj, &__dso_handle). Left to libc they would run at daemon
// exit, after the code is gone, so every kernel gets its own __dso_handle (8
// bytes inside its JIT memory) and __cxa_atexit / atexit bound to the hooks
// below, which record the destructors here; the LoadedKernel runs them when it
// is unloaded. The hooks are plain function addresses, so the registry is
// process-wide. Plain atexit(fn) carries no dso handle; it is attributed to
// the kernel whose static initialisation or destruction is running on this
// thread.

struct AtexitEntry {
  void (*fn_arg)(void*) = nullptr;
  void* arg = nullptr;
  void (*fn)() = nullptr;
};

class AtexitRegistry {
 public:
  // Leaked on purpose: kernels may still be unloaded while statics of the
  // daemon are destroyed at exit.
  static AtexitRegistry& Get() {
    static AtexitRegistry* registry = new AtexitRegistry();
    return *registry;
  }

  void Open(uint64_t dso) {
    MutexLock lock(&mu_);
    entries_[dso];
  }
  bool Add(uint64_t dso, AtexitEntry entry) {
    MutexLock lock(&mu_);
    auto it = entries_.find(dso);
    if (it == entries_.end()) return false;
    it->second.push_back(entry);
    return true;
  }
  std::vector<AtexitEntry> Take(uint64_t dso) {
    MutexLock lock(&mu_);
    auto it = entries_.find(dso);
    if (it == entries_.end()) return {};
    return std::exchange(it->second, {});
  }
  void Close(uint64_t dso) {
    MutexLock lock(&mu_);
    entries_.erase(dso);
  }

 private:
  Mutex mu_;
  std::map<uint64_t, std::vector<AtexitEntry>> entries_ ABSL_GUARDED_BY(mu_);
};

// The kernel whose static initialisation/destruction runs on this thread.
thread_local uint64_t t_current_dso = 0;

extern "C" int OpjitCxaAtexitHook(void (*fn)(void*), void* arg, void* dso) {
  uint64_t key = reinterpret_cast<uint64_t>(dso);
  if (key == 0) key = t_current_dso;
  if (AtexitRegistry::Get().Add(key, AtexitEntry{fn, arg, nullptr})) return 0;
  opjit::Logger("loader")->error(
      "a kernel called __cxa_atexit with an unknown dso handle; its destructor will not run");
  return -1;
}

extern "C" int OpjitAtexitHook(void (*fn)()) {
  if (t_current_dso != 0 &&
      AtexitRegistry::Get().Add(t_current_dso, AtexitEntry{nullptr, nullptr, fn}))
    return 0;
  opjit::Logger("loader")->error(
      "a kernel called atexit outside its static initialisation; the function will not run");
  return -1;
}

// Sets t_current_dso for a scope.
class ScopedCurrentDso {
 public:
  explicit ScopedCurrentDso(uint64_t dso) : saved_(std::exchange(t_current_dso, dso)) {}
  ~ScopedCurrentDso() { t_current_dso = saved_; }

 private:
  uint64_t saved_;
};

// Runs (and forgets) what `dso` registered, last first, until nothing is left
// (a destructor may register more).
void RunAtexits(uint64_t dso, const std::string& name) {
  ScopedCurrentDso scope(dso);
  for (;;) {
    std::vector<AtexitEntry> entries = AtexitRegistry::Get().Take(dso);
    if (entries.empty()) return;
    for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
      try {
        if (it->fn_arg != nullptr) {
          it->fn_arg(it->arg);
        } else {
          it->fn();
        }
      } catch (const std::exception& e) {
        opjit::Logger("loader")->error("kernel '{}': a static destructor threw: {}", name,
                                       e.what());
      } catch (...) {
        opjit::Logger("loader")->error("kernel '{}': a static destructor threw", name);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Gives every linked object its own __dso_handle: 8 bytes in the object's own
// JIT memory. Clang references the hidden __dso_handle PC-relatively, so it
// must lie within +-2 GiB of the code; an absolute symbol at a heap address
// would not link. Records the address per JITDylib for Load to pick up.
class DsoHandlePlugin : public orc::ObjectLinkingLayer::Plugin {
 public:
  void modifyPassConfig(orc::MaterializationResponsibility& mr, jitlink::LinkGraph&,
                        jitlink::PassConfiguration& config) override {
    orc::JITDylib* jd = &mr.getTargetJITDylib();
    auto handle = std::make_shared<jitlink::Symbol*>(nullptr);
    config.PrePrunePasses.push_back([handle](jitlink::LinkGraph& g) -> llvm::Error {
      jitlink::Symbol* external = nullptr;
      for (jitlink::Symbol* sym : g.external_symbols()) {
        if (sym->getName() == kDsoHandle) {
          external = sym;
          break;
        }
      }
      jitlink::Section& section =
          g.createSection("__opjit_dso_handle", orc::MemProt::Read | orc::MemProt::Write);
      jitlink::Block& block = g.createZeroFillBlock(section, 8, orc::ExecutorAddr(), 8, 0);
      if (external != nullptr) {
        g.makeDefined(*external, block, 0, 8, jitlink::Linkage::Strong, jitlink::Scope::Local,
                      /*IsLive=*/true);
        *handle = external;
      } else {
        *handle = &g.addAnonymousSymbol(block, 0, 8, /*IsCallable=*/false, /*IsLive=*/true);
      }
      return llvm::Error::success();
    });
    config.PostAllocationPasses.push_back([this, jd, handle](jitlink::LinkGraph&) -> llvm::Error {
      if (*handle == nullptr) return llvm::Error::success();
      MutexLock lock(&mu_);
      handles_[jd] = (*handle)->getAddress().getValue();
      return llvm::Error::success();
    });
  }

  // The dso handle of the object linked into `jd`; 0 if none was recorded.
  uint64_t Take(orc::JITDylib* jd) {
    MutexLock lock(&mu_);
    auto it = handles_.find(jd);
    if (it == handles_.end()) return 0;
    uint64_t value = it->second;
    handles_.erase(it);
    return value;
  }

  llvm::Error notifyFailed(orc::MaterializationResponsibility& mr) override {
    MutexLock lock(&mu_);
    handles_.erase(&mr.getTargetJITDylib());
    return llvm::Error::success();
  }
  llvm::Error notifyRemovingResources(orc::JITDylib& jd, orc::ResourceKey) override {
    MutexLock lock(&mu_);
    handles_.erase(&jd);
    return llvm::Error::success();
  }
  void notifyTransferringResources(orc::JITDylib&, orc::ResourceKey, orc::ResourceKey) override {}

 private:
  Mutex mu_;
  std::map<orc::JITDylib*, uint64_t> handles_ ABSL_GUARDED_BY(mu_);
};

// What the symbol table of an object says, read before linking.
struct ObjectSymbols {
  std::vector<std::string> defined;    // strong, default visibility, function/data
  std::vector<std::string> undefined;  // strong references
};

absl::StatusOr<ObjectSymbols> ReadSymbols(llvm::MemoryBufferRef buffer, const std::string& name) {
  auto obj = llvm::object::ObjectFile::createObjectFile(buffer);
  if (!obj) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel '", name, "': not an object file: ", ToString(obj.takeError())));
  }
  if (!llvm::isa<llvm::object::ELFObjectFileBase>(obj->get()) || !(*obj)->isRelocatableObject()) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel '", name, "': not an ELF relocatable object"));
  }
  ObjectSymbols out;
  for (const llvm::object::SymbolRef& sym : (*obj)->symbols()) {
    auto flags = sym.getFlags();
    auto sym_name = sym.getName();
    auto type = sym.getType();
    if (!flags || !sym_name || !type) {
      llvm::consumeError(flags.takeError());
      llvm::consumeError(sym_name.takeError());
      llvm::consumeError(type.takeError());
      return absl::InvalidArgumentError(
          absl::StrCat("kernel '", name, "': malformed symbol table"));
    }
    if (!(*flags & llvm::object::BasicSymbolRef::SF_Global) || sym_name->empty()) continue;
    if (*flags & llvm::object::BasicSymbolRef::SF_Undefined) {
      if (!(*flags & llvm::object::BasicSymbolRef::SF_Weak))
        out.undefined.push_back(sym_name->str());
      continue;
    }
    if (*flags & (llvm::object::BasicSymbolRef::SF_Weak | llvm::object::BasicSymbolRef::SF_Hidden))
      continue;
    if (*type == llvm::object::SymbolRef::ST_Function || *type == llvm::object::SymbolRef::ST_Data)
      out.defined.push_back(sym_name->str());
  }
  std::sort(out.defined.begin(), out.defined.end());
  out.defined.erase(std::unique(out.defined.begin(), out.defined.end()), out.defined.end());
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------

namespace internal {

// The JIT shared by a JitLoader and the kernels it loaded.
class LoaderState {
 public:
  std::unique_ptr<orc::LLJIT> jit;
  DsoHandlePlugin* dso_plugin = nullptr;  // owned by the jit's object layer
  std::vector<std::string> allowed_libraries;
  std::atomic<uint64_t> loaded{0};
  std::atomic<uint64_t> unloaded{0};
  std::atomic<uint64_t> next_id{0};

  // Returns the dlopen handle of allowed library `lib`, opening it once.
  absl::StatusOr<void*> OpenLibrary(const std::string& lib, const std::string& kernel) {
    if (std::find(allowed_libraries.begin(), allowed_libraries.end(), lib) ==
        allowed_libraries.end()) {
      return absl::PermissionDeniedError(absl::StrCat(
          "kernel '", kernel, "' names library '", lib,
          "', which is not on the server's allow-list (allowed: ",
          allowed_libraries.empty() ? "none" : absl::StrJoin(allowed_libraries, ", "), ")"));
    }
    MutexLock lock(&mu_);
    auto it = handles_.find(lib);
    if (it != handles_.end()) return it->second;
    void* handle = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* err = dlerror();
      return absl::FailedPreconditionError(
          absl::StrCat("cannot open allowed library '", lib, "': ", err ? err : "unknown error"));
    }
    Logger("loader")->info("opened library {}", lib);
    handles_.emplace(lib, handle);
    return handle;
  }

 private:
  Mutex mu_;
  // Opened libraries stay open for the life of the process: code loaded later
  // may point into them, and dlclose of a library with TLS/atexit is unsafe.
  std::map<std::string, void*> handles_ ABSL_GUARDED_BY(mu_);
};

// The code of one LoadedKernel: its JITDylib and static destructors.
struct KernelCode {
  std::shared_ptr<LoaderState> state;
  std::string name;
  orc::JITDylib* jd = nullptr;
  uint64_t dso = 0;               // 0 until registered with the AtexitRegistry
  void (*run_dtors)() = nullptr;  // set once the constructors have run
  bool counted = false;           // counted in state->loaded

  ~KernelCode() {
    if (dso != 0) {
      RunAtexits(dso, name);
      if (run_dtors != nullptr) {
        ScopedCurrentDso scope(dso);
        try {
          run_dtors();
        } catch (const std::exception& e) {
          Logger("loader")->error("kernel '{}': {} threw: {}", name, kRunDtors, e.what());
        } catch (...) {
          Logger("loader")->error("kernel '{}': {} threw", name, kRunDtors);
        }
        RunAtexits(dso, name);
      }
      AtexitRegistry::Get().Close(dso);
    }
    if (jd != nullptr) {
      if (llvm::Error err = state->jit->getExecutionSession().removeJITDylib(*jd)) {
        Logger("loader")->error("kernel '{}': unloading failed: {}", name,
                                ToString(std::move(err)));
      }
    }
    if (counted) state->unloaded.fetch_add(1, std::memory_order_relaxed);
  }
};

}  // namespace internal

// ---------------------------------------------------------------------------

HostTarget DetectHostTarget() {
  HostTarget target;
  target.triple = llvm::sys::getProcessTriple();
  target.cpu = llvm::sys::getHostCPUName().str();
  llvm::StringMap<bool> features;
  std::vector<std::string> enabled;
  if (llvm::sys::getHostCPUFeatures(features)) {
    for (const auto& entry : features) {
      if (entry.second) enabled.push_back(absl::StrCat("+", entry.first().str()));
    }
  }
  std::sort(enabled.begin(), enabled.end());
  target.features = absl::StrJoin(enabled, ",");
  return target;
}

LoadedKernel::~LoadedKernel() = default;

void* LoadedKernel::Find(std::string_view symbol) const {
  auto it = symbols_.find(symbol);
  return it == symbols_.end() ? nullptr : it->second;
}

JitLoader::JitLoader(std::shared_ptr<internal::LoaderState> state) : state_(std::move(state)) {}
JitLoader::~JitLoader() = default;

absl::StatusOr<std::unique_ptr<JitLoader>> JitLoader::Create(const JitLoaderOptions& options) {
  InitLlvmOnce();
  // Kernels call glibc's vector math (_ZGVdN8v_expf, ...) where their loops
  // vectorized (the compiler's -fveclib=libmvec): resolved from the process
  // like the rest of libm.
  LoadVectorMath();
  auto state = std::make_shared<internal::LoaderState>();
  state->allowed_libraries = options.allowed_libraries;

  auto jtmb = orc::JITTargetMachineBuilder::detectHost();
  if (!jtmb) {
    return absl::InternalError(
        absl::StrCat("cannot describe the host to LLVM: ", ToString(jtmb.takeError())));
  }
  DsoHandlePlugin* dso_plugin = nullptr;
  auto jit = orc::LLJITBuilder()
                 .setJITTargetMachineBuilder(std::move(*jtmb))
                 // JITLink, with eh-frame registration so C++ exceptions unwind
                 // through kernel frames into the daemon's catch blocks.
                 .setObjectLinkingLayerCreator(
                     [&dso_plugin](
                         orc::ExecutionSession& es,
                         const llvm::Triple&) -> llvm::Expected<std::unique_ptr<orc::ObjectLayer>> {
                       auto layer = std::make_unique<orc::ObjectLinkingLayer>(es);
                       layer->addPlugin(std::make_unique<orc::EHFrameRegistrationPlugin>(
                           es, std::make_unique<jitlink::InProcessEHFrameRegistrar>()));
                       auto plugin = std::make_unique<DsoHandlePlugin>();
                       dso_plugin = plugin.get();
                       layer->addPlugin(std::move(plugin));
                       return std::unique_ptr<orc::ObjectLayer>(std::move(layer));
                     })
                 // Objects only: no IR-level platform (it would JIT a runtime module
                 // into the main JITDylib for nothing).
                 .setPlatformSetUp(orc::setUpInactivePlatform)
                 .create();
  if (!jit) {
    return absl::InternalError(
        absl::StrCat("cannot create the LLVM JIT: ", ToString(jit.takeError())));
  }
  state->jit = std::move(*jit);
  state->dso_plugin = dso_plugin;
  state->jit->getExecutionSession().setErrorReporter(
      [](llvm::Error err) { Logger("loader")->error("ORC: {}", ToString(std::move(err))); });
  Logger("loader")->info("JIT loader ready for {} ({}), {} allowed libraries",
                         state->jit->getTargetTriple().str(), llvm::sys::getHostCPUName().str(),
                         state->allowed_libraries.size());
  return std::unique_ptr<JitLoader>(new JitLoader(std::move(state)));
}

absl::StatusOr<std::shared_ptr<const LoadedKernel>> JitLoader::Load(
    std::string_view object, const std::string& name, const std::vector<std::string>& libraries) {
  const auto start = std::chrono::steady_clock::now();
  orc::LLJIT& jit = *state_->jit;
  orc::ExecutionSession& es = jit.getExecutionSession();

  // The copy is suitably aligned for the ELF reader and owned by the JIT until
  // the link is done.
  std::unique_ptr<llvm::MemoryBuffer> buffer =
      llvm::MemoryBuffer::getMemBufferCopy(llvm::StringRef(object.data(), object.size()), name);
  absl::StatusOr<ObjectSymbols> symbols = ReadSymbols(buffer->getMemBufferRef(), name);
  if (!symbols.ok()) return symbols.status();

  // Libraries first: PERMISSION_DENIED says more than an undefined symbol.
  std::vector<void*> handles;
  for (const std::string& lib : libraries) {
    absl::StatusOr<void*> handle = state_->OpenLibrary(lib, name);
    if (!handle.ok()) return handle.status();
    handles.push_back(*handle);
  }

  // Resolve every strong undefined symbol now, so that a missing one is
  // reported by name. The process comes first, as for a shared object.
  orc::SymbolMap imports;
  imports[es.intern("__cxa_atexit")] =
      llvm::JITEvaluatedSymbol::fromPointer(&OpjitCxaAtexitHook, llvm::JITSymbolFlags::Exported);
  imports[es.intern("atexit")] =
      llvm::JITEvaluatedSymbol::fromPointer(&OpjitAtexitHook, llvm::JITSymbolFlags::Exported);
  std::vector<std::string> missing;
  for (const std::string& sym : symbols->undefined) {
    if (sym == kDsoHandle || sym == "_GLOBAL_OFFSET_TABLE_" || sym == "__cxa_atexit" ||
        sym == "atexit") {
      continue;
    }
    void* address = dlsym(RTLD_DEFAULT, sym.c_str());
    for (size_t i = 0; address == nullptr && i < handles.size(); ++i) {
      address = dlsym(handles[i], sym.c_str());
    }
    if (address == nullptr) {
      missing.push_back(absl::StrCat("'", sym, "'"));
      continue;
    }
    imports[es.intern(sym)] =
        llvm::JITEvaluatedSymbol::fromPointer(address, llvm::JITSymbolFlags::Exported);
  }
  if (!missing.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kernel '", name, "': undefined symbol", missing.size() > 1 ? "s " : " ",
        absl::StrJoin(missing, ", "), " (not in the process or the allowed libraries: ",
        libraries.empty() ? "none named" : absl::StrJoin(libraries, ", "), ")"));
  }

  auto code = std::make_unique<internal::KernelCode>();
  code->state = state_;
  code->name = name;
  auto jd = es.createJITDylib(absl::StrCat(name, "#", state_->next_id.fetch_add(1)));
  if (!jd) {
    return absl::InternalError(absl::StrCat("kernel '", name, "': ", ToString(jd.takeError())));
  }
  code->jd = &*jd;  // from here on, `code` removes the JITDylib on every path
  if (llvm::Error err = jd->define(orc::absoluteSymbols(std::move(imports)))) {
    return absl::InternalError(absl::StrCat("kernel '", name, "': ", ToString(std::move(err))));
  }
  // A fallback for anything the symbol table scan above did not see.
  auto process = orc::DynamicLibrarySearchGenerator::GetForCurrentProcess(
      jit.getDataLayout().getGlobalPrefix());
  if (!process) {
    return absl::InternalError(
        absl::StrCat("kernel '", name, "': ", ToString(process.takeError())));
  }
  jd->addGenerator(std::move(*process));

  // Everything the object defines, so that the whole object links now.
  auto interface = orc::getObjectFileInterface(es, buffer->getMemBufferRef());
  if (!interface) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel '", name, "': ", ToString(interface.takeError())));
  }
  orc::SymbolLookupSet wanted;
  for (const auto& [sym, flags] : interface->SymbolFlags) {
    if (sym != interface->InitSymbol) wanted.add(sym);
  }
  if (wanted.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel '", name, "': the object defines no global symbols"));
  }
  if (llvm::Error err = jit.addObjectFile(*jd, std::move(buffer))) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel '", name, "': ", ToString(std::move(err))));
  }
  auto linked =
      es.lookup(orc::makeJITDylibSearchOrder(&*jd, orc::JITDylibLookupFlags::MatchAllSymbols),
                std::move(wanted));
  if (!linked) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel '", name, "': linking failed: ", ToString(linked.takeError())));
  }
  code->dso = state_->dso_plugin->Take(&*jd);
  if (code->dso == 0) {
    return absl::InternalError(absl::StrCat("kernel '", name, "': no __dso_handle was placed"));
  }
  AtexitRegistry::Get().Open(code->dso);

  std::shared_ptr<LoadedKernel> kernel(new LoadedKernel());
  kernel->name_ = name;
  kernel->code_bytes_ = object.size();
  kernel->defined_symbols_ = std::move(symbols->defined);
  for (const auto& [sym, def] : *linked) {
    kernel->symbols_.emplace((*sym).str(), reinterpret_cast<void*>(def.getAddress()));
  }

  if (void* ctors = kernel->Find(kRunCtors)) {
    ScopedCurrentDso scope(code->dso);
    std::string error;
    bool threw = true;
    try {
      reinterpret_cast<void (*)()>(ctors)();
      threw = false;
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "a non-standard exception";
    }
    if (threw) {
      // `code` unloads: destructors of what was constructed run; the object's
      // own __opjit_run_dtors does not.
      return absl::InvalidArgumentError(
          absl::StrCat("kernel '", name, "': static initialisation threw: ", error));
    }
  }
  code->run_dtors = reinterpret_cast<void (*)()>(kernel->Find(kRunDtors));
  code->counted = true;
  state_->loaded.fetch_add(1, std::memory_order_relaxed);
  kernel->code_ = std::move(code);

  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  Logger("loader")->debug("loaded kernel '{}': {} bytes, {} symbols, {:.3f} ms", name,
                          object.size(), kernel->symbols_.size(), ms);
  return std::shared_ptr<const LoadedKernel>(std::move(kernel));
}

JitLoader::Stats JitLoader::GetStats() const {
  Stats stats;
  stats.loaded = state_->loaded.load(std::memory_order_relaxed);
  stats.unloaded = state_->unloaded.load(std::memory_order_relaxed);
  stats.live = stats.loaded - stats.unloaded;
  return stats;
}

}  // namespace opjit::loader
