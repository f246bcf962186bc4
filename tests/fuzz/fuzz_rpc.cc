// Every RPC of opjit.v1, decoded from fuzzer bytes and handled in-process by
// the real service layer: a real registry (SQLite in a temp dir), compiler
// (sandboxed compile workers), region manager, executor with sandboxed
// executor processes, and autograd, behind the real gRPC server on a unix
// socket. The first byte picks the method; the rest is its request message.
// Invariants: no call crashes or hangs the server, and every failure has a
// code a client can act on: never INTERNAL, UNKNOWN, DATA_LOSS or
// UNIMPLEMENTED.
#include <grpcpp/grpcpp.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "opjit/v1/compile.grpc.pb.h"
#include "opjit/v1/exec.grpc.pb.h"
#include "opjit/v1/memory.grpc.pb.h"
#include "opjit/v1/registry.grpc.pb.h"
#include "opjit/v1/server.grpc.pb.h"
#include "server/autograd/autograd.h"
#include "server/common/logging.h"
#include "server/compiler/kernel_compiler.h"
#include "server/exec/executor.h"
#include "server/registry/registry.h"
#include "server/rpc/grpc_server.h"
#include "server/exec/channels.h"
#include "server/exec/handles.h"
#include "server/runner/process_runner.h"
#include "server/tensor/region_manager.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

namespace v1 = opjit::v1;

struct Server {
  std::string dir;
  std::unique_ptr<opjit::registry::Registry> registry;
  std::unique_ptr<opjit::compiler::KernelCompiler> compiler;
  std::unique_ptr<opjit::tensor::RegionManager> regions;
  std::unique_ptr<opjit::runner::KernelRunner> runner;
  std::unique_ptr<opjit::exec::Executor> executor;
  std::unique_ptr<opjit::autograd::Autograd> autograd;
  std::unique_ptr<opjit::exec::HandleTable> handles;
  std::unique_ptr<opjit::exec::ChannelManager> channels;
  std::unique_ptr<opjit::rpc::GrpcServer> grpc;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Registry::Stub> reg;
  std::unique_ptr<v1::Compiler::Stub> comp;
  std::unique_ptr<v1::Memory::Stub> mem;
  std::unique_ptr<v1::Executor::Stub> exec;
  std::unique_ptr<v1::Server::Stub> info;
};

template <typename T>
std::unique_ptr<T> Must(absl::StatusOr<std::unique_ptr<T>> v) {
  if (!v.ok()) {
    std::fprintf(stderr, "fuzz_rpc setup: %s\n", v.status().ToString().c_str());
    std::abort();
  }
  return *std::move(v);
}

Server* Start() {
  opjit::SetLogLevel("off");
  auto* s = new Server;
  std::string tmpl = (std::filesystem::temp_directory_path() / "opjit-fuzz-rpc-XXXXXX").string();
  FUZZ_CHECK(::mkdtemp(tmpl.data()) != nullptr);
  s->dir = tmpl;
  s->registry = Must(opjit::registry::Registry::Create({.db_path = s->dir + "/registry.db"}));
  opjit::compiler::KernelCompilerOptions c;
  c.cache_dir = s->dir + "/cache";
  c.worker_path = OPJIT_BINARY_DIR "/bin/opjit-compile-worker";
  c.kernel_include_dir = OPJIT_SOURCE_DIR "/kernels/include";
  c.timeout_ms = 5000;
  s->compiler = Must(opjit::compiler::KernelCompiler::Create(c));
  opjit::tensor::RegionManagerOptions r;
  r.instance_tag = "fuzz" + std::to_string(::getpid());
  r.namespace_quota_bytes = 64 << 20;
  s->regions = Must(opjit::tensor::RegionManager::Create(r));
  opjit::runner::ProcessRunnerOptions p;
  p.worker_path = OPJIT_BINARY_DIR "/bin/opjit-exec-worker";
  p.kernel_timeout_ms = 2000;
  p.memory_bytes = 512ull << 20;
  p.arena_bytes = 16 << 20;
  p.host.scratch_dir = s->dir + "/scratch";
  std::filesystem::create_directories(p.host.scratch_dir);
  s->runner = Must(opjit::runner::ProcessRunner::Create(p));
  opjit::exec::ExecutorOptions e;
  e.max_inline_output_bytes = 4 << 20;
  s->executor = Must(opjit::exec::Executor::Create(e, s->registry.get(), s->compiler.get(),
                                                   s->regions.get(), s->runner.get()));
  s->autograd = Must(opjit::autograd::Autograd::Create(
      {.ttl_ms = 60000, .namespace_bytes = 64 << 20, .gradcheck_threads = 1},
      s->registry.get(), s->executor.get()));
  s->handles = std::make_unique<opjit::exec::HandleTable>(
      opjit::exec::HandleTableOptions{.max_per_namespace = 64}, s->registry.get());
  s->channels = std::make_unique<opjit::exec::ChannelManager>(
      opjit::exec::ChannelOptions{.per_namespace = 2, .total = 4}, s->regions.get(),
      s->handles.get(), s->runner.get());
  const std::string address = "unix:" + s->dir + "/opjitd.sock";
  s->grpc = Must(opjit::rpc::GrpcServer::Start(
      {.listen = {address}, .max_message_bytes = 8 << 20},
      {.registry = s->registry.get(), .compiler = s->compiler.get(), .regions = s->regions.get(),
       .executor = s->executor.get(), .autograd = s->autograd.get(),
       .handles = s->handles.get(), .channels = s->channels.get()},
      {.version = "fuzz", .state_dir = s->dir, .listen = {address}}));
  s->channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  s->reg = v1::Registry::NewStub(s->channel);
  s->comp = v1::Compiler::NewStub(s->channel);
  s->mem = v1::Memory::NewStub(s->channel);
  s->exec = v1::Executor::NewStub(s->channel);
  s->info = v1::Server::NewStub(s->channel);
  return s;
}

