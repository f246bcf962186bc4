// Counts every RPC for the Prometheus endpoint: opjit_rpc_calls_total by
// method, namespace, op, status code and transport ("grpc"), and
// opjit_rpc_latency_seconds by method. The namespace and op are read from
// the decoded request (its "namespace" and "op"/"name" fields, or
// op.namespace/op.name of RegisterOp; a Memory request's "name" is a
// region's, not an op), so every method is covered without per-handler code.
// A call refused with QUOTA_EXCEEDED also counts in
// opjit_quota_refusals_total by method, namespace and the quota named in its
// ErrorInfo.
//
// Calls on fast channels never pass through gRPC; CountChannelCalls adds
// them to the same family as method "Forward", transport "channel", and
// their kernel time to opjit_channel_kernel_seconds_total{namespace,op}.
// They have no latency histogram (the daemon does not see them go by), and
// their quota refusals show only as code RESOURCE_EXHAUSTED (the channel
// reports codes, not reasons).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"

#include <grpcpp/support/server_interceptor.h>

namespace opjit::metrics {
class Registry;
}

namespace opjit::rpc {

// Declares the families in `metrics` (which must outlive the server).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeMetricsInterceptorFactory(
    metrics::Registry* metrics);

// Counts `calls` fast-channel calls of `op` in `ns` that answered `code`,
// whose kernels ran `kernel_seconds` in all. The families must have been
// declared (MakeMetricsInterceptorFactory). Thread-safe.
void CountChannelCalls(metrics::Registry* metrics, const std::string& ns, const std::string& op,
                       absl::StatusCode code, uint64_t calls, double kernel_seconds);

}  // namespace opjit::rpc
