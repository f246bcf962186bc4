#include "server/rpc/decode_guard.h"

#include <google/protobuf/stubs/logging.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/rpc/status_util.h"

namespace opjit::rpc {
namespace {

using grpc::experimental::InterceptionHookPoints;

LogLimiter& DecodeLogLimiter() {
  static LogLimiter limiter;
  return limiter;
}

class DecodeGuard final : public grpc::experimental::Interceptor {
 public:
  explicit DecodeGuard(grpc::experimental::ServerRpcInfo* info)
      : info_(info),
        single_request_(info->type() == grpc::experimental::ServerRpcInfo::Type::UNARY ||
                        info->type() == grpc::experimental::ServerRpcInfo::Type::SERVER_STREAMING) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    // A request that failed to decode reaches the interceptors as no message.
    // Only for single-request methods: a stream's end looks the same.
    if (single_request_ &&
        m->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        m->GetRecvMessage() == nullptr) {
      undecodable_ = true;
    }
    if (undecodable_ && m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const char* method = info_->method() != nullptr ? info_->method() : "?";
      m->ModifySendStatus(ToGrpcStatus(WithReason(
          absl::InvalidArgumentError(absl::StrCat(
              "the request to ", method,
              " could not be decoded: it is not a valid protobuf message of the "
              "method's request type (malformed wire data, or a string field that is "
              "not UTF-8). Use the opjit.v1 protos the server was built with.")),
          reason::kMalformedRequest)));
      uint64_t suppressed = 0;
      if (DecodeLogLimiter().Allow(&suppressed)) {
        Logger("rpc")->warn("undecodable request to {} (INVALID_ARGUMENT); {} more since the last "
                            "report",
                            method, suppressed);
      }
    }
    m->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* info_;
  const bool single_request_;
  bool undecodable_ = false;
};

class DecodeGuardFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new DecodeGuard(info);
  }
};

void ProtobufLogToRpcLogger(google::protobuf::LogLevel level, const char* filename, int line,
                            const std::string& message) {
  (void)filename;
  (void)line;
  static LogLimiter limiter;
  uint64_t suppressed = 0;
  if (!limiter.Allow(&suppressed)) return;
  auto log = Logger("rpc");
  const auto lvl = level >= google::protobuf::LOGLEVEL_ERROR ? spdlog::level::warn
                                                              : spdlog::level::debug;
  log->log(lvl, "protobuf: {} ({} more since the last report)", message, suppressed);
}

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeDecodeGuardFactory() {
  return std::make_unique<DecodeGuardFactory>();
}

void RouteProtobufLogs() { google::protobuf::SetLogHandler(&ProtobufLogToRpcLogger); }

}  // namespace opjit::rpc
