#include "server/rpc/services.h"

#include "server/exec/channels.h"
#include "server/exec/handles.h"

#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/common/logging.h"
#include "server/common/text.h"
#include "server/autograd/autograd.h"
#include "server/compiler/kernel_compiler.h"
#include "server/core/defaults.h"
#include "server/exec/executor.h"
#include "server/registry/registry.h"
#include "server/access/access.h"
#include "server/rpc/caller.h"
#include "server/rpc/convert.h"
#include "server/rpc/status_util.h"
#include "server/tensor/region_manager.h"

namespace opjit::rpc {
namespace {

std::atomic<uint64_t> next_request_id{1};

uint64_t NextRequestId() { return next_request_id.fetch_add(1, std::memory_order_relaxed); }

void OutcomeToProto(const compiler::CompileOutcome& outcome, const std::string& target,
                    v1::CompileResponse* resp) {
  const auto& k = *outcome.kernel;
  resp->set_cache_key(k.cache_key);
  resp->set_diagnostics(outcome.diagnostics);
  resp->set_cache_hit(std::string(compiler::CacheTierName(outcome.cache_hit)));
  resp->set_compile_ms(outcome.cache_hit == compiler::CacheTier::kNone ? k.compile_ms : 0);
  resp->set_total_ms(outcome.total_ms);
  if (const compiler::CpuObject* cpu = k.cpu_object()) {
    for (const auto& s : cpu->defined_symbols) resp->add_defined_symbols(s);
  }
  resp->set_target(target);
  if (const compiler::GpuBinary* g = k.gpu()) {
    for (const auto& a : g->archs) resp->add_archs(a);
    resp->set_ptx_arch(g->ptx_arch);
    for (const auto& [expr, name] : g->lowered_names) (*resp->mutable_lowered_names())[expr] = name;
  }
  resp->set_binary_bytes(k.binary_bytes());
}

}  // namespace

grpc::ServerUnaryReactor* RegistryService::RegisterOp(grpc::CallbackServerContext* ctx,
                                                      const v1::RegisterOpRequest* req,
                                                      v1::RegisterOpResponse* resp) {
  auto def = OpDefFromProto(req->op());
  if (!def.ok()) return FinishNow(ctx, def.status());
  OPJIT_RPC_ADMIT(caller, def->ns, access::Action::kWrite);
  (void)caller;
  // Clients keep the base name of a source_file they read: diagnostics use it.
  std::vector<std::string> file_names;
  for (const auto& im : req->op().implementations()) file_names.push_back(im.source_file());
  auto* reactor = ctx->DefaultReactor();
  registry::Registry* reg = core_.registry;
  ops_.RegisterAsync(*std::move(def), NextRequestId(),
                    [reactor, resp, reg](absl::StatusOr<core::RegisterOutcome> outcome) {
                      if (!outcome.ok()) return reactor->Finish(ToGrpcStatus(outcome.status()));
                      for (const auto& [target, compiled] : outcome->compiled) {
                        OutcomeToProto(compiled, registry::TargetName(target),
                                       resp->add_compiled());
                      }
                      OpRecordToProto(outcome->result.record, /*with_sources=*/false,
                                      resp->mutable_record());
                      resp->set_created(outcome->result.created);
                      for (const auto& w : reg->Warnings(outcome->result.record.def)) {
                        resp->add_warnings(w);
                        resp->mutable_record()->add_warnings(w);
                      }
                      reactor->Finish(grpc::Status::OK);
                    },
                    file_names);
  return reactor;
}

grpc::ServerUnaryReactor* RegistryService::ClearQuarantine(
    grpc::CallbackServerContext* ctx, const v1::ClearQuarantineRequest* req,
    v1::ClearQuarantineResponse* resp) {
  const std::string ns = NamespaceOrDefault(req->namespace_());
  // Server-wide policy: admins only (a namespace's writers register the op
  // again instead).
  OPJIT_RPC_ADMIT(caller, ns, access::Action::kAdmin);
  auto record = core_.registry->Get(ns, req->name(), 0);
  if (!record.ok()) return FinishNow(ctx, record.status());
  if (core_.executor == nullptr) {
    return FinishNow(ctx, absl::UnavailableError("this server runs no kernels"));
  }
  resp->set_lifted(core_.executor->LiftQuarantine(ns, req->name()));
  Logger("rpc")->info("{}/{}: quarantine cleared ({} kernel(s)) by {}", ns, req->name(),
                      resp->lifted(), caller.name);
  return FinishNow(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* RegistryService::GetOp(grpc::CallbackServerContext* ctx,
                                                 const v1::GetOpRequest* req,
                                                 v1::OpRecord* resp) {
  const std::string ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, ns, access::Action::kDescribe);
  (void)caller;
  auto record = core_.registry->Get(ns, req->name(), req->version());
  if (!record.ok()) return FinishNow(ctx, record.status());
  OpRecordToProto(*record, /*with_sources=*/true, resp);
  for (const auto& w : core_.registry->Warnings(record->def)) resp->add_warnings(w);
  return FinishNow(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* RegistryService::ListOps(grpc::CallbackServerContext* ctx,
                                                   const v1::ListOpsRequest* req,
                                                   v1::ListOpsResponse* resp) {
  // No namespace: every namespace the caller sees.
  const std::string& ns = req->namespace_();
  auto caller = ns.empty() ? Authenticate(core_, *ctx)
                           : Admit(core_, *ctx, ns, access::Action::kDescribe);
  if (!caller.ok()) return FinishNow(ctx, caller.status());
  for (const auto& record : core_.registry->List(ns, req->all_versions())) {
    if (!(*caller)->Sees(record.def.ns)) continue;
    v1::OpRecord* out = resp->add_ops();
    OpRecordToProto(record, req->with_sources(), out);
    for (const auto& w : core_.registry->Warnings(record.def)) out->add_warnings(w);
  }
  return FinishNow(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* RegistryService::DeleteOp(grpc::CallbackServerContext* ctx,
                                                    const v1::DeleteOpRequest* req,
                                                    v1::DeleteOpResponse* resp) {
  const std::string ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, ns, access::Action::kWrite);
  auto deleted = core_.registry->Delete(ns, req->name(), req->version());
  if (!deleted.ok()) return FinishNow(ctx, deleted.status());
  resp->set_deleted(*deleted);
  Logger("rpc")->info("deleted {}/{} ({} version(s)) for {}", ns, req->name(), *deleted,
                      caller.name);
  return FinishNow(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* CompilerService::Compile(grpc::CallbackServerContext* ctx,
                                                   const v1::CompileRequest* req,
                                                   v1::CompileResponse* resp) {
  if (core_.compiler == nullptr) {
    return FinishNow(ctx, absl::UnavailableError("this server was started without a compiler"));
  }
  const std::string ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, ns, access::Action::kWrite);
  (void)caller;
  compiler::CompileJob job;
  auto target = core::TargetOrDefault(req->target());
  if (!target.ok()) return FinishNow(ctx, target.status());
  // The answer names the target as the request did ("CPU" when it named none).
  std::string target_name = req->target().empty() ? registry::TargetName(*target) : req->target();
  job.target = *target;
  job.language = core::LanguageOrDefault(req->language(), job.target);
  job.source = req->source();
  job.file_name = req->file_name();
  job.entry = req->entry();
  job.options.assign(req->compile_options().begin(), req->compile_options().end());
  job.libraries.assign(req->libraries().begin(), req->libraries().end());
  job.name_expressions.assign(req->name_expressions().begin(), req->name_expressions().end());
  job.archs.assign(req->archs().begin(), req->archs().end());
  job.aot_shared_object = req->aot_shared_object();
  job.ns = ns;
  // Errors found before the compile (an option, the source, the quota) come
  // back on this thread; the default reactor finishes the same from here.
  auto* reactor = ctx->DefaultReactor();
  compiles_.CompileAsync(
      std::move(job), NextRequestId(),
      [reactor, resp, target_name = std::move(target_name)](
          absl::StatusOr<compiler::CompileOutcome> outcome) {
        if (!outcome.ok()) return reactor->Finish(ToGrpcStatus(outcome.status()));
        OutcomeToProto(*outcome, target_name, resp);
        reactor->Finish(grpc::Status::OK);
      });
  return reactor;
}

grpc::ServerUnaryReactor* CompilerService::GetCacheStats(grpc::CallbackServerContext* ctx,
                                                         const v1::GetCacheStatsRequest*,
                                                         v1::CacheStats* resp) {
  // Cache statistics are server-wide: admins only.
  OPJIT_RPC_ADMIT(caller, "default", access::Action::kAdmin);
  (void)caller;
  if (core_.compiler == nullptr) {
    return FinishNow(ctx, absl::UnavailableError("this server was started without a compiler"));
  }
  const compiler::KernelCacheStats s = core_.compiler->Stats();
  resp->set_memory_entries(s.memory_entries);
  resp->set_memory_bytes(s.memory_bytes);
  resp->set_memory_hits(s.memory_hits);
  resp->set_memory_misses(s.memory_misses);
  resp->set_disk_entries(s.disk_entries);
  resp->set_disk_bytes(s.disk_bytes);
  resp->set_disk_hits(s.disk_hits);
  resp->set_disk_misses(s.disk_misses);
  resp->set_disk_corrupt(s.disk_corrupt);
  resp->set_compiles(s.compiles);
  resp->set_compile_failures(s.compile_failures);
  resp->set_compile_ms_total(s.compile_ms_total);
  resp->set_single_flight_joins(s.single_flight_joins);
  resp->set_evictions(s.evictions);
  resp->set_remote_enabled(s.remote_enabled);
  resp->set_remote_hits(s.remote_hits);
  resp->set_remote_misses(s.remote_misses);
  resp->set_remote_rejected(s.remote_rejected);
  resp->set_remote_errors(s.remote_errors);
  resp->set_remote_puts(s.remote_puts);
  return FinishNow(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* CompilerService::ClearCache(grpc::CallbackServerContext* ctx,
                                                      const v1::ClearCacheRequest* req,
                                                      v1::ClearCacheResponse* resp) {
  OPJIT_RPC_ADMIT(caller, "default", access::Action::kAdmin);
  if (core_.compiler == nullptr) {
    return FinishNow(ctx, absl::UnavailableError("this server was started without a compiler"));
  }
  resp->set_removed(core_.compiler->Clear(req->memory_only()));
  Logger("rpc")->info("cache cleared ({} entries{}) by {}", resp->removed(),
                      req->memory_only() ? ", memory only" : "", caller.name);
  return FinishNow(ctx, absl::OkStatus());
}

void ServerService::SetBound(std::vector<std::string> bound) {
  MutexLock lock(&bound_mu_);
  bound_ = std::move(bound);
}

namespace {

// `text` with every host path in it cut to its last component
// ("unix:/var/lib/opjit/opjitd.sock" -> "unix:opjitd.sock", "/opt/x/libcuda.so:
// cannot open" -> "libcuda.so: cannot open"): what non-admins see of the
// server's own facts. A path runs to whitespace or one of ()"',;:=.
std::string HideHostPaths(std::string_view text) {
  auto is_end = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '(' || c == ')' || c == '"' ||
           c == '\'' || c == ',' || c == ';' || c == ':' || c == '=';
  };
  std::string out;
  size_t i = 0;
  while (i < text.size()) {
    if (is_end(text[i])) {
      out += text[i++];
      continue;
    }
    size_t j = i;
    while (j < text.size() && !is_end(text[j])) ++j;
    std::string_view token = text.substr(i, j - i);
    const size_t slash = token.rfind('/');
    out += slash == std::string_view::npos ? token : token.substr(slash + 1);
    i = j;
  }
  return out;
}

// ServerInfo.registry_store and cache_tiers, from what the registry's health
// probe and the cache tiers last saw (nothing here waits on a store).
void FillStores(const CoreRefs& core, v1::ServerInfo* resp) {
  if (core.registry != nullptr) {
    auto* store = resp->mutable_registry_store();
    store->set_name(core.registry->StoreBackend());
    store->set_enabled(true);
    const int probed = core.registry->StoreProbed();
    store->set_checked(probed != 0);
    store->set_reachable(probed == 1);
    store->set_detail(probed == 0   ? ""
                      : probed == 1 ? "its last health probe wrote to it"
                                    : "its last health probe failed; registrations fail");
  }
  if (core.compiler == nullptr) return;
  const compiler::KernelCacheStats c = core.compiler->Stats();
  auto* memory = resp->add_cache_tiers();
  memory->set_name("memory");
  memory->set_enabled(true);
  memory->set_checked(true);
  memory->set_reachable(true);
  memory->set_detail(absl::StrCat(c.memory_entries, " entries"));
  auto* disk = resp->add_cache_tiers();
  disk->set_name("disk");
  disk->set_enabled(true);
  disk->set_checked(true);
  disk->set_reachable(true);
  disk->set_detail(absl::StrCat(c.disk_entries, " entries"));
  auto* redis = resp->add_cache_tiers();
  redis->set_name("redis");
  redis->set_enabled(c.remote_enabled);
  if (!c.remote_enabled) return;
  redis->set_checked(c.remote_contacted);
  redis->set_reachable(c.remote_contacted && c.remote_consecutive_failures == 0);
  redis->set_detail(!c.remote_contacted ? "connects at the first lookup"
                    : c.remote_consecutive_failures == 0
                        ? "its last command answered"
                        : absl::StrCat(c.remote_consecutive_failures,
                                       " failure(s) in a row; backing off"));
}

}  // namespace

grpc::ServerUnaryReactor* ServerService::GetServerInfo(grpc::CallbackServerContext* ctx,
                                                       const v1::GetServerInfoRequest*,
                                                       v1::ServerInfo* resp) {
  auto caller = Authenticate(core_, *ctx);
  if (!caller.ok()) return FinishNow(ctx, caller.status());
  const access::Principal& who = **caller;
  resp->set_principal(who.name);
  resp->set_role(access::RoleName(who.role));
  for (const auto& ns : who.namespaces) resp->add_namespaces(ns);
  resp->set_authenticated(core_.access != nullptr && core_.access->enabled());
  resp->set_version(facts_.version);
  resp->set_kernel_abi_version(facts_.kernel_abi_version);
  auto* cpu = resp->mutable_cpu();
  cpu->set_triple(facts_.cpu_triple);
  cpu->set_cpu(facts_.cpu_name);
  cpu->set_features(facts_.cpu_features);
  cpu->set_compiler(facts_.compiler_id);
  auto* gpu = resp->mutable_gpu();
  gpu->set_available(facts_.gpu_available);
  gpu->set_reason(facts_.gpu_reason);
  for (const auto& d : facts_.gpu_devices) gpu->add_devices(d);
  {
    MutexLock lock(&bound_mu_);
    for (const auto& l : bound_.empty() ? facts_.listen : bound_) resp->add_listen(l);
  }
  resp->set_daemon_uid(static_cast<uint32_t>(::geteuid()));  // for RegisterRegion's ACL
  resp->set_metrics_listen(facts_.metrics_listen);
  FillStores(core_, resp);
  if (!who.admin()) {
    // No host path for non-admins (socket paths, a driver's path in the GPU's
    // reason, ...): every text field of the answer, cut to base names.
    resp->set_version(HideHostPaths(resp->version()));
    resp->mutable_cpu()->set_compiler(HideHostPaths(resp->cpu().compiler()));
    resp->mutable_gpu()->set_reason(HideHostPaths(resp->gpu().reason()));
    for (auto& d : *resp->mutable_gpu()->mutable_devices()) d = HideHostPaths(d);
    for (auto& l : *resp->mutable_listen()) l = HideHostPaths(l);
    auto* store = resp->mutable_registry_store();
    store->set_name(HideHostPaths(store->name()));
    store->set_detail(HideHostPaths(store->detail()));
    for (auto& t : *resp->mutable_cache_tiers()) {
      t.set_name(HideHostPaths(t.name()));
      t.set_detail(HideHostPaths(t.detail()));
    }
    return FinishNow(ctx, absl::OkStatus());
  }
  resp->set_state_dir(facts_.state_dir);
  resp->set_uptime_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::steady_clock::now() - started_)
                          .count());
  resp->set_ops(static_cast<int64_t>(core_.registry->Size()));
  resp->set_pid(getpid());
  if (core_.executor != nullptr) resp->set_exec_queued(core_.executor->Stats().queued);
  if (core_.autograd != nullptr) resp->set_backward_contexts(core_.autograd->LiveContexts());
  if (core_.regions != nullptr) resp->set_regions(core_.regions->GetStats().regions);
  if (core_.handles != nullptr) resp->set_handles(static_cast<int64_t>(core_.handles->size()));
  if (core_.channels != nullptr) resp->set_channels(static_cast<int64_t>(core_.channels->size()));
  return FinishNow(ctx, absl::OkStatus());
}

}  // namespace opjit::rpc
