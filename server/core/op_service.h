// OpService: the register-and-compile use case, without gRPC.
//
//   a compile slot of the namespace (quotas; core/compile_service.h) ─▶
//   validate the definition ─▶ compile every implementation (one after
//   another, on the compiler's pool; the same jobs execution will look up)
//   ─▶ store a new version (or find the same definition already stored)
//   ─▶ charge the compile seconds and give the slot back ─▶ lift the op's
//   quarantine (registering again, even identically, lifts it)
//
// A backward op is not required to exist yet: the examples (and MindSpore's
// habit) register a forward whose bprop, or whose bprop's bprop, comes later
// or never; backward then answers NOT_FOUND naming it.
//
// The rpc layer converts protobuf to an OpDef, calls RegisterAsync, and
// converts the outcome back; tests drive it directly.
//
// Thread-safety: all methods are thread-safe; callbacks run on the caller's
// thread (errors found before any compile, cache hits) or on the
// compiler's pool.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "server/compiler/kernel_compiler.h"
#include "server/registry/registry.h"

namespace opjit::access {
class QuotaManager;
}
namespace opjit::exec {
class Executor;
}

namespace opjit::core {

struct RegisterOutcome {
  registry::Registry::RegisterResult result;
  // One per implementation, in the definition's order.
  std::vector<std::pair<registry::Target, compiler::CompileOutcome>> compiled;
};

class OpService {
 public:
  using RegisterCallback = std::function<void(absl::StatusOr<RegisterOutcome>)>;

  // No pointer is owned; all must outlive the service. `compiler` may be
  // null (a registry without a compiler stores definitions unchecked);
  // `quotas` may be (no compile quota), and `executor` (no quarantine to
  // lift).
  OpService(registry::Registry* registry, compiler::KernelCompiler* compiler,
            access::QuotaManager* quotas = nullptr, exec::Executor* executor = nullptr)
      : registry_(registry), compiler_(compiler), quotas_(quotas), executor_(executor) {}

  // Registers `def`; calls `done` exactly once. Errors: RESOURCE_EXHAUSTED
  // (QUOTA_EXCEEDED) when the namespace has no compile slot or budget left
  // (before anything else); INVALID_ARGUMENT for a
  // malformed definition (before any compile), a compile error ("op
  // \"ns/name\" CPU implementation: compile failed: ..."), a missing entry
  // symbol; the compiler's other
  // codes; the registry's (INTERNAL when it cannot persist). Nothing is
  // stored unless everything compiled. The compile slot is given back before
  // `done` runs, charged the seconds of what was compiled (a failure: its
  // wall time).
  // `file_names[i]`, when given, is what diagnostics call implementation i's
  // source (the user's file); it does not change what is compiled or cached.
  void RegisterAsync(registry::OpDef def, uint64_t request_id, RegisterCallback done,
                     const std::vector<std::string>& file_names = {}) const;

 private:
  registry::Registry* const registry_;
  compiler::KernelCompiler* const compiler_;
  access::QuotaManager* const quotas_;
  exec::Executor* const executor_;
};

}  // namespace opjit::core
