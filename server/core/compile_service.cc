#include "server/core/compile_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/registry/validate.h"

namespace opjit::core {
namespace {

// The first line of a status, for logs: compile diagnostics quote the
// client's source, which does not belong in the daemon's log.
std::string Brief(const absl::Status& s) {
  std::string text = s.ToString();
  auto nl = text.find('\n');
  return nl == std::string::npos ? text : text.substr(0, nl) + " [...]";
}

}  // namespace

absl::StatusOr<CompileTicket> BeginCompile(access::QuotaManager* quotas, const std::string& ns) {
  if (quotas == nullptr) return CompileTicket();
  return quotas->BeginCompile(ns);
}

double CompileSeconds(const compiler::CompileOutcome& outcome) {
  return outcome.cache_hit == compiler::CacheTier::kNone ? outcome.kernel->compile_ms / 1000.0
                                                         : 0;
}

void CompileService::CompileAsync(compiler::CompileJob job, uint64_t request_id,
                                  CompileCallback done) const {
  // Options of a bare compile get the same checks as a registered op's, by
  // the rules of the compiler's backends.
  if (absl::Status s = registry::ValidateCompileOptions(job.target, job.language, job.options,
                                                        "compile_options", compiler_->Rules());
      !s.ok()) {
    return done(s);
  }
  if (job.source.empty()) {
    return done(absl::InvalidArgumentError("source: empty; send the kernel's text"));
  }
  auto ticket = BeginCompile(quotas_, job.ns);
  if (!ticket.ok()) return done(ticket.status());
  // std::function needs a copyable callable: the ticket is shared.
  auto held = std::make_shared<CompileTicket>(*std::move(ticket));
  std::string ns = job.ns;
  compiler_->CompileAsync(
      std::move(job), [held, ns = std::move(ns), request_id,
                       done = std::move(done)](absl::StatusOr<compiler::CompileOutcome> outcome) {
        if (outcome.ok() && *held != nullptr) (*held)->Charge(CompileSeconds(*outcome));
        held->reset();  // given back (and charged) before the answer
        auto log = Logger("rpc");
        if (!outcome.ok()) {
          // Every failed compile is logged (its diagnostics go to the client).
          const auto why = GetReason(outcome.status());
          log->info("req={} compile in {} failed ({}{}): {}", request_id, ns,
                    absl::StatusCodeToString(outcome.status().code()),
                    why ? absl::StrCat(", ", why->reason) : "", Brief(outcome.status()));
        } else {
          log->debug("req={} Compile key={} hit={} {:.2f} ms", request_id,
                     outcome->kernel->cache_key.substr(0, 12),
                     compiler::CacheTierName(outcome->cache_hit), outcome->total_ms);
        }
        done(std::move(outcome));
      });
}

}  // namespace opjit::core
