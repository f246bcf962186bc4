// Memory and Executor services: proto <-> tensor/exec domain types.
#include <atomic>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "server/common/logging.h"
#include "server/exec/executor.h"
#include "server/rpc/services.h"
#include "server/rpc/status_util.h"
#include "server/tensor/region_manager.h"

namespace opjit::rpc {
namespace {

std::atomic<uint64_t> next_forward_id{1};

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

std::string Ns(const std::string& ns) { return ns.empty() ? "default" : ns; }

void InfoToProto(const tensor::RegionInfo& info, v1::RegionInfo* out) {
  out->set_namespace_(info.ns);
  out->set_name(info.name);
  out->set_shm_key(info.shm_key);
  out->set_offset(info.offset);
  out->set_byte_size(info.byte_size);
  out->set_daemon_owned(info.daemon_owned);
  out->set_client_id(info.owner);
  out->set_lease_expires_unix_ms(info.lease_expires_unix_ms);
}

absl::StatusOr<registry::AttrValue> TypedAttr(const v1::AttrValue& v) {
  using VC = v1::AttrValue::ValueCase;
  switch (v.value_case()) {
    case VC::kB:
      return registry::AttrValue(v.b());
    case VC::kI:
      return registry::AttrValue(static_cast<int64_t>(v.i()));
    case VC::kF:
      return registry::AttrValue(v.f());
    case VC::kS:
      return registry::AttrValue(v.s());
    case VC::kInts:
      return registry::AttrValue(
          std::vector<int64_t>(v.ints().values().begin(), v.ints().values().end()));
    case VC::kFloats:
      return registry::AttrValue(
          std::vector<double>(v.floats().values().begin(), v.floats().values().end()));
    case VC::kBools:
      return registry::AttrValue(
          std::vector<bool>(v.bools().values().begin(), v.bools().values().end()));
    case VC::kStrs:
      return registry::AttrValue(
          std::vector<std::string>(v.strs().values().begin(), v.strs().values().end()));
    case VC::kIntLists: {
      std::vector<std::vector<int64_t>> out;
      for (const auto& l : v.int_lists().values()) out.emplace_back(l.values().begin(), l.values().end());
      return registry::AttrValue(std::move(out));
    }
    case VC::kFloatLists: {
      std::vector<std::vector<double>> out;
      for (const auto& l : v.float_lists().values()) out.emplace_back(l.values().begin(), l.values().end());
      return registry::AttrValue(std::move(out));
    }
    case VC::kText:
    case VC::VALUE_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError("attr value is not set");
}

absl::StatusOr<exec::OutputPlacement> PlacementFromProto(const v1::OutputPlacement& p, int j) {
  exec::OutputPlacement out;
  switch (p.where_case()) {
    case v1::OutputPlacement::kShm:
      out.kind = exec::OutputPlacement::Kind::kShm;
      out.region = p.shm().region();
      out.offset = p.shm().offset();
      return out;
    case v1::OutputPlacement::kAllocIn:
      out.kind = exec::OutputPlacement::Kind::kAllocIn;
      out.region = p.alloc_in().region();
      out.offset = p.alloc_in().offset();
      return out;
    case v1::OutputPlacement::kInline:
    case v1::OutputPlacement::WHERE_NOT_SET:
      return out;
  }
  return absl::InvalidArgumentError(absl::StrCat("outputs[", j, "]: unknown placement"));
}

// Builds the domain call. The returned call points into `req` (inline bytes),
// which outlives it: the request lives until the reactor finishes.
absl::StatusOr<exec::ForwardCall> CallFromProto(const v1::ForwardRequest& req,
                                                const grpc::CallbackServerContext& ctx) {
  exec::ForwardCall call;
  call.ns = Ns(req.namespace_());
  call.op = req.op();
  call.version = req.version();
  if (!req.target().empty()) {
    auto t = registry::ParseTarget(req.target());
    if (!t) {
      return absl::InvalidArgumentError(
          absl::StrCat("target: unknown \"", req.target(), "\" (expected CPU or GPU)"));
    }
    call.target = *t;
  }
  for (int i = 0; i < req.inputs_size(); ++i) {
    std::vector<exec::TensorArg> group;
    for (int k = 0; k < req.inputs(i).tensors_size(); ++k) {
      const v1::Tensor& t = req.inputs(i).tensors(k);
      exec::TensorArg arg;
      arg.desc.dtype = t.dtype();
      arg.desc.shape.assign(t.shape().begin(), t.shape().end());
      for (int64_t d : arg.desc.shape) {
        if (d < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("inputs[", i, "][", k, "]: negative dim ", d, " in the shape"));
        }
      }
      if (t.has_shm()) {
        arg.in_shm = true;
        arg.region = t.shm().region();
        arg.offset = t.shm().offset();
      } else {
        arg.inline_bytes = t.inline_data();
      }
      group.push_back(std::move(arg));
    }
    call.inputs.push_back(std::move(group));
  }
  for (const auto& [name, v] : req.attrs()) {
    exec::AttrArg arg;
    if (v.value_case() == v1::AttrValue::kText) {
      arg.is_text = true;
      arg.text = v.text();
    } else {
      auto typed = TypedAttr(v);
      if (!typed.ok()) return absl::InvalidArgumentError(absl::StrCat("attrs[", name, "]: not set"));
      arg.value = *std::move(typed);
    }
    call.attrs[name] = std::move(arg);
  }
  for (int j = 0; j < req.outputs_size(); ++j) {
    auto p = PlacementFromProto(req.outputs(j), j);
    if (!p.ok()) return p.status();
    call.outputs.push_back(*std::move(p));
  }
  // The client's deadline, on the steady clock the executor uses.
  const auto deadline = ctx.deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) {
    const auto left = deadline - std::chrono::system_clock::now();
    if (left < std::chrono::hours(24 * 365)) {
      call.deadline = std::chrono::steady_clock::now() +
                      std::chrono::duration_cast<std::chrono::steady_clock::duration>(left);
    }
  }
  call.request_id = next_forward_id.fetch_add(1, std::memory_order_relaxed);
  return call;
}

}  // namespace

