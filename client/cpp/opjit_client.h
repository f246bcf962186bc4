// The C++ client library of opjit: a thin, synchronous wrapper over the
// opjit.v1 gRPC services, used by the `opjit` CLI and the integration tests.
//
// Thread-safety: a Client may be used from many threads at once.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/common/mutex.h"
#include "opjit/v1/compile.grpc.pb.h"
#include "opjit/v1/evaluate.grpc.pb.h"
#include "opjit/v1/exec.grpc.pb.h"
#include "opjit/v1/memory.grpc.pb.h"
#include "opjit/v1/registry.grpc.pb.h"
#include "opjit/v1/server.grpc.pb.h"

namespace opjit::client {

// How a Client with several server addresses picks one for a call (see
// "Several servers" at Client).
enum class Routing {
  kFailover,  // the first daemon that answers; the next when it stops answering
  kAffinity,  // op calls by rendezvous hash of (namespace, op) over the addresses
};

struct ClientOptions {
  // "unix:/path.sock", "/path.sock" (a unix socket), or "host:port"; or
  // several of them, comma-separated. Default: $OPJIT_SERVER (which may be
  // such a list), else the daemon's default socket.
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
  // The same-host fast path (prepared handles run on a shared-memory channel
  // to the namespace's executor, no gRPC per call):
  //   "auto": used when the address is a unix socket and the server offers
  //           it (OpenChannel); any call it cannot serve goes over gRPC;
  //   "on":   as auto, but a call that qualifies fails when the channel
  //           cannot be opened (for tests that must exercise the fast path);
  //   "off":  every call over gRPC.
  // Default: $OPJIT_FAST ("1"/"on", "0"/"off", "auto"), else "auto".
  std::string fast;
  // Several addresses as a list (when not empty, `address` is ignored).
  std::vector<std::string> addresses;
  // With several addresses: how calls are routed. Default: kFailover.
  Routing routing = Routing::kFailover;
  // With several addresses: how long a health check may take before its
  // daemon counts as down. Default: 1 s.
  std::chrono::milliseconds health_timeout{1000};
};

// A call shape checked once by the server (Prepare): run it with
// Client::CallPrepared, or name it in ForwardRequest.handle.
struct PreparedCall {
  std::string ns;
  uint64_t handle = 0;
  int64_t version = 0;
  std::vector<v1::TensorSpec> inputs;   // flat, in call order
  std::vector<v1::TensorSpec> outputs;  // static per handle
  bool fast = false;                    // it can run on a fast channel
};

// One tensor of a fast call: a region by its RegionInfo.id (0: a null
// optional input) and a byte offset into it.
struct FastTensorRef {
  uint64_t region = 0;
  uint64_t offset = 0;
};

struct FastState;  // fast_call.h: handle cache, region ids, open channels

// Errors keep the server's machine-readable reason (google.rpc.ErrorInfo in
// the status details): read it with opjit::GetReason(status)
// (server/common/error_info.h), e.g. "QUOTA_EXCEEDED", and decide on it,
// never on the message text.

// Several servers. Given several addresses, a Client keeps a channel to
// each and routes every call:
//  - calls safe to repeat (Info, Get, List, Compile, CacheStats, GradCheck,
//    Verify, Benchmark, and Forward with every tensor inline, no handle and no requires_grad)
//    go to the current daemon (kFailover: at first the first that answers a
//    gRPC health check within health_timeout) or, under kAffinity, to the
//    daemon that ranks first for the call's (namespace, op) by rendezvous
//    hashing (RendezvousOrder), so the daemon with the kernel warm gets it
//    and adding a daemon moves few ops. When one fails with UNAVAILABLE
//    from the transport (a daemon's own UNAVAILABLE carries a reason and is
//    returned as is), that daemon is skipped for a while and the call moves
//    on to the next;
//  - calls that change state (Register, Delete, ClearCache) go to a daemon
//    that just answered a health check, and are not repeated elsewhere once
//    sent;
//  - calls on state one daemon holds (regions, prepared handles, fast
//    channels, backward contexts, Forward with shm tensors, a handle or
//    requires_grad) all go to one "home" daemon, the first healthy one at
//    the first such call, pinned from then on. Shared memory and the fast
//    path are per host: the fast path is used only when the home address is
//    a unix socket.
// With one address everything behaves as it always did.
class Client {
 public:
  // Creates the channels; does not contact the server (see WaitForReady).
  // INVALID_ARGUMENT for an empty address list or a bad address.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options = {});

