#include "client/cpp/opjit_client.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/cord.h"
#include "client/cpp/fast_call.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "opjit/v1/error.pb.h"
#include "server/common/error_info.h"
#include "server/common/paths.h"
#include "server/common/random.h"

namespace opjit::client {
namespace {

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  v1::Status rich;
  if (s.error_details().empty() || !rich.ParseFromString(s.error_details())) return out;
  for (const auto& any : rich.details()) {
    if (any.type_url() != "type.googleapis.com/google.rpc.ErrorInfo") continue;
    v1::ErrorInfo info;
    if (!info.ParseFromString(any.value())) continue;
    // The reason travels as the same payload the server's core uses.
    std::string text = info.reason();
    for (const auto& [k, v] : info.metadata()) absl::StrAppend(&text, "\n", k, "=", v);
    out.SetPayload(kReasonPayloadUrl, absl::Cord(text));
  }
  return out;
}

std::string EnvOr(const std::string& value, const char* name) {
  if (!value.empty()) return value;
  const char* env = std::getenv(name);
  return env != nullptr ? env : "";
}

// Keeps the id of a region this client just created or registered.
void RememberRegion(FastState& st, const std::string& ns, const v1::RegionInfo& info) {
  if (info.id() == 0) return;
  const std::string key = ns.empty() ? "default" : ns;
  MutexLock lock(&st.mu);
  st.region_ids[key][info.name()] = info.id();
  st.foreign_regions[key].erase(info.name());
}

// Forgets region `*name` of `ns` (all of them, with the namespace's
// channels and handles, when null: the client released its regions).
void ForgetRegions(FastState& st, const std::string& ns, const std::string* name) {
  const std::string key = ns.empty() ? "default" : ns;
  MutexLock lock(&st.mu);
  if (name != nullptr) {
    st.region_ids[key].erase(*name);
    st.foreign_regions[key].erase(*name);
    return;
  }
  st.region_ids.erase(key);
  st.foreign_regions.erase(key);
  st.channels.erase(key);
  for (auto it = st.handles.begin(); it != st.handles.end();) {
    const std::string hk = it->second->ns.empty() ? "default" : it->second->ns;
    it = hk == key ? st.handles.erase(it) : std::next(it);
  }
}

}  // namespace

std::string NormalizeAddress(const std::string& address) {
  if (!address.empty() && (address[0] == '/' || address[0] == '.')) return "unix:" + address;
  return address;
}

std::vector<std::string> SplitAddresses(std::string_view list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string_view::npos) end = list.size();
    std::string_view item = list.substr(start, end - start);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.remove_prefix(1);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.remove_suffix(1);
    if (!item.empty()) out.push_back(NormalizeAddress(std::string(item)));
    start = end + 1;
  }
  return out;
}

uint64_t RendezvousScore(std::string_view ns, std::string_view op, std::string_view address) {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](std::string_view part) {
    for (unsigned char c : part) h = (h ^ c) * 0x100000001b3ull;
  };
  mix(ns.empty() ? std::string_view("default") : ns);
  mix(std::string_view("\0", 1));
  mix(op);
  mix(std::string_view("\0", 1));
  mix(address);
  // splitmix64's finalizer: FNV alone spreads nearby strings poorly.
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

std::vector<std::string> RendezvousOrder(std::string_view ns, std::string_view op,
                                         std::vector<std::string> addresses) {
  std::stable_sort(addresses.begin(), addresses.end(), [&](const std::string& a, const std::string& b) {
    return RendezvousScore(ns, op, a) > RendezvousScore(ns, op, b);
  });
  return addresses;
}

namespace {

using SteadyClock = std::chrono::steady_clock;
// An endpoint that failed is skipped this long (unless every one is down).
constexpr auto kDownFor = std::chrono::seconds(2);

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             SteadyClock::now().time_since_epoch())
      .count();
}

bool IsUnix(const std::string& address) { return address.rfind("unix:", 0) == 0; }

// UNAVAILABLE that no daemon sent: every daemon error carries a reason
// (google.rpc.ErrorInfo); gRPC's own connection failures carry none.
bool TransportUnavailable(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable && !GetReason(s).has_value();
}

