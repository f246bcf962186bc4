// Counts every RPC for the Prometheus endpoint: opjit_rpc_calls_total by
// method, namespace, op and status code, and opjit_rpc_latency_seconds by
// method. The namespace and op are read from the decoded request (its
// "namespace" and "op"/"name" fields, or op.namespace/op.name of
// RegisterOp), so every method is covered without per-handler code.
#pragma once

#include <memory>

#include <grpcpp/support/server_interceptor.h>

namespace opjit::metrics {
class Registry;
}

namespace opjit::rpc {

// Declares the two families in `metrics` (which must outlive the server).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeMetricsInterceptorFactory(
    metrics::Registry* metrics);

}  // namespace opjit::rpc