  // The first address (the only one, with one).
  const std::string& address() const { return address_; }
  // Every address, normalized, in the order given.
  const std::vector<std::string>& addresses() const { return addresses_; }
  // Where calls that are not routed by affinity go now.
  std::string current_address() const;
  // The addresses in the order an op call of (ns, op) tries them under
  // kAffinity, best first.
  std::vector<std::string> PreferredAddresses(const std::string& ns, const std::string& op) const;

  // Blocks until the server accepts connections or `timeout` passes
  // (UNAVAILABLE then, naming the address). With several addresses: until
  // one of them answers a health check (it becomes the current one).
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
  // Admins: lifts the quarantine of every version of op `name` of `ns`; how
  // many of its kernels were quarantined.
  absl::StatusOr<int> ClearQuarantine(const std::string& ns, const std::string& name);

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

  // Runs an op's forward. On the fast path (see ClientOptions::fast) a call
  // whose inputs are all in shared memory and whose outputs all go to `shm`
  // or `alloc_in` placements, with no requires_grad, runs on a prepared
  // handle over the shared-memory channel and answers what the gRPC path
  // would (outputs as ShmRef tensors, kernel_ms, version; server_ms is the
  // client's own round trip). Everything else goes over gRPC unchanged.
  // request.keep_output_bytes holds on both paths: outputs in this client's
  // regions keep their bytes instead of starting zeroed.
  absl::StatusOr<v1::ForwardResponse> Forward(const v1::ForwardRequest& request);
  // Autograd: backward on a context kept by a forward with requires_grad.
  absl::StatusOr<v1::BackwardResponse> Backward(const v1::BackwardRequest& request);
  absl::Status ReleaseContext(const std::string& ns, const std::string& context_id);
  absl::StatusOr<v1::GradCheckResponse> GradCheck(const v1::GradCheckRequest& request);

  // Evaluator. Verify runs the candidate and the reference (or the given
  // cases) on inputs the server generates and compares them; a case that
  // fails is reported in the response (passed() false), not as an error.
  // Benchmark times an op (and a reference in alternation). Both run under
  // the client's deadline (ClientOptions::timeout), which must cover every
  // case or repetition; both are safe to repeat and routed as op calls of
  // (namespace, candidate or op).
  absl::StatusOr<v1::VerifyResponse> Verify(const v1::VerifyRequest& request);
  absl::StatusOr<v1::BenchmarkResponse> Benchmark(const v1::BenchmarkRequest& request);

  // Prepared calls. `client_id` empty: this Client's own id.
  absl::StatusOr<v1::PrepareResponse> Prepare(const v1::PrepareRequest& request);
  // Releases `handles` (empty: every handle of this client in `ns`).
  absl::StatusOr<int> ReleaseHandles(const std::string& ns, const std::vector<uint64_t>& handles);
  // Opens a fast channel (a region of this client's, mapped by the caller).
  absl::StatusOr<v1::OpenChannelResponse> OpenChannel(const std::string& ns,
                                                      int64_t lease_ms = 0);

  // Prepare, as a PreparedCall.
  absl::StatusOr<PreparedCall> PrepareHandle(const v1::PrepareRequest& request);
  // Runs a prepared call on this client's fast channel for `call.ns` (opened
  // on first use): `tensors` are the inputs then the outputs, as the
  // handle's specs. Returns the kernel's time in ms, or the call's status
  // (code and reason as the gRPC path would answer; STALE_HANDLE is not
  // retried here: prepare again). `deadline`: 0 means the client's timeout.
  // `keep_output_bytes`: the outputs are not zero-filled before the kernel
  // (as ForwardRequest.keep_output_bytes; they are in this client's regions).
  // FAILED_PRECONDITION when the fast path is off or unavailable.
  absl::StatusOr<double> CallPrepared(const PreparedCall& call,
                                      std::span<const FastTensorRef> tensors,
                                      std::chrono::nanoseconds deadline = {},
                                      bool keep_output_bytes = false);
  // The RegionInfo.id of region `name` in `ns` (from this client's
  // CreateRegion/RegisterRegion answers, else ListRegions).
  absl::StatusOr<uint64_t> RegionId(const std::string& ns, const std::string& name);
  // Whether this client would try the fast path ("auto"/"on" on a unix socket).
  bool fast_enabled() const;

  // The id this client's regions are leased under (random per Client).
  const std::string& client_id() const { return client_id_; }

  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

