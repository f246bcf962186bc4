// Memory and Executor services: proto <-> tensor/exec domain types.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>

#include <unistd.h>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/status_macros.h"
#include "server/core/call_service.h"
#include "server/core/defaults.h"
#include "server/autograd/autograd.h"
#include "server/exec/channels.h"
#include "server/exec/executor.h"
#include "server/exec/handles.h"
#include "server/access/access.h"
#include "server/rpc/caller.h"
#include "server/rpc/exec_convert.h"
#include "server/rpc/services.h"
#include "server/rpc/status_util.h"
#include "proto/opjit/wire/fast_channel.h"
#include "server/tensor/region_manager.h"

namespace opjit::rpc {
namespace {

std::atomic<uint64_t> next_forward_id{1};

void InfoToProto(const tensor::RegionInfo& info, v1::RegionInfo* out) {
  out->set_namespace_(info.ns);
  out->set_name(info.name);
  out->set_shm_key(info.shm_key);
  out->set_offset(info.offset);
  out->set_byte_size(info.byte_size);
  out->set_daemon_owned(info.daemon_owned);
  out->set_client_id(ClientIdOf(info.owner));
  out->set_lease_expires_unix_ms(info.lease_expires_unix_ms);
  out->set_id(info.id);
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

void OutputToProto(exec::OutputResult& o, v1::Tensor* t) {
  t->set_dtype(o.desc.dtype);
  for (int64_t d : o.desc.shape) t->add_shape(d);
  if (const exec::ShmRef* shm = o.shm()) {
    t->mutable_shm()->set_region(shm->region);
    t->mutable_shm()->set_offset(shm->offset);
  } else {
    t->set_inline_data(std::move(o.mutable_inline_bytes()->bytes));
  }
}

// A forward's output placements, deadline and request id.
absl::Status AddPlacementsAndDeadline(const v1::ForwardRequest& req,
                                      const grpc::CallbackServerContext& ctx,
                                      exec::ForwardCall* call) {
  for (int j = 0; j < req.outputs_size(); ++j) {
    auto p = PlacementFromProto(req.outputs(j), j);
    if (!p.ok()) return p.status();
    call->outputs.push_back(*std::move(p));
  }
  call->keep_output_bytes = req.keep_output_bytes();
  call->deadline = SteadyDeadline(ctx);
  call->request_id = next_forward_id.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

// The call of a prepared handle: op, version, target, attrs and principal
// from the handle (core::CallService::CallFromHandle checks the inputs
// against it); tensors and placements from `req`.
absl::StatusOr<exec::ForwardCall> CallFromHandle(const exec::Handle& h,
                                                 const v1::ForwardRequest& req,
                                                 const grpc::CallbackServerContext& ctx) {
  if (!req.op().empty() || req.version() != 0 || !req.target().empty() || !req.attrs().empty()) {
    return absl::InvalidArgumentError(
        "a call with a handle takes op, version, target and attrs from it; leave them empty");
  }
  auto inputs = InputsFromProto(req.inputs());
  if (!inputs.ok()) return inputs.status();
  auto call = core::CallService::CallFromHandle(h, *std::move(inputs));
  if (!call.ok()) return call.status();
  OPJIT_RETURN_IF_ERROR(AddPlacementsAndDeadline(req, ctx, &*call));
  return call;
}

// Builds the domain call. The returned call points into `req` (inline bytes),
// which outlives it: the request lives until the reactor finishes.
absl::StatusOr<exec::ForwardCall> CallFromProto(const v1::ForwardRequest& req,
                                                const grpc::CallbackServerContext& ctx) {
  exec::ForwardCall call;
  call.ns = NamespaceOrDefault(req.namespace_());
  call.op = req.op();
  call.version = req.version();
  auto target = core::TargetOrDefault(req.target());
  if (!target.ok()) return target.status();
  call.target = *target;
  auto inputs = InputsFromProto(req.inputs());
  if (!inputs.ok()) return inputs.status();
  call.inputs = *std::move(inputs);
  auto attrs = AttrsFromProto(req.attrs());
  if (!attrs.ok()) return attrs.status();
  call.attrs = *std::move(attrs);
  OPJIT_RETURN_IF_ERROR(AddPlacementsAndDeadline(req, ctx, &call));
  return call;
}

}  // namespace

grpc::ServerUnaryReactor* MemoryService::CreateRegion(grpc::CallbackServerContext* ctx,
                                                      const v1::CreateRegionRequest* req,
                                                      v1::RegionInfo* resp) {
  const std::string ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, ns, access::Action::kCall);
  // caller.uid (SO_PEERCRED) is granted access to the object when the client
  // runs as another user than the daemon.
  auto info = core_.regions->CreateRegion(ns, RegionOwner(caller, req->client_id()), req->name(),
                                          req->byte_size(), req->lease_ms(), caller.uid);
  if (info.ok()) InfoToProto(*info, resp);
  return FinishNow(ctx, info.status());
}

grpc::ServerUnaryReactor* MemoryService::RegisterRegion(grpc::CallbackServerContext* ctx,
                                                        const v1::RegisterRegionRequest* req,
                                                        v1::RegionInfo* resp) {
  const std::string ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, ns, access::Action::kCall);
  // The object must belong to the caller: its uid from SO_PEERCRED. A caller
  // without one (TCP) may register only objects of the daemon's own user,
  // and only as an admin (the embedded default's local admin).
  std::optional<uid_t> uid = caller.uid;
  if (!uid.has_value()) {
    if (!caller.admin()) {
      return FinishNow(ctx, WithReason(absl::PermissionDeniedError(
                                           "RegisterRegion needs the unix socket: the server "
                                           "checks that the shm object belongs to the caller's "
                                           "uid. Over TCP use CreateRegion"),
                                       reason::kPermissionDenied));
    }
    uid = ::geteuid();
  }
  auto info = core_.regions->RegisterRegion(ns, RegionOwner(caller, req->client_id()), req->name(),
                                            req->shm_key(), req->offset(), req->byte_size(),
                                            req->lease_ms(), uid);
  if (info.ok()) InfoToProto(*info, resp);
  return FinishNow(ctx, info.status());
}

grpc::ServerUnaryReactor* MemoryService::UnregisterRegion(grpc::CallbackServerContext* ctx,
                                                          const v1::UnregisterRegionRequest* req,
                                                          v1::UnregisterRegionResponse*) {
  const std::string ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, ns, access::Action::kCall);
  return FinishNow(ctx, core_.regions->Unregister(ns, req->name(), RegionScope(caller)));
}

