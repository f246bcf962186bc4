// Evaluator service: proto <-> evaluate domain types.
#include "server/access/access.h"
#include "server/common/logging.h"
#include "server/evaluate/evaluator.h"
#include "server/rpc/caller.h"
#include "server/rpc/exec_convert.h"
#include "server/rpc/services.h"
#include "server/rpc/status_util.h"

#include "absl/strings/str_cat.h"

namespace opjit::rpc {
namespace {

evaluate::ShapeSet ShapeSetFromProto(const v1::ShapeSet& s) {
  evaluate::ShapeSet out;
  for (const v1::IntList& shape : s.inputs()) out.emplace_back(shape.values().begin(), shape.values().end());
  return out;
}

void StatsToProto(const evaluate::TimingStats& s, v1::TimingStats* out) {
  out->set_reps(s.reps);
  out->set_median_ms(s.median_ms);
  out->set_p10_ms(s.p10_ms);
  out->set_p90_ms(s.p90_ms);
  out->set_kernel_median_ms(s.kernel_median_ms);
  out->set_kernel_p10_ms(s.kernel_p10_ms);
  out->set_kernel_p90_ms(s.kernel_p90_ms);
  out->set_spread(s.spread);
}

void CaseToProto(const evaluate::CaseReport& c, v1::VerifyCase* out) {
  out->set_index(c.index);
  out->set_kind(c.kind);
  out->set_dtype(c.dtype);
  out->set_shapes(c.shapes);
  out->set_seed(c.seed);
  out->set_passed(c.passed);
  out->set_skipped(c.skipped);
  out->set_deterministic(c.deterministic);
  out->set_max_abs_error(c.max_abs_error);
  out->set_max_rel_error(c.max_rel_error);
  out->set_max_ulp_error(c.max_ulp_error);
  out->set_worst_output(c.worst_output);
  out->set_worst_index(c.worst_index);
  out->set_candidate_value(c.candidate_value);
  out->set_reference_value(c.reference_value);
  out->set_message(c.message);
  out->set_candidate_kernel_ms(c.candidate_kernel_ms);
}

// The given cases' tensors (inline only: the server writes them into
// regions of its own).
absl::StatusOr<std::vector<evaluate::GivenCase>> GivenFromProto(
    const google::protobuf::RepeatedPtrField<v1::GivenCase>& given) {
  std::vector<evaluate::GivenCase> out;
  for (int g = 0; g < given.size(); ++g) {
    evaluate::GivenCase gc;
    auto inputs = InputsFromProto(given[g].inputs());
    if (!inputs.ok()) return inputs.status();
    for (auto& group : *inputs) {
      if (group.size() != 1 || group[0].inline_bytes() == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("given[", g, "]: every input is one inline tensor"));
      }
      gc.inputs.push_back(std::move(group[0]));
    }
    for (int k = 0; k < given[g].outputs_size(); ++k) {
      auto t = TensorFromProto(given[g].outputs(k),
                               [&] { return absl::StrCat("given[", g, "].outputs[", k, "]"); });
      if (!t.ok()) return t.status();
      if (t->inline_bytes() == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("given[", g, "].outputs[", k, "]: give the bytes inline"));
      }
      gc.outputs.push_back(*std::move(t));
    }
    out.push_back(std::move(gc));
  }
  return out;
}

}  // namespace