// A call whose tensors all travel inline and that leaves nothing behind on
// the server: safe to send to any daemon, and again to another.
bool InlineOnly(const v1::ForwardRequest& r) {
  if (r.handle() != 0) return false;
  for (bool g : r.requires_grad()) {
    if (g) return false;
  }
  for (const auto& arg : r.inputs()) {
    for (const auto& t : arg.tensors()) {
      if (t.has_shm()) return false;
    }
  }
  for (const auto& p : r.outputs()) {
    if (p.has_shm() || p.has_alloc_in()) return false;
  }
  return true;
}

}  // namespace

struct Client::Endpoint {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Registry::Stub> registry;
  std::unique_ptr<v1::Compiler::Stub> compiler;
  std::unique_ptr<v1::Server::Stub> server;
  std::unique_ptr<v1::Memory::Stub> memory;
  std::unique_ptr<v1::Executor::Stub> executor;
  std::unique_ptr<v1::Evaluator::Stub> evaluator;
  // Passed a health check or a call since it last failed.
  std::atomic<bool> healthy{false};
  std::atomic<int64_t> down_until_ns{0};

  void MarkDown() {
    healthy.store(false);
    down_until_ns.store(SteadyNs() + std::chrono::nanoseconds(kDownFor).count());
  }
  void MarkUp() {
    healthy.store(true);
    down_until_ns.store(0);
  }
};

Client::Client() : fast_(std::make_unique<FastState>()) {}

Client::~Client() {
  // Hand back what the fast path holds on the server (handles, channel
  // regions) instead of leaving it to the lease; best effort, briefly.
  std::vector<std::string> handle_ns;
  std::vector<std::pair<std::string, std::string>> channel_regions;
  {
    MutexLock lock(&fast_->mu);
    for (const auto& [key, call] : fast_->handles) {
      if (std::find(handle_ns.begin(), handle_ns.end(), call->ns) == handle_ns.end()) {
        handle_ns.push_back(call->ns);
      }
    }
    for (const auto& [ns, ch] : fast_->channels) channel_regions.emplace_back(ns, ch->region());
    fast_->channels.clear();
  }
  if (endpoints_.empty() || (handle_ns.empty() && channel_regions.empty())) return;
  timeout_ = std::chrono::milliseconds(500);
  for (const auto& [ns, region] : channel_regions) (void)UnregisterRegion(ns, region);
  for (const auto& ns : handle_ns) (void)ReleaseHandles(ns, {});
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  std::unique_ptr<Client> c(new Client());
  if (!options.addresses.empty()) {
    for (const auto& a : options.addresses) {
      for (auto& one : SplitAddresses(a)) c->addresses_.push_back(std::move(one));
    }
  } else {
    c->addresses_ = SplitAddresses(options.address.empty() ? DefaultServerAddress() : options.address);
  }
  if (c->addresses_.empty()) return absl::InvalidArgumentError("no server address given");
  c->address_ = c->addresses_.front();
  c->routing_ = options.routing;
  c->health_timeout_ = options.health_timeout;
  auto mode = ParseFastMode(EnvOr(options.fast, "OPJIT_FAST"));
  if (!mode.ok()) return mode.status();
  c->fast_->mode = *mode;
  // With several addresses the home daemon decides (see Home()).
  c->fast_->unix_socket = c->addresses_.size() == 1 && IsUnix(c->address_);
  c->timeout_ = options.timeout;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  c->token_ = EnvOr(options.token, "OPJIT_TOKEN");
  const std::string ca_file = EnvOr(options.tls_ca_file, "OPJIT_TLS_CA");
  std::shared_ptr<grpc::ChannelCredentials> tls;
  if (!ca_file.empty()) {
    std::ifstream in(ca_file, std::ios::binary);
    std::stringstream pem;
    pem << in.rdbuf();
    if (!in || pem.str().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("cannot read the TLS CA file ", ca_file));
    }
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = pem.str();
    tls = grpc::SslCredentials(ssl);
  }
  for (const std::string& address : c->addresses_) {
    auto e = std::make_unique<Endpoint>();
    e->address = address;
    e->channel = grpc::CreateCustomChannel(
        address, tls != nullptr && !IsUnix(address) ? tls : grpc::InsecureChannelCredentials(),
        args);
    if (e->channel == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("bad server address ", address));
    }
    e->registry = v1::Registry::NewStub(e->channel);
    e->compiler = v1::Compiler::NewStub(e->channel);
    e->server = v1::Server::NewStub(e->channel);
    e->memory = v1::Memory::NewStub(e->channel);
    e->executor = v1::Executor::NewStub(e->channel);
    e->evaluator = v1::Evaluator::NewStub(e->channel);
    c->endpoints_.push_back(std::move(e));
  }
  auto id = RandomHex128();
  if (!id.ok()) return id.status();
  c->client_id_ = "cpp-" + id->substr(0, 16);
  return c;
}

