#include "client/cpp/opjit_client.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/cord.h"
#include "client/cpp/fast_call.h"
#include "absl/strings/str_cat.h"
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
  std::lock_guard<std::mutex> lock(st.mu);
  st.region_ids[key][info.name()] = info.id();
  st.foreign_regions[key].erase(info.name());
}

// Forgets region `*name` of `ns` (all of them, with the namespace's
// channels and handles, when null: the client released its regions).
void ForgetRegions(FastState& st, const std::string& ns, const std::string* name) {
  const std::string key = ns.empty() ? "default" : ns;
  std::lock_guard<std::mutex> lock(st.mu);
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

Client::Client() : fast_(std::make_unique<FastState>()) {}

Client::~Client() {
  // Hand back what the fast path holds on the server (handles, channel
  // regions) instead of leaving it to the lease; best effort, briefly.
  std::vector<std::string> handle_ns;
  std::vector<std::pair<std::string, std::string>> channel_regions;
  {
    std::lock_guard<std::mutex> lock(fast_->mu);
    for (const auto& [key, call] : fast_->handles) {
      if (std::find(handle_ns.begin(), handle_ns.end(), call->ns) == handle_ns.end()) {
        handle_ns.push_back(call->ns);
      }
    }
    for (const auto& [ns, ch] : fast_->channels) channel_regions.emplace_back(ns, ch->region());
    fast_->channels.clear();
  }
  if (channel_ == nullptr || (handle_ns.empty() && channel_regions.empty())) return;
  timeout_ = std::chrono::milliseconds(500);
  for (const auto& [ns, region] : channel_regions) (void)UnregisterRegion(ns, region);
  for (const auto& ns : handle_ns) (void)ReleaseHandles(ns, {});
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  std::unique_ptr<Client> c(new Client());
  c->address_ = NormalizeAddress(options.address.empty() ? DefaultServerAddress() : options.address);
  auto mode = ParseFastMode(EnvOr(options.fast, "OPJIT_FAST"));
  if (!mode.ok()) return mode.status();
  c->fast_->mode = *mode;
  c->fast_->unix_socket = c->address_.rfind("unix:", 0) == 0;
  c->timeout_ = options.timeout;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  c->token_ = EnvOr(options.token, "OPJIT_TOKEN");
  const std::string ca_file = EnvOr(options.tls_ca_file, "OPJIT_TLS_CA");
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!ca_file.empty() && c->address_.rfind("unix:", 0) != 0) {
    std::ifstream in(ca_file, std::ios::binary);
    std::stringstream pem;
    pem << in.rdbuf();
    if (!in || pem.str().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("cannot read the TLS CA file ", ca_file));
    }
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = pem.str();
    creds = grpc::SslCredentials(ssl);
  }
  c->channel_ = grpc::CreateCustomChannel(c->address_, creds, args);
  if (c->channel_ == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("bad server address ", c->address_));
  }
  c->registry_ = v1::Registry::NewStub(c->channel_);
  c->compiler_ = v1::Compiler::NewStub(c->channel_);
  c->server_ = v1::Server::NewStub(c->channel_);
  c->memory_ = v1::Memory::NewStub(c->channel_);
  c->executor_ = v1::Executor::NewStub(c->channel_);
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

absl::Status Client::WaitForReady(std::chrono::milliseconds timeout) {
  if (channel_->WaitForConnected(std::chrono::system_clock::now() + timeout)) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat("no opjitd answering at ", address_,
                                             " (start one with `opjitd`, or set OPJIT_SERVER)"));
}

