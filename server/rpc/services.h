// gRPC services of opjitd (callback API). Each handler converts the request to
// domain types, calls the core (the use cases in server/core: OpService,
// CompileService, CallService; they hold the policy: quotas, defaults, the
// routing of a call), converts the result, and maps absl::Status to a gRPC
// status once, at this edge. Handlers never block on a compile: those run on
// the compiler's pool and finish the reactor from there.
//
// Thread-safety: services are stateless beyond pointers to thread-safe core
// objects, which must outlive the server.
#pragma once

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "opjit/v1/compile.grpc.pb.h"
#include "opjit/v1/evaluate.grpc.pb.h"
#include "opjit/v1/exec.grpc.pb.h"
#include "opjit/v1/memory.grpc.pb.h"
#include "opjit/v1/registry.grpc.pb.h"
#include "opjit/v1/server.grpc.pb.h"
#include "server/common/mutex.h"
#include "server/core/call_service.h"
#include "server/core/compile_service.h"
#include "server/core/op_service.h"

namespace opjit {
namespace registry {
class Registry;
}
namespace compiler {
class KernelCompiler;
}
namespace exec {
class Executor;
class HandleTable;
class ChannelManager;
}
namespace tensor {
class RegionManager;
}
namespace autograd {
class Autograd;
}
namespace evaluate {
class Evaluator;
}
namespace access {
class AccessControl;
class QuotaManager;
}
}  // namespace opjit

namespace opjit::rpc {

// What the services need from the core. Not owned.
struct CoreRefs {
  registry::Registry* registry = nullptr;
  compiler::KernelCompiler* compiler = nullptr;  // may be null in tests of the registry alone
  tensor::RegionManager* regions = nullptr;
  exec::Executor* executor = nullptr;
  autograd::Autograd* autograd = nullptr;
  // Who may do what; null: every caller is a local admin (tests, fuzzers).
  access::AccessControl* access = nullptr;
  // Per-namespace compile and call quotas; null: none.
  access::QuotaManager* quotas = nullptr;
  // Prepared handles and fast channels; null: Prepare / OpenChannel answer
  // UNIMPLEMENTED.
  exec::HandleTable* handles = nullptr;
  exec::ChannelManager* channels = nullptr;
  // Verify and Benchmark; null: the Evaluator service is not offered.
  evaluate::Evaluator* evaluator = nullptr;
};

// Static facts reported by GetServerInfo.
struct ServerFacts {
  std::string version;
  int kernel_abi_version = 0;
  std::string state_dir;
  std::vector<std::string> listen;
  std::string cpu_triple, cpu_name, cpu_features, compiler_id;
  bool gpu_available = false;
  std::string gpu_reason;
  std::vector<std::string> gpu_devices;
  std::string metrics_listen;  // [metrics] as bound, host:port; "": off
};

class RegistryService final : public v1::Registry::CallbackService {
 public:
  explicit RegistryService(CoreRefs core)
      : core_(core), ops_(core.registry, core.compiler, core.quotas, core.executor) {}
  grpc::ServerUnaryReactor* RegisterOp(grpc::CallbackServerContext* ctx,
                                       const v1::RegisterOpRequest* req,
                                       v1::RegisterOpResponse* resp) override;
  grpc::ServerUnaryReactor* ClearQuarantine(grpc::CallbackServerContext* ctx,
                                            const v1::ClearQuarantineRequest* req,
                                            v1::ClearQuarantineResponse* resp) override;
  grpc::ServerUnaryReactor* GetOp(grpc::CallbackServerContext* ctx, const v1::GetOpRequest* req,
                                  v1::OpRecord* resp) override;
  grpc::ServerUnaryReactor* ListOps(grpc::CallbackServerContext* ctx,
                                    const v1::ListOpsRequest* req,
                                    v1::ListOpsResponse* resp) override;
  grpc::ServerUnaryReactor* DeleteOp(grpc::CallbackServerContext* ctx,
                                     const v1::DeleteOpRequest* req,
                                     v1::DeleteOpResponse* resp) override;

 private:
  CoreRefs core_;
  const core::OpService ops_;
};

class CompilerService final : public v1::Compiler::CallbackService {
 public:
  explicit CompilerService(CoreRefs core)
      : core_(core), compiles_(core.compiler, core.quotas) {}
  grpc::ServerUnaryReactor* Compile(grpc::CallbackServerContext* ctx, const v1::CompileRequest* req,
                                    v1::CompileResponse* resp) override;
  grpc::ServerUnaryReactor* GetCacheStats(grpc::CallbackServerContext* ctx,
                                          const v1::GetCacheStatsRequest* req,
                                          v1::CacheStats* resp) override;
  grpc::ServerUnaryReactor* ClearCache(grpc::CallbackServerContext* ctx,
                                       const v1::ClearCacheRequest* req,
                                       v1::ClearCacheResponse* resp) override;