std::unique_ptr<grpc::ClientContext> Client::NewContext() const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + timeout_);
  if (!token_.empty()) ctx->AddMetadata("authorization", "Bearer " + token_);
  return ctx;
}

std::string Client::current_address() const {
  return endpoints_[current_.load() % endpoints_.size()]->address;
}

std::vector<std::string> Client::PreferredAddresses(const std::string& ns,
                                                    const std::string& op) const {
  return RendezvousOrder(ns, op, addresses_);
}

std::vector<Client::Endpoint*> Client::Order(const std::string& ns, const std::string& op) const {
  std::vector<Endpoint*> eps;
  if (!op.empty() && routing_ == Routing::kAffinity) {
    for (const std::string& a : RendezvousOrder(ns, op, addresses_)) {
      for (const auto& e : endpoints_) {
        if (e->address == a && std::find(eps.begin(), eps.end(), e.get()) == eps.end()) {
          eps.push_back(e.get());
          break;
        }
      }
    }
  } else {
    const size_t k = current_.load() % endpoints_.size();
    for (size_t i = 0; i < endpoints_.size(); ++i) {
      eps.push_back(endpoints_[(k + i) % endpoints_.size()].get());
    }
  }
  const int64_t now = SteadyNs();
  std::stable_partition(eps.begin(), eps.end(),
                        [now](Endpoint* e) { return e->down_until_ns.load() <= now; });
  return eps;
}