grpc::ServerUnaryReactor* EvaluatorService::Verify(grpc::CallbackServerContext* ctx,
                                                   const v1::VerifyRequest* req,
                                                   v1::VerifyResponse* resp) {
  evaluate::VerifyCall call;
  call.deadline = SteadyDeadline(*ctx);
  call.ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, call.ns, access::Action::kCall);
  if (absl::Status s = calls_.Admit(call.ns); !s.ok()) return FinishNow(ctx, s);
  call.principal = RegionScope(caller);
  call.quarantine_caller = QuarantineCaller(caller);
  if (req->candidate().op().empty()) {
    return FinishNow(ctx, absl::InvalidArgumentError("name the candidate op"));
  }
  call.candidate = req->candidate().op();
  call.candidate_version = req->candidate().version();
  call.reference = req->reference().op();
  call.reference_version = req->reference().version();
  auto given = GivenFromProto(req->given());
  if (!given.ok()) return FinishNow(ctx, given.status());
  call.given = *std::move(given);
  auto attrs = AttrsFromProto(req->attrs());
  if (!attrs.ok()) return FinishNow(ctx, attrs.status());
  call.attrs = *std::move(attrs);
  for (const v1::ShapeSet& s : req->shapes()) call.shapes.push_back(ShapeSetFromProto(s));
  call.dtypes.assign(req->dtypes().begin(), req->dtypes().end());
  call.seeds = req->seeds();
  call.seed = req->seed();
  call.low = req->low();
  call.high = req->high();
  call.special_values = !req->has_special_values() || req->special_values();
  if (req->tolerance().has_atol()) call.tolerance.atol = req->tolerance().atol();
  if (req->tolerance().has_rtol()) call.tolerance.rtol = req->tolerance().rtol();
  if (req->tolerance().has_ulps()) call.tolerance.ulps = req->tolerance().ulps();
  call.fp64_reference = req->fp64_reference();
  call.inplace_inputs.assign(req->inplace_inputs().begin(), req->inplace_inputs().end());
  call.settle_ms = req->settle_ms() == 0 ? 10 : req->settle_ms();
  // A client that hangs up: dropped from the queue, or stopped at its next run.
  call.cancelled = [ctx] { return ctx->IsCancelled(); };
  auto* reactor = ctx->DefaultReactor();
  // The request (and the given bytes the call views) lives until Finish.
  core_.evaluator->VerifyAsync(
      std::move(call), [reactor, resp](absl::StatusOr<evaluate::VerifyResult> r) {
        if (!r.ok()) {
          Logger("rpc")->debug("Verify: {}", r.status().ToString());
          reactor->Finish(ToGrpcStatus(r.status()));
          return;
        }
        resp->set_passed(r->passed);
        resp->set_deterministic(r->deterministic);
        resp->set_seed(r->seed);
        resp->set_cases_passed(r->passed_cases);
        resp->set_cases_failed(r->failed_cases);
        resp->set_cases_skipped(r->skipped_cases);
        for (const auto& c : r->cases) CaseToProto(c, resp->add_cases());
        for (const auto& t : r->tolerances) resp->add_tolerances(t);
        resp->set_reproduce(r->reproduce);
        reactor->Finish(grpc::Status::OK);
      });
  return reactor;
}

grpc::ServerUnaryReactor* EvaluatorService::Benchmark(grpc::CallbackServerContext* ctx,
                                                      const v1::BenchmarkRequest* req,
                                                      v1::BenchmarkResponse* resp) {
  evaluate::BenchmarkCall call;
  call.deadline = SteadyDeadline(*ctx);
  call.ns = NamespaceOrDefault(req->namespace_());
  OPJIT_RPC_ADMIT(caller, call.ns, access::Action::kCall);
  if (absl::Status s = calls_.Admit(call.ns); !s.ok()) return FinishNow(ctx, s);
  call.principal = RegionScope(caller);
  call.quarantine_caller = QuarantineCaller(caller);
  if (req->op().op().empty()) return FinishNow(ctx, absl::InvalidArgumentError("name the op"));
  call.op = req->op().op();
  call.version = req->op().version();
  call.reference = req->reference().op();
  call.reference_version = req->reference().version();
  auto attrs = AttrsFromProto(req->attrs());
  if (!attrs.ok()) return FinishNow(ctx, attrs.status());
  call.attrs = *std::move(attrs);
  call.shape = ShapeSetFromProto(req->shape());
  call.dtype = req->dtype();
  call.seed = req->seed();
  if (req->warmup() > 0) call.warmup = req->warmup();
  if (req->min_reps() > 0) call.min_reps = req->min_reps();
  if (req->max_reps() > 0) call.max_reps = req->max_reps();
  if (req->min_time_ms() > 0) call.min_time_ms = req->min_time_ms();
  call.flush_cache = req->flush_cache();
  call.cancelled = [ctx] { return ctx->IsCancelled(); };
  auto* reactor = ctx->DefaultReactor();
  core_.evaluator->BenchmarkAsync(
      std::move(call), [reactor, resp](absl::StatusOr<evaluate::BenchmarkResult> r) {
        if (!r.ok()) {
          Logger("rpc")->debug("Benchmark: {}", r.status().ToString());
          reactor->Finish(ToGrpcStatus(r.status()));
          return;
        }
        StatsToProto(r->op, resp->mutable_op());
        if (r->reference) StatsToProto(*r->reference, resp->mutable_reference());
        resp->set_ratio(r->ratio);
        resp->set_ratio_p10(r->ratio_p10);
        resp->set_ratio_p90(r->ratio_p90);
        resp->set_flush_bytes(static_cast<double>(r->flush_bytes));
        resp->set_shapes(r->shapes);
        resp->set_reproduce(r->reproduce);
        reactor->Finish(grpc::Status::OK);
      });
  return reactor;
}

}  // namespace opjit::rpc
