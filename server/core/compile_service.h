// CompileService: the bare compile use case (Compiler.Compile), without gRPC.
//
//   validate (the options against the allow-list, a source) ─▶ a compile
//   slot of the namespace (access::QuotaManager) ─▶ compile, on the
//   compiler's pool ─▶ charge the compile seconds (a cache hit costs
//   nothing; a failed compile its wall time) and give the slot back ─▶ done
//
// A registration costs the same slot and charge: OpService takes them through
// BeginCompile and CompileSeconds below, so the quota rule lives here once.
//
// The rpc layer converts a CompileRequest to a CompileJob (its target and
// language through core/defaults.h), calls CompileAsync, and converts the
// outcome back; tests drive it directly.
//
// Thread-safety: all methods are thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/access/quotas.h"
#include "server/compiler/kernel_compiler.h"

namespace opjit::core {

// A compile slot of one namespace, given back (and charged) when it ends;
// null when the daemon has no quotas.
using CompileTicket = std::unique_ptr<access::QuotaManager::CompileTicket>;

// A compile slot of `ns` from `quotas` (null: no quotas, a null ticket), or
// RESOURCE_EXHAUSTED with reason QUOTA_EXCEEDED naming
// "concurrent_compiles" or "compile_seconds_per_minute".
absl::StatusOr<CompileTicket> BeginCompile(access::QuotaManager* quotas, const std::string& ns);

// What a successful compile costs its namespace's budget: the compile
// worker's seconds, nothing for a cache hit.
double CompileSeconds(const compiler::CompileOutcome& outcome);

class CompileService {
 public:
  using CompileCallback = std::function<void(absl::StatusOr<compiler::CompileOutcome>)>;

  // Neither pointer is owned; both must outlive the service. `compiler` must
  // not be null; `quotas` may be (no quotas).
  CompileService(compiler::KernelCompiler* compiler, access::QuotaManager* quotas)
      : compiler_(compiler), quotas_(quotas) {}

  // Compiles `job` for namespace `job.ns` (the one charged); calls `done`
  // exactly once, on this thread for errors found before the compile, else
  // on the compiler's pool. The slot is given back before `done` runs, so the
  // client's next compile finds it free. `request_id` names the compile in
  // logs (a failure is logged with its reason; its diagnostics go to the
  // client only).
  // Errors, in this order: INVALID_ARGUMENT for an option off the allow-list
  // ("compile_options: ...") or an empty source, RESOURCE_EXHAUSTED
  // (QUOTA_EXCEEDED) from BeginCompile, then the compiler's.
  void CompileAsync(compiler::CompileJob job, uint64_t request_id, CompileCallback done) const;

 private:
  compiler::KernelCompiler* const compiler_;
  access::QuotaManager* const quotas_;
};

}  // namespace opjit::core