bool Client::Check(Endpoint& e) const {
  // grpc.health.v1.Health/Check with the empty HealthCheckRequest (service
  // ""); SERVING is status (field 1) = 1.
  grpc::GenericStub stub(e.channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + health_timeout_);
  if (!token_.empty()) ctx.AddMetadata("authorization", "Bearer " + token_);
  grpc::Slice empty("");
  grpc::ByteBuffer request(&empty, 1), response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  const grpc::Status s = done.get_future().get();
  std::vector<grpc::Slice> slices;
  std::string body;
  if (s.ok() && response.Dump(&slices).ok()) {
    for (const auto& sl : slices) body.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  if (s.ok() && body == std::string("\x08\x01", 2)) {
    e.MarkUp();
    return true;
  }
  e.MarkDown();
  return false;
}

absl::StatusOr<Client::Endpoint*> Client::Home() {
  MutexLock lock(&home_mu_);
  if (home_ != nullptr) return home_;
  for (Endpoint* e : Order("", "")) {
    if (e->healthy.load() || Check(*e)) {
      home_ = e;
      fast_->unix_socket = IsUnix(e->address);
      return e;
    }
  }
  return absl::UnavailableError(absl::StrCat("no opjitd answered a health check at any of ",
                                             absl::StrJoin(addresses_, ", ")));
}

absl::Status Client::Invoke(CallKind kind, const EndpointCall& fn, const std::string& ns,
                            const std::string& op) {
  if (endpoints_.size() == 1) {
    auto ctx = NewContext();
    return FromGrpc(fn(*endpoints_.front(), ctx.get()));
  }
  if (kind == CallKind::kPinned) {
    auto home = Home();
    if (!home.ok()) return home.status();
    auto ctx = NewContext();
    return FromGrpc(fn(**home, ctx.get()));
  }
  absl::Status last;
  for (Endpoint* e : Order(ns, op)) {
    if (!e->healthy.load() && !Check(*e)) {
      last = absl::UnavailableError(absl::StrCat("no answer to a health check at ", e->address));
      continue;
    }
    auto ctx = NewContext();
    absl::Status s = FromGrpc(fn(*e, ctx.get()));
    if (TransportUnavailable(s)) {
      e->MarkDown();
      if (kind == CallKind::kOnce) return s;  // it may have reached the daemon
      last = s;
      continue;
    }
    if (op.empty() || routing_ != Routing::kAffinity) {
      for (size_t i = 0; i < endpoints_.size(); ++i) {
        if (endpoints_[i].get() == e) current_.store(i);
      }
    }
    return s;
  }
  return absl::UnavailableError(absl::StrCat("no opjitd answered at any of ",
                                             absl::StrJoin(addresses_, ", "), " (last: ",
                                             last.message(), ")"));
}

absl::Status Client::WaitForReady(std::chrono::milliseconds timeout) {
  const auto until = std::chrono::system_clock::now() + timeout;
  if (endpoints_.size() > 1) {
    do {
      for (Endpoint* e : Order("", "")) {
        if (Check(*e)) {
          for (size_t i = 0; i < endpoints_.size(); ++i) {
            if (endpoints_[i].get() == e) current_.store(i);
          }
          return absl::OkStatus();
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    } while (std::chrono::system_clock::now() < until);
    return absl::UnavailableError(absl::StrCat("no opjitd answering at any of ",
                                               absl::StrJoin(addresses_, ", ")));
  }
  if (endpoints_.front()->channel->WaitForConnected(until)) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("no opjitd answering at ", address_,
                                             " (start one with `opjitd`, or set OPJIT_SERVER)"));
}

absl::StatusOr<v1::ServerInfo> Client::Info() {
  v1::ServerInfo out;
  absl::Status s = Invoke(CallKind::kIdempotent, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.server->GetServerInfo(ctx, v1::GetServerInfoRequest(), &out);
  });
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<v1::RegisterOpResponse> Client::Register(const v1::OpDef& op) {
  v1::RegisterOpRequest req;
  *req.mutable_op() = op;
  v1::RegisterOpResponse out;
  absl::Status s = Invoke(CallKind::kOnce, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.registry->RegisterOp(ctx, req, &out);
  });
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<v1::OpRecord> Client::Get(const std::string& ns, const std::string& name,
                                         int64_t version) {
  v1::GetOpRequest req;
  req.set_namespace_(ns);
  req.set_name(name);
  req.set_version(version);
  v1::OpRecord out;
  absl::Status s = Invoke(CallKind::kIdempotent, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.registry->GetOp(ctx, req, &out);
  });
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<std::vector<v1::OpRecord>> Client::List(const std::string& ns, bool all_versions,
                                                       bool with_sources) {
  v1::ListOpsRequest req;
  req.set_namespace_(ns);
  req.set_all_versions(all_versions);
  req.set_with_sources(with_sources);
  v1::ListOpsResponse out;
  absl::Status s = Invoke(CallKind::kIdempotent, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.registry->ListOps(ctx, req, &out);
  });
  if (!s.ok()) return s;
  return std::vector<v1::OpRecord>(out.ops().begin(), out.ops().end());
}

absl::StatusOr<int> Client::Delete(const std::string& ns, const std::string& name,
                                   int64_t version) {
  v1::DeleteOpRequest req;
  req.set_namespace_(ns);
  req.set_name(name);
  req.set_version(version);
  v1::DeleteOpResponse out;
  absl::Status s = Invoke(CallKind::kOnce, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.registry->DeleteOp(ctx, req, &out);
  });
  if (!s.ok()) return s;
  return out.deleted();
}

absl::StatusOr<int> Client::ClearQuarantine(const std::string& ns, const std::string& name) {
  v1::ClearQuarantineRequest req;
  req.set_namespace_(ns);
  req.set_name(name);
  v1::ClearQuarantineResponse out;
  absl::Status s = Invoke(CallKind::kIdempotent, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.registry->ClearQuarantine(ctx, req, &out);
  });
  if (!s.ok()) return s;
  return out.lifted();
}

absl::StatusOr<v1::CompileResponse> Client::Compile(const v1::CompileRequest& request) {
  v1::CompileResponse out;
  absl::Status s = Invoke(CallKind::kIdempotent, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.compiler->Compile(ctx, request, &out);
  });
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<v1::CacheStats> Client::CacheStats() {
  v1::CacheStats out;
  absl::Status s = Invoke(CallKind::kIdempotent, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.compiler->GetCacheStats(ctx, v1::GetCacheStatsRequest(), &out);
  });
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<uint64_t> Client::ClearCache(bool memory_only) {
  v1::ClearCacheRequest req;
  req.set_memory_only(memory_only);
  v1::ClearCacheResponse out;
  absl::Status s = Invoke(CallKind::kOnce, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.compiler->ClearCache(ctx, req, &out);
  });
  if (!s.ok()) return s;
  return out.removed();
}