grpc::ServerUnaryReactor* MemoryService::ListRegions(grpc::CallbackServerContext* ctx,
                                                     const v1::ListRegionsRequest* req,
                                                     v1::ListRegionsResponse* resp) {
  const std::string ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, ns, access::Action::kDescribe);
  for (const auto& info : core_.regions->List(ns, RegionScope(caller))) {
    InfoToProto(info, resp->add_regions());
  }
  return FinishNow(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* MemoryService::RenewLease(grpc::CallbackServerContext* ctx,
                                                    const v1::RenewLeaseRequest* req,
                                                    v1::RenewLeaseResponse* resp) {
  const std::string ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, ns, access::Action::kCall);
  const std::string owner = RegionOwner(caller, req->client_id());
  if (core_.handles != nullptr) core_.handles->Renew(ns, owner);
  auto expiry = core_.regions->Renew(ns, owner, req->lease_ms());
  if (expiry.ok()) resp->set_lease_expires_unix_ms(*expiry);
  return FinishNow(ctx, expiry.status());
}

grpc::ServerUnaryReactor* MemoryService::ReleaseClient(grpc::CallbackServerContext* ctx,
                                                       const v1::ReleaseClientRequest* req,
                                                       v1::ReleaseClientResponse* resp) {
  const std::string ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, ns, access::Action::kCall);
  const std::string owner = RegionOwner(caller, req->client_id());
  auto n = core_.regions->ReleaseOwner(ns, owner);  // closes its channels too
  if (core_.handles != nullptr) core_.handles->Release(ns, owner, {});
  if (n.ok()) resp->set_released(*n);
  return FinishNow(ctx, n.status());
}

grpc::ServerUnaryReactor* ExecutorService::Forward(grpc::CallbackServerContext* ctx,
                                                   const v1::ForwardRequest* req,
                                                   v1::ForwardResponse* resp) {
  const std::string ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, ns, access::Action::kCall);
  if (absl::Status s = calls_.Admit(ns); !s.ok()) return FinishNow(ctx, s);
  absl::StatusOr<exec::ForwardCall> call;
  if (req->handle() != 0) {
    auto h = calls_.FindHandle(ns, RegionOwner(caller, req->client_id()), req->handle());
    if (!h.ok()) return FinishNow(ctx, h.status());
    call = CallFromHandle(**h, *req, *ctx);
  } else {
    call = CallFromProto(*req, *ctx);
  }
  if (!call.ok()) return FinishNow(ctx, call.status());
  call->principal = RegionScope(caller);
  call->quarantine_caller = QuarantineCaller(caller);
  call->caller = caller.name;
  auto* reactor = ctx->DefaultReactor();
  const uint64_t rid = call->request_id;
  // `req` outlives the reactor; names for the log are built only on error.
  auto answer = [reactor, req, resp, rid](const absl::Status& status, exec::ForwardResult* r,
                                          const std::string& context_id) {
    if (!status.ok()) {
      Logger("rpc")->debug("req=f{} Forward {}/{}: {}", rid, NamespaceOrDefault(req->namespace_()), req->op(),
                           status.ToString());
      return reactor->Finish(ToGrpcStatus(status));
    }
    for (auto& o : r->outputs) OutputToProto(o, resp->add_outputs());
    resp->set_kernel_ms(r->kernel_ms);
    resp->set_server_ms(r->server_ms);
    resp->set_version(r->version);
    resp->set_context_id(context_id);
    reactor->Finish(grpc::Status::OK);
  };
  const auto& flags = req->requires_grad();
  calls_.ForwardAsync(*std::move(call), absl::MakeConstSpan(flags.data(), flags.size()),
                      std::move(answer));
  return reactor;
}

