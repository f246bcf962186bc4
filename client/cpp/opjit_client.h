// The C++ client library of opjit: a thin, synchronous wrapper over the
// opjit.v1 gRPC services, used by the `opjit` CLI and the integration tests.
//
// Thread-safety: a Client may be used from many threads at once.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "opjit/v1/compile.grpc.pb.h"
#include "opjit/v1/exec.grpc.pb.h"
#include "opjit/v1/memory.grpc.pb.h"
#include "opjit/v1/registry.grpc.pb.h"
#include "opjit/v1/server.grpc.pb.h"

namespace opjit::client {

struct ClientOptions {
  // "unix:/path.sock", "/path.sock" (a unix socket), or "host:port".
  // Default: $OPJIT_SERVER, else the daemon's default socket.
  std::string address;
  // Deadline of each call. Default: 120 s (a cold compile can take seconds).
  std::chrono::milliseconds timeout{120000};
  // Largest message either way. Default: 64 MiB.
  int max_message_bytes = 64 << 20;
  // Bearer token sent as "authorization: Bearer <token>" on every call.
  // Default: $OPJIT_TOKEN (none when unset).
  std::string token;
  // PEM file of the CA that signed the server's certificate: TCP goes over
  // TLS. Default: $OPJIT_TLS_CA (plaintext when unset).
  std::string tls_ca_file;
};

// Errors keep the server's machine-readable reason (google.rpc.ErrorInfo in
// the status details): read it with opjit::GetReason(status)
// (server/common/error_info.h), e.g. "QUOTA_EXCEEDED", and decide on it,
// never on the message text.

class Client {
 public:
  // Creates a channel; does not contact the server (see WaitForReady).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options = {});

  const std::string& address() const { return address_; }

  // Blocks until the server accepts connections or `timeout` passes
  // (UNAVAILABLE then, naming the address).
  absl::Status WaitForReady(std::chrono::milliseconds timeout);

  absl::StatusOr<v1::ServerInfo> Info();

  // Registry. `ns` empty means "default"; version 0 means latest (Get) or all
  // versions (Delete).
  // Problems that do not stop a registration (a backward.op naming no
  // registered op yet) come back in the response's warnings(), as they do in
  // the OpRecord's warnings() from Get and List.
  absl::StatusOr<v1::RegisterOpResponse> Register(const v1::OpDef& op);
  absl::StatusOr<v1::OpRecord> Get(const std::string& ns, const std::string& name,
                                   int64_t version = 0);
  absl::StatusOr<std::vector<v1::OpRecord>> List(const std::string& ns = "",
                                                 bool all_versions = false,
                                                 bool with_sources = false);
  absl::StatusOr<int> Delete(const std::string& ns, const std::string& name, int64_t version = 0);

  // Compiler and cache.
  absl::StatusOr<v1::CompileResponse> Compile(const v1::CompileRequest& request);
  absl::StatusOr<v1::CacheStats> CacheStats();
  absl::StatusOr<uint64_t> ClearCache(bool memory_only);

  // Shared memory. `client_id` owns the lease; empty: this Client's own id.
  absl::StatusOr<v1::RegionInfo> CreateRegion(const std::string& ns, const std::string& name,
                                              uint64_t byte_size, int64_t lease_ms = 0);
  absl::StatusOr<v1::RegionInfo> RegisterRegion(const std::string& ns, const std::string& name,
                                                const std::string& shm_key, uint64_t offset,
                                                uint64_t byte_size, int64_t lease_ms = 0);
  absl::Status UnregisterRegion(const std::string& ns, const std::string& name);
  absl::StatusOr<std::vector<v1::RegionInfo>> ListRegions(const std::string& ns);
  absl::StatusOr<int64_t> RenewLease(const std::string& ns, int64_t lease_ms = 0);
  absl::StatusOr<int> ReleaseRegions(const std::string& ns);

  // Runs an op's forward.
  absl::StatusOr<v1::ForwardResponse> Forward(const v1::ForwardRequest& request);
  // Autograd: backward on a context kept by a forward with requires_grad.
  absl::StatusOr<v1::BackwardResponse> Backward(const v1::BackwardRequest& request);
  absl::Status ReleaseContext(const std::string& ns, const std::string& context_id);
  absl::StatusOr<v1::GradCheckResponse> GradCheck(const v1::GradCheckRequest& request);

  // The id this client's regions are leased under (random per Client).
  const std::string& client_id() const { return client_id_; }

 private:
  Client() = default;
  std::unique_ptr<grpc::ClientContext> NewContext() const;

  std::string address_;
  std::chrono::milliseconds timeout_{0};
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Registry::Stub> registry_;
  std::unique_ptr<v1::Compiler::Stub> compiler_;
  std::unique_ptr<v1::Server::Stub> server_;
  std::unique_ptr<v1::Memory::Stub> memory_;
  std::unique_ptr<v1::Executor::Stub> executor_;
  std::string client_id_;
  std::string token_;
};

// Tensor helpers for building requests.
// An inline tensor holding a copy of `bytes`.
v1::Tensor InlineTensor(const std::string& dtype, const std::vector<int64_t>& shape,
                        std::string_view bytes);
// A tensor in a registered region.
v1::Tensor ShmTensor(const std::string& dtype, const std::vector<int64_t>& shape,
                     const std::string& region, uint64_t offset);
// A text attr value, parsed by the server as the attr's declared type.
v1::AttrValue TextAttr(const std::string& text);

// Reads an op spec: a JSON file in protobuf's JSON mapping of opjit.v1.OpDef
// (snake_case or lowerCamelCase keys). Each implementation's `source_file` is
// read relative to the spec's directory into `source`. INVALID_ARGUMENT with
// the parser's message for bad JSON or unknown fields; NOT_FOUND for a
// missing source file.
absl::StatusOr<v1::OpDef> LoadOpSpec(const std::string& path);
absl::StatusOr<v1::OpDef> ParseOpSpec(std::string_view json, const std::string& base_dir);

// "unix:" + path for a bare path; otherwise unchanged.
std::string NormalizeAddress(const std::string& address);

}  // namespace opjit::client