absl::StatusOr<v1::RegionInfo> Client::CreateRegion(const std::string& ns,
                                                    const std::string& name, uint64_t byte_size,
                                                    int64_t lease_ms) {
  v1::CreateRegionRequest req;
  req.set_namespace_(ns);
  req.set_name(name);
  req.set_byte_size(byte_size);
  req.set_client_id(client_id_);
  req.set_lease_ms(lease_ms);
  v1::RegionInfo out;
  absl::Status s = Invoke(CallKind::kPinned, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.memory->CreateRegion(ctx, req, &out);
  });
  if (!s.ok()) return s;
  RememberRegion(*fast_, ns, out);
  return out;
}

absl::StatusOr<v1::RegionInfo> Client::RegisterRegion(const std::string& ns,
                                                      const std::string& name,
                                                      const std::string& shm_key, uint64_t offset,
                                                      uint64_t byte_size, int64_t lease_ms) {
  v1::RegisterRegionRequest req;
  req.set_namespace_(ns);
  req.set_name(name);
  req.set_shm_key(shm_key);
  req.set_offset(offset);
  req.set_byte_size(byte_size);
  req.set_client_id(client_id_);
  req.set_lease_ms(lease_ms);
  v1::RegionInfo out;
  absl::Status s = Invoke(CallKind::kPinned, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.memory->RegisterRegion(ctx, req, &out);
  });
  if (!s.ok()) return s;
  RememberRegion(*fast_, ns, out);
  return out;
}

absl::Status Client::UnregisterRegion(const std::string& ns, const std::string& name) {
  v1::UnregisterRegionRequest req;
  req.set_namespace_(ns);
  req.set_name(name);
  v1::UnregisterRegionResponse out;
  ForgetRegions(*fast_, ns, &name);
  return Invoke(CallKind::kPinned, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.memory->UnregisterRegion(ctx, req, &out);
  });
}

absl::StatusOr<std::vector<v1::RegionInfo>> Client::ListRegions(const std::string& ns) {
  v1::ListRegionsRequest req;
  req.set_namespace_(ns);
  v1::ListRegionsResponse out;
  absl::Status s = Invoke(CallKind::kPinned, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.memory->ListRegions(ctx, req, &out);
  });
  if (!s.ok()) return s;
  return std::vector<v1::RegionInfo>(out.regions().begin(), out.regions().end());
}

absl::StatusOr<int64_t> Client::RenewLease(const std::string& ns, int64_t lease_ms) {
  v1::RenewLeaseRequest req;
  req.set_namespace_(ns);
  req.set_client_id(client_id_);
  req.set_lease_ms(lease_ms);
  v1::RenewLeaseResponse out;
  absl::Status s = Invoke(CallKind::kPinned, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.memory->RenewLease(ctx, req, &out);
  });
  if (!s.ok()) return s;
  return out.lease_expires_unix_ms();
}

absl::StatusOr<int> Client::ReleaseRegions(const std::string& ns) {
  v1::ReleaseClientRequest req;
  req.set_namespace_(ns);
  req.set_client_id(client_id_);
  v1::ReleaseClientResponse out;
  // The client's regions, handles and channels in `ns` end together.
  ForgetRegions(*fast_, ns, nullptr);
  absl::Status s = Invoke(CallKind::kPinned, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.memory->ReleaseClient(ctx, req, &out);
  });
  if (!s.ok()) return s;
  return out.released();
}

absl::StatusOr<v1::ForwardResponse> Client::Forward(const v1::ForwardRequest& request) {
  if (endpoints_.size() > 1 && !InlineOnly(request)) {
    // Its regions or handle are the home daemon's: pin it first (which
    // also tells whether the fast path can reach it).
    if (auto home = Home(); !home.ok()) return home.status();
  }
  if (auto fast = ForwardFast(request)) return *std::move(fast);
  return ForwardGrpc(request);
}

absl::StatusOr<v1::ForwardResponse> Client::ForwardGrpc(const v1::ForwardRequest& request) {
  v1::ForwardResponse out;
  absl::Status s = Invoke(
      InlineOnly(request) ? CallKind::kIdempotent : CallKind::kPinned,
      [&](Endpoint& e, grpc::ClientContext* ctx) { return e.executor->Forward(ctx, request, &out); },
      request.namespace_(), request.op());
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<v1::BackwardResponse> Client::Backward(const v1::BackwardRequest& request) {
  v1::BackwardResponse out;
  absl::Status s = Invoke(CallKind::kPinned, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.executor->Backward(ctx, request, &out);
  });
  if (!s.ok()) return s;
  return out;
}

