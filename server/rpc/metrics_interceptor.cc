#include "server/rpc/metrics_interceptor.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <chrono>
#include <string>

#include "opjit/v1/error.pb.h"
#include "server/common/error_info.h"
#include "server/metrics/metrics.h"
#include "server/rpc/status_util.h"

namespace opjit::rpc {
namespace {

using grpc::experimental::InterceptionHookPoints;

constexpr char kCalls[] = "opjit_rpc_calls_total";
constexpr char kLatency[] = "opjit_rpc_latency_seconds";
constexpr char kChannelKernel[] = "opjit_channel_kernel_seconds_total";
constexpr char kQuotaRefusals[] = "opjit_quota_refusals_total";

// The "quota" metadata of a QUOTA_EXCEEDED status ("" for any other status).
// Its values are the server's own quota names, a small fixed set.
std::string QuotaOf(const grpc::Status& status) {
  if (status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) return "";
  v1::Status rich;
  if (!rich.ParseFromString(status.error_details())) return "";
  for (const auto& any : rich.details()) {
    v1::ErrorInfo info;
    if (any.type_url() != "type.googleapis.com/google.rpc.ErrorInfo" ||
        !info.ParseFromString(any.value()) || info.reason() != reason::kQuotaExceeded) {
      continue;
    }
    auto it = info.metadata().find("quota");
    return it != info.metadata().end() && !it->second.empty() ? it->second : "unknown";
  }
  return "";
}

std::string StringField(const google::protobuf::Message& m, const char* name) {
  const google::protobuf::FieldDescriptor* f = m.GetDescriptor()->FindFieldByName(name);
  if (f == nullptr || f->is_repeated() ||
      f->type() != google::protobuf::FieldDescriptor::TYPE_STRING) {
    return "";
  }
  return m.GetReflection()->GetString(m, f);
}

// What a failed call may not put in its labels. A caller that was refused,
// or that named a namespace it cannot see, must not make series in that
// namespace (its principals' scrapes show them), and names that match no op
// must not fill the family's label cap and push real series into "_other".
// Neither label value can be a real namespace or op name.
void ScrubLabels(const grpc::Status& status, std::string* ns, std::string* op) {
  if (status.ok()) return;
  const std::string reason = ReasonOf(status);
  if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
      status.error_code() == grpc::StatusCode::PERMISSION_DENIED ||
      reason == reason::kNamespaceNotFound) {
    *ns = "(refused)";
    *op = "";
  } else if (reason == reason::kOpNotFound || reason == reason::kVersionNotFound ||
             reason == reason::kInvalidSpec || reason == reason::kMalformedRequest) {
    *op = "(invalid)";
  }
}

// "/opjit.v1.Executor/Forward" -> "Forward".
std::string ShortMethod(const char* method) {
  std::string m = method != nullptr ? method : "?";
  const size_t slash = m.rfind('/');
  return slash == std::string::npos ? m : m.substr(slash + 1);
}

class MetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  MetricsInterceptor(grpc::experimental::ServerRpcInfo* info, metrics::Registry* metrics)
      : metrics_(metrics), method_(ShortMethod(info->method())),
        // Only opjit's own services decode into protobuf messages; others
        // (health, reflection) may hand interceptors raw byte buffers.
        ours_(info->method() != nullptr &&
              std::string(info->method()).rfind("/opjit.v1.", 0) == 0),
        // A Memory request's "name" is a region's, made up per client
        // process: as an op label it would make a new series per client.
        regions_(info->method() != nullptr &&
                 std::string(info->method()).rfind("/opjit.v1.Memory/", 0) == 0),
        start_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        ours_ && m->GetRecvMessage() != nullptr && ns_.empty()) {
      const auto* msg = static_cast<const google::protobuf::Message*>(m->GetRecvMessage());
      ns_ = StringField(*msg, "namespace");
      op_ = StringField(*msg, "op");
      if (op_.empty() && !regions_) op_ = StringField(*msg, "name");
      if (const auto* f = msg->GetDescriptor()->FindFieldByName("op");
          f != nullptr && f->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE &&
          !f->is_repeated()) {
        const google::protobuf::Message& def = msg->GetReflection()->GetMessage(*msg, f);
        ns_ = StringField(def, "namespace");
        op_ = StringField(def, "name");
      }
      if (ns_.empty()) ns_ = "default";
    }
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = m->GetSendStatus();
      ScrubLabels(status, &ns_, &op_);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      metrics_->Inc(kCalls,
                    {method_, ns_.empty() ? "default" : ns_, op_,
                     StatusCodeName(static_cast<absl::StatusCode>(status.error_code())), "grpc"});
      metrics_->Observe(kLatency, {method_}, seconds);
      if (const std::string quota = QuotaOf(status); !quota.empty()) {
        metrics_->Inc(kQuotaRefusals, {method_, ns_.empty() ? "default" : ns_, quota});
      }
    }
    m->Proceed();
  }

 private:
  metrics::Registry* const metrics_;
  const std::string method_;
  const bool ours_;
  const bool regions_;
  const std::chrono::steady_clock::time_point start_;
  std::string ns_, op_;
};

class Factory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit Factory(metrics::Registry* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new MetricsInterceptor(info, metrics_);
  }

 private:
  metrics::Registry* const metrics_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeMetricsInterceptorFactory(metrics::Registry* metrics) {
  metrics->DeclareCounter(kCalls,
                          "Calls answered, by method, namespace, op, status code and transport "
                          "(grpc, or channel for Forwards on a same-host fast channel).",
                          {"method", "namespace", "op", "code", "transport"});
  metrics->DeclareCounter(kChannelKernel,
                          "Seconds inside kernels of calls on fast channels, by namespace and op.",
                          {"namespace", "op"});
  metrics->DeclareCounter(kQuotaRefusals,
                          "gRPC calls refused with QUOTA_EXCEEDED, by method, namespace and the "
                          "quota that was full.",
                          {"method", "namespace", "quota"});
  metrics->DeclareHistogram(kLatency, "RPC latency from the request's arrival to its status.",
                            {"method"},
                            {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                             0.25, 0.5, 1, 2.5, 5, 10, 30});
  return std::make_unique<Factory>(metrics);
}

void CountChannelCalls(metrics::Registry* metrics, const std::string& ns, const std::string& op,
                       absl::StatusCode code, uint64_t calls, double kernel_seconds) {
  if (metrics == nullptr || calls == 0) return;
  metrics->Inc(kCalls, {"Forward", ns, op, StatusCodeName(code), "channel"},
               static_cast<double>(calls));
  if (kernel_seconds > 0) metrics->Inc(kChannelKernel, {ns, op}, kernel_seconds);
}

}  // namespace opjit::rpc