grpc::ServerUnaryReactor* ExecutorService::Backward(grpc::CallbackServerContext* ctx,
                                                    const v1::BackwardRequest* req,
                                                    v1::BackwardResponse* resp) {
  autograd::BackwardCall call;
  call.ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, call.ns, access::Action::kCall);
  if (absl::Status s = calls_.Admit(call.ns); !s.ok()) return FinishNow(ctx, s);
  call.principal = RegionScope(caller);
  call.quarantine_caller = QuarantineCaller(caller);
  call.context_id = req->context_id();
  for (int j = 0; j < req->grad_outputs_size(); ++j) {
    const v1::Tensor& t = req->grad_outputs(j);
    if (t.dtype().empty()) {
      call.grad_outputs.push_back(std::nullopt);
      continue;
    }
    auto arg = TensorFromProto(t, [&] { return absl::StrCat("grad_outputs[", j, "]"); });
    if (!arg.ok()) return FinishNow(ctx, arg.status());
    call.grad_outputs.push_back(*std::move(arg));
  }
  call.retain_context = req->retain_context();
  call.create_graph = req->create_graph();
  call.keep_output_bytes = req->keep_output_bytes();
  for (int j = 0; j < req->outputs_size(); ++j) {
    auto p = PlacementFromProto(req->outputs(j), j);
    if (!p.ok()) return FinishNow(ctx, p.status());
    call.outputs.push_back(*std::move(p));
  }
  call.deadline = SteadyDeadline(*ctx);
  auto* reactor = ctx->DefaultReactor();
  calls_.BackwardAsync(
      std::move(call), [reactor, resp](absl::StatusOr<autograd::BackwardResult> r) {
        if (!r.ok()) {
          reactor->Finish(ToGrpcStatus(r.status()));
          return;
        }
        for (auto& group : r->grad_inputs) {
          v1::InputArg* arg = resp->add_grad_inputs();
          for (auto& o : group) OutputToProto(o, arg->add_tensors());
        }
        resp->set_kernel_ms(r->kernel_ms);
        resp->set_server_ms(r->server_ms);
        resp->set_context_id(r->context_id);
        for (const auto& w : r->warnings) resp->add_warnings(w);
        reactor->Finish(grpc::Status::OK);
      });
  return reactor;
}

grpc::ServerUnaryReactor* ExecutorService::ReleaseContext(grpc::CallbackServerContext* ctx,
                                                          const v1::ReleaseContextRequest* req,
                                                          v1::ReleaseContextResponse*) {
  const std::string ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, ns, access::Action::kCall);
  (void)caller;
  return FinishNow(ctx, calls_.ReleaseContext(ns, req->context_id()));
}

grpc::ServerUnaryReactor* ExecutorService::GradCheck(grpc::CallbackServerContext* ctx,
                                                     const v1::GradCheckRequest* req,
                                                     v1::GradCheckResponse* resp) {
  autograd::GradCheckCall call;
  call.deadline = SteadyDeadline(*ctx);
  call.ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, call.ns, access::Action::kCall);
  if (absl::Status s = calls_.Admit(call.ns); !s.ok()) return FinishNow(ctx, s);
  call.principal = RegionScope(caller);
  call.quarantine_caller = QuarantineCaller(caller);
  call.op = req->op();
  call.version = req->version();
  auto inputs = InputsFromProto(req->inputs());
  if (!inputs.ok()) return FinishNow(ctx, inputs.status());
  call.inputs = *std::move(inputs);
  auto attrs = AttrsFromProto(req->attrs());
  if (!attrs.ok()) return FinishNow(ctx, attrs.status());
  call.attrs = *std::move(attrs);
  if (req->random_shape_size() > 0) {
    call.random_shape.assign(req->random_shape().begin(), req->random_shape().end());
  }
  call.seed = req->seed();
  call.eps = req->eps();
  call.atol = req->atol();
  call.rtol = req->rtol();
  auto* reactor = ctx->DefaultReactor();
  calls_.GradCheckAsync(
      std::move(call), [reactor, resp](absl::StatusOr<autograd::GradCheckResult> r) {
        if (!r.ok()) {
          Logger("rpc")->debug("GradCheck: {}", r.status().ToString());
          reactor->Finish(ToGrpcStatus(r.status()));
          return;
        }
        resp->set_passed(r->passed);
        resp->set_dtype(r->dtype);
        resp->set_message(r->message);
        for (const auto& gi : r->inputs) {
          auto* out = resp->add_inputs();
          out->set_name(gi.name);
          out->set_max_abs_error(gi.max_abs_error);
          out->set_max_rel_error(gi.max_rel_error);
          out->set_passed(gi.passed);
          out->set_worst_index(gi.worst_index);
          out->set_analytic(gi.analytic);
          out->set_numeric(gi.numeric);
        }
        reactor->Finish(grpc::Status::OK);
      });
  return reactor;
}

}  // namespace opjit::rpc