absl::Status Client::ReleaseContext(const std::string& ns, const std::string& context_id) {
  v1::ReleaseContextRequest req;
  req.set_namespace_(ns);
  req.set_context_id(context_id);
  v1::ReleaseContextResponse out;
  return Invoke(CallKind::kPinned, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.executor->ReleaseContext(ctx, req, &out);
  });
}

absl::StatusOr<v1::PrepareResponse> Client::Prepare(const v1::PrepareRequest& request) {
  v1::PrepareRequest req = request;
  if (req.client_id().empty()) req.set_client_id(client_id_);
  v1::PrepareResponse out;
  absl::Status s = Invoke(CallKind::kPinned, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.executor->Prepare(ctx, req, &out);
  });
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<int> Client::ReleaseHandles(const std::string& ns,
                                           const std::vector<uint64_t>& handles) {
  v1::ReleaseHandlesRequest req;
  req.set_namespace_(ns);
  req.set_client_id(client_id_);
  for (uint64_t h : handles) req.add_handles(h);
  {
    // Cached call shapes on released handles are prepared again on next use.
    MutexLock lock(&fast_->mu);
    for (auto it = fast_->handles.begin(); it != fast_->handles.end();) {
      const bool gone = it->second->ns == ns &&
                        (handles.empty() || std::find(handles.begin(), handles.end(),
                                                      it->second->handle) != handles.end());
      it = gone ? fast_->handles.erase(it) : std::next(it);
    }
  }
  v1::ReleaseHandlesResponse out;
  absl::Status s = Invoke(CallKind::kPinned, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.executor->ReleaseHandles(ctx, req, &out);
  });
  if (!s.ok()) return s;
  return out.released();
}

absl::StatusOr<v1::OpenChannelResponse> Client::OpenChannel(const std::string& ns,
                                                            int64_t lease_ms) {
  v1::OpenChannelRequest req;
  req.set_namespace_(ns);
  req.set_client_id(client_id_);
  req.set_lease_ms(lease_ms);
  v1::OpenChannelResponse out;
  absl::Status s = Invoke(CallKind::kPinned, [&](Endpoint& e, grpc::ClientContext* ctx) {
    return e.executor->OpenChannel(ctx, req, &out);
  });
  if (!s.ok()) return s;
  return out;
}

template <typename Response>
absl::StatusOr<Response> Client::OpCall(
    const std::string& ns, const std::string& op,
    const std::function<grpc::Status(Endpoint&, grpc::ClientContext*, Response*)>& fn) {
  Response out;
  absl::Status s = Invoke(
      CallKind::kIdempotent,
      [&](Endpoint& e, grpc::ClientContext* ctx) { return fn(e, ctx, &out); }, ns, op);
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<v1::GradCheckResponse> Client::GradCheck(const v1::GradCheckRequest& request) {
  return OpCall<v1::GradCheckResponse>(
      request.namespace_(), request.op(),
      [&](Endpoint& e, grpc::ClientContext* ctx, v1::GradCheckResponse* out) {
        return e.executor->GradCheck(ctx, request, out);
      });
}

absl::StatusOr<v1::VerifyResponse> Client::Verify(const v1::VerifyRequest& request) {
  return OpCall<v1::VerifyResponse>(
      request.namespace_(), request.candidate().op(),
      [&](Endpoint& e, grpc::ClientContext* ctx, v1::VerifyResponse* out) {
        return e.evaluator->Verify(ctx, request, out);
      });
}

absl::StatusOr<v1::BenchmarkResponse> Client::Benchmark(const v1::BenchmarkRequest& request) {
  return OpCall<v1::BenchmarkResponse>(
      request.namespace_(), request.op().op(),
      [&](Endpoint& e, grpc::ClientContext* ctx, v1::BenchmarkResponse* out) {
        return e.evaluator->Benchmark(ctx, request, out);
      });
}

v1::Tensor InlineTensor(const std::string& dtype, const std::vector<int64_t>& shape,
                        std::string_view bytes) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_inline_data(std::string(bytes));
  return t;
}

v1::Tensor InlineTensor(const std::string& dtype, const std::vector<int64_t>& shape,
                        std::string&& bytes) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_inline_data(std::move(bytes));
  return t;
}

v1::Tensor ShmTensor(const std::string& dtype, const std::vector<int64_t>& shape,
                     const std::string& region, uint64_t offset) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.mutable_shm()->set_region(region);
  t.mutable_shm()->set_offset(offset);
  return t;
}