 private:
  CoreRefs core_;
  const core::CompileService compiles_;
};

class MemoryService final : public v1::Memory::CallbackService {
 public:
  explicit MemoryService(CoreRefs core) : core_(core) {}
  grpc::ServerUnaryReactor* CreateRegion(grpc::CallbackServerContext* ctx,
                                         const v1::CreateRegionRequest* req,
                                         v1::RegionInfo* resp) override;
  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterRegionRequest* req,
                                           v1::RegionInfo* resp) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* ctx,
                                             const v1::UnregisterRegionRequest* req,
                                             v1::UnregisterRegionResponse* resp) override;
  grpc::ServerUnaryReactor* ListRegions(grpc::CallbackServerContext* ctx,
                                        const v1::ListRegionsRequest* req,
                                        v1::ListRegionsResponse* resp) override;
  grpc::ServerUnaryReactor* RenewLease(grpc::CallbackServerContext* ctx,
                                       const v1::RenewLeaseRequest* req,
                                       v1::RenewLeaseResponse* resp) override;
  grpc::ServerUnaryReactor* ReleaseClient(grpc::CallbackServerContext* ctx,
                                          const v1::ReleaseClientRequest* req,
                                          v1::ReleaseClientResponse* resp) override;

 private:
  CoreRefs core_;
};

class ExecutorService final : public v1::Executor::CallbackService {
 public:
  explicit ExecutorService(CoreRefs core)
      : core_(core),
        calls_(core.executor, core.autograd, core.handles, core.channels, core.quotas) {}
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx, const v1::ForwardRequest* req,
                                    v1::ForwardResponse* resp) override;
  grpc::ServerUnaryReactor* Backward(grpc::CallbackServerContext* ctx,
                                     const v1::BackwardRequest* req,
                                     v1::BackwardResponse* resp) override;
  grpc::ServerUnaryReactor* ReleaseContext(grpc::CallbackServerContext* ctx,
                                           const v1::ReleaseContextRequest* req,
                                           v1::ReleaseContextResponse* resp) override;
  grpc::ServerUnaryReactor* GradCheck(grpc::CallbackServerContext* ctx,
                                      const v1::GradCheckRequest* req,
                                      v1::GradCheckResponse* resp) override;
  grpc::ServerUnaryReactor* Prepare(grpc::CallbackServerContext* ctx,
                                    const v1::PrepareRequest* req,
                                    v1::PrepareResponse* resp) override;
  grpc::ServerUnaryReactor* ReleaseHandles(grpc::CallbackServerContext* ctx,
                                           const v1::ReleaseHandlesRequest* req,
                                           v1::ReleaseHandlesResponse* resp) override;
  grpc::ServerUnaryReactor* OpenChannel(grpc::CallbackServerContext* ctx,
                                        const v1::OpenChannelRequest* req,
                                        v1::OpenChannelResponse* resp) override;

 private:
  CoreRefs core_;
  const core::CallService calls_;
};

// Verify and Benchmark (evaluate.proto): admitted as calls of the
// namespace, run by evaluate::Evaluator.
class EvaluatorService final : public v1::Evaluator::CallbackService {
 public:
  explicit EvaluatorService(CoreRefs core)
      : core_(core),
        calls_(core.executor, core.autograd, core.handles, core.channels, core.quotas) {}
  grpc::ServerUnaryReactor* Verify(grpc::CallbackServerContext* ctx, const v1::VerifyRequest* req,
                                   v1::VerifyResponse* resp) override;
  grpc::ServerUnaryReactor* Benchmark(grpc::CallbackServerContext* ctx,
                                      const v1::BenchmarkRequest* req,
                                      v1::BenchmarkResponse* resp) override;

 private:
  CoreRefs core_;
  const core::CallService calls_;
};

class ServerService final : public v1::Server::CallbackService {
 public:
  ServerService(CoreRefs core, ServerFacts facts)
      : core_(core), facts_(std::move(facts)), started_(std::chrono::steady_clock::now()) {}
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const v1::GetServerInfoRequest* req,
                                          v1::ServerInfo* resp) override;
  // The addresses actually bound ("127.0.0.1:0" becomes the port the kernel
  // picked), known only once the server has started.
  void SetBound(std::vector<std::string> bound);

 private:
  CoreRefs core_;
  const ServerFacts facts_;
  Mutex bound_mu_;
  std::vector<std::string> bound_ ABSL_GUARDED_BY(bound_mu_);  // empty until SetBound: facts_.listen
  const std::chrono::steady_clock::time_point started_;
};

}  // namespace opjit::rpc