Server* TheServer() {
  static Server* s = Start();
  return s;
}

// At exit: the temp dir and any shm object the region manager made go too
// (the server itself is never torn down; its workers die with this process).
struct Cleanup {
  ~Cleanup() {
    std::error_code ec;
    if (server != nullptr) std::filesystem::remove_all(server->dir, ec);
    const std::string prefix = "opjit.fuzz" + std::to_string(::getpid()) + ".";
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind(prefix, 0) == 0) ::shm_unlink(("/" + name).c_str());
    }
  }
  Server* server = nullptr;
} cleanup;

bool Acceptable(const grpc::Status& st) {
  switch (st.error_code()) {
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::DATA_LOSS:
    case grpc::StatusCode::UNIMPLEMENTED:
      std::fprintf(stderr, "fuzz_rpc: code %d: %s\n", st.error_code(),
                   st.error_message().c_str());
      return false;
    default:
      return true;
  }
}

// Decodes `bytes` as Req and calls `method` on it; undecodable input is not
// a call at all (protobuf would refuse it before the service layer).
template <typename Req, typename Resp, typename Stub, typename Method>
void Call(Stub* stub, Method method, const std::string& bytes) {
  Req req;
  if (!req.ParseFromString(bytes)) return;
  Resp resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  grpc::Status st = (stub->*method)(&ctx, req, &resp);
  FUZZ_CHECK(st.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED ||
             req.GetDescriptor()->name() == "GradCheckRequest" ||
             req.GetDescriptor()->name() == "ForwardRequest" ||
             req.GetDescriptor()->name() == "BackwardRequest");
  FUZZ_CHECK(Acceptable(st));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Server* s = TheServer();
  cleanup.server = s;
  if (size < 1 || size > (1 << 20)) return 0;
  const std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 21) {
    case 0: Call<v1::RegisterOpRequest, v1::RegisterOpResponse>(s->reg.get(), &v1::Registry::Stub::RegisterOp, body); break;
    case 1: Call<v1::GetOpRequest, v1::OpRecord>(s->reg.get(), &v1::Registry::Stub::GetOp, body); break;
    case 2: Call<v1::ListOpsRequest, v1::ListOpsResponse>(s->reg.get(), &v1::Registry::Stub::ListOps, body); break;
    case 3: Call<v1::DeleteOpRequest, v1::DeleteOpResponse>(s->reg.get(), &v1::Registry::Stub::DeleteOp, body); break;
    case 4: Call<v1::CompileRequest, v1::CompileResponse>(s->comp.get(), &v1::Compiler::Stub::Compile, body); break;
    case 5: Call<v1::GetCacheStatsRequest, v1::CacheStats>(s->comp.get(), &v1::Compiler::Stub::GetCacheStats, body); break;
    case 6: Call<v1::ClearCacheRequest, v1::ClearCacheResponse>(s->comp.get(), &v1::Compiler::Stub::ClearCache, body); break;
    case 7: Call<v1::CreateRegionRequest, v1::RegionInfo>(s->mem.get(), &v1::Memory::Stub::CreateRegion, body); break;
    case 8: Call<v1::RegisterRegionRequest, v1::RegionInfo>(s->mem.get(), &v1::Memory::Stub::RegisterRegion, body); break;
    case 9: Call<v1::UnregisterRegionRequest, v1::UnregisterRegionResponse>(s->mem.get(), &v1::Memory::Stub::UnregisterRegion, body); break;
    case 10: Call<v1::ListRegionsRequest, v1::ListRegionsResponse>(s->mem.get(), &v1::Memory::Stub::ListRegions, body); break;
    case 11: Call<v1::RenewLeaseRequest, v1::RenewLeaseResponse>(s->mem.get(), &v1::Memory::Stub::RenewLease, body); break;
    case 12: Call<v1::ReleaseClientRequest, v1::ReleaseClientResponse>(s->mem.get(), &v1::Memory::Stub::ReleaseClient, body); break;
    case 13: Call<v1::ForwardRequest, v1::ForwardResponse>(s->exec.get(), &v1::Executor::Stub::Forward, body); break;
    case 14: Call<v1::BackwardRequest, v1::BackwardResponse>(s->exec.get(), &v1::Executor::Stub::Backward, body); break;
    case 15: Call<v1::GradCheckRequest, v1::GradCheckResponse>(s->exec.get(), &v1::Executor::Stub::GradCheck, body); break;
    case 16: Call<v1::ReleaseContextRequest, v1::ReleaseContextResponse>(s->exec.get(), &v1::Executor::Stub::ReleaseContext, body); break;
    case 17: Call<v1::GetServerInfoRequest, v1::ServerInfo>(s->info.get(), &v1::Server::Stub::GetServerInfo, body); break;
    case 18: Call<v1::PrepareRequest, v1::PrepareResponse>(s->exec.get(), &v1::Executor::Stub::Prepare, body); break;
    case 19: Call<v1::ReleaseHandlesRequest, v1::ReleaseHandlesResponse>(s->exec.get(), &v1::Executor::Stub::ReleaseHandles, body); break;
    case 20: Call<v1::OpenChannelRequest, v1::OpenChannelResponse>(s->exec.get(), &v1::Executor::Stub::OpenChannel, body); break;
  }
  return 0;
}