v1::AttrValue TextAttr(const std::string& text) {
  v1::AttrValue v;
  v.set_text(text);
  return v;
}

namespace {

// `files: ["helper.h"]` is short for `files: [{"path": "helper.h"}]`: the
// spec's JSON with each such string made an object, so that protobuf's
// JSON mapping reads it. Anything it cannot make sense of is left for that
// parser to report.
std::string ExpandFileShorthand(std::string_view json) {
  google::protobuf::Value root;
  if (!google::protobuf::util::JsonStringToMessage(std::string(json), &root).ok() ||
      !root.has_struct_value()) {
    return std::string(json);
  }
  auto& fields = *root.mutable_struct_value()->mutable_fields();
  auto impls = fields.find("implementations");
  if (impls == fields.end() || !impls->second.has_list_value()) return std::string(json);
  bool changed = false;
  for (auto& impl : *impls->second.mutable_list_value()->mutable_values()) {
    if (!impl.has_struct_value()) continue;
    auto& f = *impl.mutable_struct_value()->mutable_fields();
    auto files = f.find("files");
    if (files == f.end() || !files->second.has_list_value()) continue;
    for (auto& file : *files->second.mutable_list_value()->mutable_values()) {
      if (file.kind_case() != google::protobuf::Value::kStringValue) continue;
      google::protobuf::Value obj;
      (*obj.mutable_struct_value()->mutable_fields())["path"].set_string_value(file.string_value());
      file = std::move(obj);
      changed = true;
    }
  }
  if (!changed) return std::string(json);
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(root, &out).ok()) return std::string(json);
  return out;
}

// The name an extra file read from `path` (as the spec wrote it) goes by:
// the path itself, made plain ("./a//b.h" -> "a/b.h"), or its base name
// when it is absolute or climbs out of the spec's directory ("..").
std::string DefaultFileName(const std::string& path) {
  std::filesystem::path p = std::filesystem::path(path).lexically_normal();
  std::string n = p.generic_string();
  if (p.is_absolute() || n == ".." || n.rfind("../", 0) == 0) return p.filename().string();
  return n;
}

}  // namespace

absl::StatusOr<v1::OpDef> ParseOpSpec(std::string_view json, const std::string& base_dir) {
  v1::OpDef op;
  google::protobuf::util::JsonParseOptions opts;
  opts.ignore_unknown_fields = false;
  auto st = google::protobuf::util::JsonStringToMessage(ExpandFileShorthand(json), &op, opts);
  if (!st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("spec is not a valid opjit.v1.OpDef: ",
                                                   std::string(st.message())));
  }
  for (int i = 0; i < op.implementations_size(); ++i) {
    auto* impl = op.mutable_implementations(i);
    // Extra files: each `path` (relative to the spec) is read into content;
    // the server never sees a path.
    for (int k = 0; k < impl->files_size(); ++k) {
      auto* f = impl->mutable_files(k);
      if (f->path().empty()) continue;
      if (f->name().empty()) f->set_name(DefaultFileName(f->path()));
      if (f->content().empty()) {
        std::filesystem::path p(f->path());
        if (p.is_relative()) p = std::filesystem::path(base_dir) / p;
        std::ifstream in(p, std::ios::binary);
        if (!in) {
          return absl::NotFoundError(absl::StrCat("implementations[", i, "].files[", k,
                                                  "].path: cannot read ", p.string()));
        }
        std::stringstream ss;
        ss << in.rdbuf();
        f->set_content(ss.str());
      }
      f->clear_path();
    }
    // With source given, source_file only names it (for diagnostics).
    if (impl->source_file().empty() || !impl->source().empty()) continue;
    std::filesystem::path p(impl->source_file());
    if (p.is_relative()) p = std::filesystem::path(base_dir) / p;
    std::ifstream in(p, std::ios::binary);
    if (!in) {
      return absl::NotFoundError(absl::StrCat("implementations[", i, "].source_file: cannot read ",
                                              p.string()));
    }
    std::stringstream ss;
    ss << in.rdbuf();
    impl->set_source(ss.str());
    // The base name stays: the server's diagnostics call the source by it.
    impl->set_source_file(p.filename().string());
  }
  return op;
}

absl::StatusOr<v1::OpDef> LoadOpSpec(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read spec ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string base = std::filesystem::path(path).parent_path().string();
  if (base.empty()) base = ".";
  return ParseOpSpec(ss.str(), base);
}

}  // namespace opjit::client
