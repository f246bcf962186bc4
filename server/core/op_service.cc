#include "server/core/op_service.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/core/compile_service.h"
#include "server/exec/executor.h"
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

// The state of one registration while its implementations compile.
struct Registration {
  registry::OpDef def;
  uint64_t rid = 0;
  std::vector<compiler::CompileJob> jobs;
  RegisterOutcome outcome;
  // Given back before `done` runs, so the client's next compile finds the
  // slot free.
  CompileTicket ticket;
  OpService::RegisterCallback done;

  // Ends the compile slot (a failure is charged its wall time) and answers.
  void Fail(const absl::Status& s) {
    ticket.reset();
    done(s);
  }
};

// An op registered without output_rules whose CPU implementation exports
// `<entry>InferShape` (MindSpore's aot infer entry) takes every output's
// shape from it: the resolved rule (kInferShape per output, the dtype from
// the dtype_formats row) is stored in the definition, so calls do not decide
// again and the content hash says which rule runs. Without one the rules
// stay empty (same as input 0, the definition and its hash unchanged) and
// Registry::Warnings says so. Ops with rules are not touched.
void ResolveOutputRules(registry::OpDef& def, const std::vector<compiler::CompileJob>& jobs,
                        const RegisterOutcome& outcome) {
  if (!def.output_rules.empty() || def.outputs.empty()) return;
  for (size_t i = 0; i < outcome.compiled.size() && i < jobs.size(); ++i) {
    const auto& kernel = outcome.compiled[i].second.kernel;
    const compiler::CpuObject* cpu =
        kernel != nullptr && kernel->target == registry::Target::kCpu ? kernel->cpu_object()
                                                                      : nullptr;
    if (cpu == nullptr || jobs[i].entry.empty()) continue;
    const std::string infer = jobs[i].entry + "InferShape";
    if (std::binary_search(cpu->entry_points.begin(), cpu->entry_points.end(), infer)) {
      registry::OutputRule rule;
      rule.kind = registry::OutputRule::Kind::kInferShape;
      def.output_rules.assign(def.outputs.size(), rule);
      return;
    }
  }
}

}  // namespace

void OpService::RegisterAsync(registry::OpDef def, uint64_t request_id, RegisterCallback done,
                              const std::vector<std::string>& file_names) const {
  auto log = Logger("core");
  auto ticket = BeginCompile(quotas_, def.ns);
  if (!ticket.ok()) return done(ticket.status());
  // Languages and options as the compiler's backends say (the built-in
  // rules when there is no compiler).
  const registry::TargetRules& rules =
      compiler_ != nullptr ? compiler_->Rules() : registry::BuiltinTargetRules();
  if (absl::Status s = registry::ValidateOpDef(def, rules); !s.ok()) {
    log->debug("req={} register {}/{}: {}", request_id, def.ns, def.name, s.ToString());
    ticket->reset();
    return done(s);
  }
  // A bprop that disagrees with its forward fails before anything compiles
  // (Register checks again, against the registry as it is then).
  if (absl::Status s = registry_->CheckBackwardLinks(def); !s.ok()) {
    ticket->reset();
    return done(s);
  }
  auto reg = std::make_shared<Registration>();
  reg->def = std::move(def);
  reg->rid = request_id;
  reg->ticket = *std::move(ticket);
  reg->done = std::move(done);
  if (compiler_ != nullptr) {
    for (size_t i = 0; i < reg->def.implementations.size(); ++i) {
      reg->jobs.push_back(compiler::JobForImplementation(reg->def, reg->def.implementations[i]));
      if (i < file_names.size()) reg->jobs.back().file_name = file_names[i];
    }
  }
  registry::Registry* registry = registry_;
  compiler::KernelCompiler* kc = compiler_;
  exec::Executor* executor = executor_;
  // Stores the op once every implementation compiled.
  auto store = [registry, executor, reg, log, rules = &rules]() {
    ResolveOutputRules(reg->def, reg->jobs, reg->outcome);
    const registry::OpDef& d = reg->def;
    auto result = registry->Register(d, *rules);
    if (!result.ok()) {
      log->warn("req={} register {}/{}: {}", reg->rid, d.ns, d.name, result.status().ToString());
      return reg->Fail(result.status());
    }
    log->info("req={} registered {}/{} v{}{}", reg->rid, d.ns, d.name, result->record.version,
              result->created ? "" : " (unchanged)");
    if (reg->ticket != nullptr) {
      double seconds = 0;
      for (const auto& [t, c] : reg->outcome.compiled) seconds += CompileSeconds(c);
      reg->ticket->Charge(seconds);
    }
    reg->ticket.reset();
    // Registering again, even the identical definition, lifts the op's
    // quarantine.
    if (executor != nullptr && executor->LiftQuarantine(d.ns, d.name) > 0) {
      Logger("rpc")->info("{}/{}: quarantine lifted by its registration", d.ns, d.name);
    }
    reg->outcome.result = *std::move(result);
    reg->done(std::move(reg->outcome));
  };
  // Compiles job i, then the next; the last one stores.
  auto next = std::make_shared<std::function<void(size_t)>>();
  *next = [kc, reg, next, store, log](size_t i) {
    if (i == reg->jobs.size()) {
      // Clearing *next destroys this closure: keep what is needed first.
      auto finish = store;
      *next = nullptr;  // break the cycle
      return finish();
    }
    const registry::Target target = reg->jobs[i].target;
    kc->CompileAsync(reg->jobs[i], [=](absl::StatusOr<compiler::CompileOutcome> outcome) {
      if (!outcome.ok()) {
        // Every failed compile is logged (its diagnostics go to the client).
        const auto why = GetReason(outcome.status());
        log->info("req={} register {}/{}: {} compile failed ({}{}): {}", reg->rid, reg->def.ns,
                  reg->def.name, registry::TargetName(target),
                  absl::StatusCodeToString(outcome.status().code()),
                  why ? absl::StrCat(", ", why->reason) : "", Brief(outcome.status()));
        *next = nullptr;
        return reg->Fail(Annotate(
            outcome.status(), absl::StrCat("op \"", reg->def.ns, "/", reg->def.name, "\" ",
                                           registry::TargetName(target), " implementation: ")));
      }
      reg->outcome.compiled.emplace_back(target, *std::move(outcome));
      (*next)(i + 1);
    });
  };
  (*next)(0);
}

}  // namespace opjit::core