grpc::ServerUnaryReactor* MemoryService::CreateRegion(grpc::CallbackServerContext* ctx,
                                                      const v1::CreateRegionRequest* req,
                                                      v1::RegionInfo* resp) {
  auto info = core_.regions->CreateRegion(Ns(req->namespace_()), req->client_id(), req->name(),
                                          req->byte_size(), req->lease_ms());
  if (info.ok()) InfoToProto(*info, resp);
  return Finish(ctx, info.status());
}

grpc::ServerUnaryReactor* MemoryService::RegisterRegion(grpc::CallbackServerContext* ctx,
                                                        const v1::RegisterRegionRequest* req,
                                                        v1::RegionInfo* resp) {
  auto info = core_.regions->RegisterRegion(Ns(req->namespace_()), req->client_id(), req->name(),
                                            req->shm_key(), req->offset(), req->byte_size(),
                                            req->lease_ms());
  if (info.ok()) InfoToProto(*info, resp);
  return Finish(ctx, info.status());
}

grpc::ServerUnaryReactor* MemoryService::UnregisterRegion(grpc::CallbackServerContext* ctx,
                                                          const v1::UnregisterRegionRequest* req,
                                                          v1::UnregisterRegionResponse*) {
  return Finish(ctx, core_.regions->Unregister(Ns(req->namespace_()), req->name()));
}

grpc::ServerUnaryReactor* MemoryService::ListRegions(grpc::CallbackServerContext* ctx,
                                                     const v1::ListRegionsRequest* req,
                                                     v1::ListRegionsResponse* resp) {
  for (const auto& info : core_.regions->List(req->namespace_())) {
    InfoToProto(info, resp->add_regions());
  }
  return Finish(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* MemoryService::RenewLease(grpc::CallbackServerContext* ctx,
                                                    const v1::RenewLeaseRequest* req,
                                                    v1::RenewLeaseResponse* resp) {
  auto expiry = core_.regions->Renew(Ns(req->namespace_()), req->client_id(), req->lease_ms());
  if (expiry.ok()) resp->set_lease_expires_unix_ms(*expiry);
  return Finish(ctx, expiry.status());
}

grpc::ServerUnaryReactor* MemoryService::ReleaseClient(grpc::CallbackServerContext* ctx,
                                                       const v1::ReleaseClientRequest* req,
                                                       v1::ReleaseClientResponse* resp) {
  auto n = core_.regions->ReleaseOwner(Ns(req->namespace_()), req->client_id());
  if (n.ok()) resp->set_released(*n);
  return Finish(ctx, n.status());
}

grpc::ServerUnaryReactor* ExecutorService::Forward(grpc::CallbackServerContext* ctx,
                                                   const v1::ForwardRequest* req,
                                                   v1::ForwardResponse* resp) {
  auto call = CallFromProto(*req, *ctx);
  if (!call.ok()) return Finish(ctx, call.status());
  auto* reactor = ctx->DefaultReactor();
  const uint64_t rid = call->request_id;
  const std::string op = absl::StrCat(call->ns, "/", call->op);
  core_.executor->ForwardAsync(
      *std::move(call), [reactor, resp, rid, op](absl::StatusOr<exec::ForwardResult> r) {
        if (!r.ok()) {
          Logger("rpc")->debug("req=f{} Forward {}: {}", rid, op, r.status().ToString());
          reactor->Finish(ToGrpcStatus(r.status()));
          return;
        }
        for (auto& o : r->outputs) {
          v1::Tensor* t = resp->add_outputs();
          t->set_dtype(o.desc.dtype);
          for (int64_t d : o.desc.shape) t->add_shape(d);
          if (o.in_shm) {
            t->mutable_shm()->set_region(o.region);
            t->mutable_shm()->set_offset(o.offset);
          } else {
            t->set_inline_data(std::move(o.inline_bytes));
          }
        }
        resp->set_kernel_ms(r->kernel_ms);
        resp->set_server_ms(r->server_ms);
        resp->set_version(r->version);
        reactor->Finish(grpc::Status::OK);
      });
  return reactor;
}

}  // namespace opjit::rpc