namespace opjit::rpc {

grpc::ServerUnaryReactor* ExecutorService::Prepare(grpc::CallbackServerContext* ctx,
                                                   const v1::PrepareRequest* req,
                                                   v1::PrepareResponse* resp) {
  exec::ForwardCall call;
  call.ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, call.ns, access::Action::kCall);
  if (absl::Status s = calls_.HandlesAvailable(); !s.ok()) return FinishNow(ctx, s);
  call.op = req->op();
  call.version = req->version();
  auto target = core::TargetOrDefault(req->target());
  if (!target.ok()) return FinishNow(ctx, target.status());
  call.target = *target;
  auto inputs = InputsFromProto(req->inputs());
  if (!inputs.ok()) return FinishNow(ctx, inputs.status());
  call.inputs = *std::move(inputs);
  auto attrs = AttrsFromProto(req->attrs());
  if (!attrs.ok()) return FinishNow(ctx, attrs.status());
  call.attrs = *std::move(attrs);
  call.principal = RegionScope(caller);
  call.quarantine_caller = QuarantineCaller(caller);
  call.deadline = SteadyDeadline(*ctx);
  auto* reactor = ctx->DefaultReactor();
  calls_.PrepareAsync(
      std::move(call), RegionOwner(caller, req->client_id()),
      [reactor, resp](absl::StatusOr<std::shared_ptr<const exec::Handle>> h) {
        if (!h.ok()) return reactor->Finish(ToGrpcStatus(h.status()));
        const exec::PreparedCall& prepared = (*h)->prepared;
        for (size_t i = 0; i < prepared.inputs.size(); ++i) {
          v1::TensorSpec* t = resp->add_inputs();
          t->set_dtype(prepared.inputs[i].dtype);
          for (int64_t d : prepared.inputs[i].shape) t->add_shape(d);
          t->set_byte_size(prepared.input_bytes[i]);
        }
        for (size_t j = 0; j < prepared.outputs.size(); ++j) {
          v1::TensorSpec* t = resp->add_outputs();
          t->set_dtype(prepared.outputs[j].dtype);
          for (int64_t d : prepared.outputs[j].shape) t->add_shape(d);
          t->set_byte_size(prepared.output_bytes[j]);
        }
        resp->set_handle((*h)->id);
        resp->set_version(prepared.record->version);
        resp->set_fast((*h)->fast);
        reactor->Finish(grpc::Status::OK);
      });
  return reactor;
}

grpc::ServerUnaryReactor* ExecutorService::ReleaseHandles(grpc::CallbackServerContext* ctx,
                                                          const v1::ReleaseHandlesRequest* req,
                                                          v1::ReleaseHandlesResponse* resp) {
  const std::string ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, ns, access::Action::kCall);
  std::vector<uint64_t> ids(req->handles().begin(), req->handles().end());
  resp->set_released(calls_.ReleaseHandles(ns, RegionOwner(caller, req->client_id()), ids));
  return FinishNow(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* ExecutorService::OpenChannel(grpc::CallbackServerContext* ctx,
                                                       const v1::OpenChannelRequest* req,
                                                       v1::OpenChannelResponse* resp) {
  const std::string ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, ns, access::Action::kCall);
  if (core_.channels == nullptr) {
    return FinishNow(ctx, absl::UnimplementedError("this server has no fast channels"));
  }
  auto info = core_.channels->Open(ns, RegionOwner(caller, req->client_id()), req->lease_ms(),
                                   caller.uid, QuarantineCaller(caller));
  if (!info.ok()) return FinishNow(ctx, info.status());
  resp->set_channel_id(info->id);
  resp->set_shm_key(info->shm_key);
  resp->set_byte_size(info->byte_size);
  resp->set_slots(fast::kSlots);
  resp->set_max_tensors(fast::kMaxTensors);
  resp->set_spin_us(info->spin_us);
  resp->set_worker_pid(info->pid);
  resp->set_region(info->region);
  resp->set_daemon_pid(static_cast<int32_t>(::getpid()));
  return FinishNow(ctx, absl::OkStatus());
}

}  // namespace opjit::rpc