 private:
  Client();
  // The gRPC path of Forward.
  absl::StatusOr<v1::ForwardResponse> ForwardGrpc(const v1::ForwardRequest& request);
  // The fast path of Forward (fast_call.cc): no value when the call must go
  // over gRPC instead.
  std::optional<absl::StatusOr<v1::ForwardResponse>> ForwardFast(const v1::ForwardRequest& request);
  std::unique_ptr<grpc::ClientContext> NewContext() const;

  // One address: its channel and stubs, and whether it answers.
  struct Endpoint;
  using EndpointCall = std::function<grpc::Status(Endpoint&, grpc::ClientContext*)>;
  enum class CallKind {
    kIdempotent,  // safe to repeat on another daemon
    kOnce,        // sent to a daemon that just answered; never repeated
    kPinned,      // on the home daemon (its state), never elsewhere
  };
  // Runs `fn` on the endpoint(s) `kind` says (see "Several servers");
  // `op` non-empty: an op call of (ns, op), routed by affinity when asked.
  absl::Status Invoke(CallKind kind, const EndpointCall& fn, const std::string& ns = "",
                      const std::string& op = "");
  // An op call of (ns, op) safe to repeat (kIdempotent): `fn` fills the
  // response from one endpoint.
  template <typename Response>
  absl::StatusOr<Response> OpCall(
      const std::string& ns, const std::string& op,
      const std::function<grpc::Status(Endpoint&, grpc::ClientContext*, Response*)>& fn);
  // The endpoints in the order a call tries them; down ones last.
  std::vector<Endpoint*> Order(const std::string& ns, const std::string& op) const;
  // A health check on `e` (marks it up or down).
  bool Check(Endpoint& e) const;
  // The home endpoint, chosen (the first healthy one) and pinned on first use.
  absl::StatusOr<Endpoint*> Home();

  std::string address_;
  std::vector<std::string> addresses_;
  Routing routing_ = Routing::kFailover;
  std::chrono::milliseconds health_timeout_{1000};
  std::chrono::milliseconds timeout_{0};
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  std::atomic<size_t> current_{0};
  Mutex home_mu_;
  Endpoint* home_ ABSL_GUARDED_BY(home_mu_) = nullptr;  // set once
  std::string client_id_;
  std::string token_;
  std::unique_ptr<FastState> fast_;
};

// Tensor helpers for building requests.
// An inline tensor holding a copy of `bytes`.
v1::Tensor InlineTensor(const std::string& dtype, const std::vector<int64_t>& shape,
                        std::string_view bytes);
// An inline tensor taking `bytes` over (no copy: for big tensors).
v1::Tensor InlineTensor(const std::string& dtype, const std::vector<int64_t>& shape,
                        std::string&& bytes);
// A tensor in a registered region.
v1::Tensor ShmTensor(const std::string& dtype, const std::vector<int64_t>& shape,
                     const std::string& region, uint64_t offset);
// A text attr value, parsed by the server as the attr's declared type.
v1::AttrValue TextAttr(const std::string& text);

// Reads an op spec: a JSON file in protobuf's JSON mapping of opjit.v1.OpDef
// (snake_case or lowerCamelCase keys). Each implementation's `source_file` is
// read relative to the spec's directory into `source`, and so is each of its
// extra `files` given by `path` (`"files": ["helper.h"]` is short for
// `[{"path": "helper.h"}]`) into `content`; such a file's name defaults to
// the path as written, made plain ("detail/x.h"), or its base name when the
// path is absolute or climbs out with "..". INVALID_ARGUMENT with the
// parser's message for bad JSON or unknown fields; NOT_FOUND for a missing
// source file or extra file.
absl::StatusOr<v1::OpDef> LoadOpSpec(const std::string& path);
absl::StatusOr<v1::OpDef> ParseOpSpec(std::string_view json, const std::string& base_dir);

// "unix:" + path for a bare path; otherwise unchanged.
std::string NormalizeAddress(const std::string& address);
// The addresses of a comma-separated list, trimmed and normalized (empty
// items dropped).
std::vector<std::string> SplitAddresses(std::string_view list);
// The rendezvous score of `address` for (ns, op) (ns "" counts as
// "default"): FNV-1a 64 of "ns\0op\0address" through splitmix64's
// finalizer, as the Python client computes it. Higher wins.
uint64_t RendezvousScore(std::string_view ns, std::string_view op, std::string_view address);
// `addresses` ranked for (ns, op), best first.
std::vector<std::string> RendezvousOrder(std::string_view ns, std::string_view op,
                                         std::vector<std::string> addresses);

}  // namespace opjit::client