absl::StatusOr<v1::ServerInfo> Client::Info() {
  v1::ServerInfo out;
  auto ctx = NewContext();
  absl::Status s = FromGrpc(server_->GetServerInfo(ctx.get(), v1::GetServerInfoRequest(), &out));
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<v1::RegisterOpResponse> Client::Register(const v1::OpDef& op) {
  v1::RegisterOpRequest req;
  *req.mutable_op() = op;
  v1::RegisterOpResponse out;
  auto ctx = NewContext();
  absl::Status s = FromGrpc(registry_->RegisterOp(ctx.get(), req, &out));
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
  auto ctx = NewContext();
  absl::Status s = FromGrpc(registry_->GetOp(ctx.get(), req, &out));
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
  auto ctx = NewContext();
  absl::Status s = FromGrpc(registry_->ListOps(ctx.get(), req, &out));
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
  auto ctx = NewContext();
  absl::Status s = FromGrpc(registry_->DeleteOp(ctx.get(), req, &out));
  if (!s.ok()) return s;
  return out.deleted();
}

absl::StatusOr<v1::CompileResponse> Client::Compile(const v1::CompileRequest& request) {
  v1::CompileResponse out;
  auto ctx = NewContext();
  absl::Status s = FromGrpc(compiler_->Compile(ctx.get(), request, &out));
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<v1::CacheStats> Client::CacheStats() {
  v1::CacheStats out;
  auto ctx = NewContext();
  absl::Status s = FromGrpc(compiler_->GetCacheStats(ctx.get(), v1::GetCacheStatsRequest(), &out));
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<uint64_t> Client::ClearCache(bool memory_only) {
  v1::ClearCacheRequest req;
  req.set_memory_only(memory_only);
  v1::ClearCacheResponse out;
  auto ctx = NewContext();
  absl::Status s = FromGrpc(compiler_->ClearCache(ctx.get(), req, &out));
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
  auto ctx = NewContext();
  absl::Status s = FromGrpc(memory_->CreateRegion(ctx.get(), req, &out));
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
  auto ctx = NewContext();
  absl::Status s = FromGrpc(memory_->RegisterRegion(ctx.get(), req, &out));
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
  auto ctx = NewContext();
  return FromGrpc(memory_->UnregisterRegion(ctx.get(), req, &out));
}

absl::StatusOr<std::vector<v1::RegionInfo>> Client::ListRegions(const std::string& ns) {
  v1::ListRegionsRequest req;
  req.set_namespace_(ns);
  v1::ListRegionsResponse out;
  auto ctx = NewContext();
  absl::Status s = FromGrpc(memory_->ListRegions(ctx.get(), req, &out));
  if (!s.ok()) return s;
  return std::vector<v1::RegionInfo>(out.regions().begin(), out.regions().end());
}

absl::StatusOr<int64_t> Client::RenewLease(const std::string& ns, int64_t lease_ms) {
  v1::RenewLeaseRequest req;
  req.set_namespace_(ns);
  req.set_client_id(client_id_);
  req.set_lease_ms(lease_ms);
  v1::RenewLeaseResponse out;
  auto ctx = NewContext();
  absl::Status s = FromGrpc(memory_->RenewLease(ctx.get(), req, &out));
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
  auto ctx = NewContext();
  absl::Status s = FromGrpc(memory_->ReleaseClient(ctx.get(), req, &out));
  if (!s.ok()) return s;
  return out.released();
}

absl::StatusOr<v1::ForwardResponse> Client::Forward(const v1::ForwardRequest& request) {
  if (auto fast = ForwardFast(request)) return *std::move(fast);
  return ForwardGrpc(request);
}

absl::StatusOr<v1::ForwardResponse> Client::ForwardGrpc(const v1::ForwardRequest& request) {
  v1::ForwardResponse out;
  auto ctx = NewContext();
  absl::Status s = FromGrpc(executor_->Forward(ctx.get(), request, &out));
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<v1::BackwardResponse> Client::Backward(const v1::BackwardRequest& request) {
  v1::BackwardResponse out;
  auto ctx = NewContext();
  absl::Status s = FromGrpc(executor_->Backward(ctx.get(), request, &out));
  if (!s.ok()) return s;
  return out;
}

absl::Status Client::ReleaseContext(const std::string& ns, const std::string& context_id) {
  v1::ReleaseContextRequest req;
  req.set_namespace_(ns);
  req.set_context_id(context_id);
  v1::ReleaseContextResponse out;
  auto ctx = NewContext();
  return FromGrpc(executor_->ReleaseContext(ctx.get(), req, &out));
}

absl::StatusOr<v1::PrepareResponse> Client::Prepare(const v1::PrepareRequest& request) {
  v1::PrepareRequest req = request;
  if (req.client_id().empty()) req.set_client_id(client_id_);
  v1::PrepareResponse out;
  auto ctx = NewContext();
  absl::Status s = FromGrpc(executor_->Prepare(ctx.get(), req, &out));
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
    std::lock_guard<std::mutex> lock(fast_->mu);
    for (auto it = fast_->handles.begin(); it != fast_->handles.end();) {
      const bool gone = it->second->ns == ns &&
                        (handles.empty() || std::find(handles.begin(), handles.end(),
                                                      it->second->handle) != handles.end());
      it = gone ? fast_->handles.erase(it) : std::next(it);
    }
  }
  v1::ReleaseHandlesResponse out;
  auto ctx = NewContext();
  absl::Status s = FromGrpc(executor_->ReleaseHandles(ctx.get(), req, &out));
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
  auto ctx = NewContext();
  absl::Status s = FromGrpc(executor_->OpenChannel(ctx.get(), req, &out));
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<v1::GradCheckResponse> Client::GradCheck(const v1::GradCheckRequest& request) {
  v1::GradCheckResponse out;
  auto ctx = NewContext();
  absl::Status s = FromGrpc(executor_->GradCheck(ctx.get(), request, &out));
  if (!s.ok()) return s;
  return out;
}

v1::Tensor InlineTensor(const std::string& dtype, const std::vector<int64_t>& shape,
                        std::string_view bytes) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_inline_data(std::string(bytes));
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

absl::StatusOr<v1::OpDef> ParseOpSpec(std::string_view json, const std::string& base_dir) {
  v1::OpDef op;
  google::protobuf::util::JsonParseOptions opts;
  opts.ignore_unknown_fields = false;
  auto st = google::protobuf::util::JsonStringToMessage(std::string(json), &op, opts);
  if (!st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("spec is not a valid opjit.v1.OpDef: ",
                                                   std::string(st.message())));
  }
  for (int i = 0; i < op.implementations_size(); ++i) {
    auto* impl = op.mutable_implementations(i);
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
