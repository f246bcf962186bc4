// Builds and runs the gRPC server: opjit's services, the standard health
// service and server reflection, on unix sockets and TCP ports.
//
// Thread-safety: Shutdown() may be called from any thread, once.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/rpc/services.h"

namespace grpc {
class Server;
}

namespace opjit::rpc {

struct GrpcServerOptions {
  // "unix:/path" or "host:port"; port 0 picks a free port. Required.
  std::vector<std::string> listen;
  // Largest message in either direction. Default: 64 MiB.
  int max_message_bytes = 64 << 20;
};

class GrpcServer {
 public:
  // Binds every address and starts serving. A unix socket that a live server
  // answers on is refused (FAILED_PRECONDITION); a stale socket file is
  // replaced. UNAVAILABLE when an address cannot be bound.
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(const GrpcServerOptions& options,
                                                           CoreRefs core, ServerFacts facts);
  ~GrpcServer();

  // The addresses actually bound (a TCP port 0 replaced by the chosen port).
  const std::vector<std::string>& bound() const { return bound_; }

  // Stops accepting calls, lets in-flight calls finish for up to `grace`, then
  // cancels the rest. Removes the unix socket files it created.
  void Shutdown(std::chrono::milliseconds grace);
  // Blocks until the server has shut down.
  void Wait();

 private:
  GrpcServer() = default;
  std::vector<std::unique_ptr<grpc::Service>> services_;
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::string> bound_;
  std::vector<std::string> socket_files_;
};

// "unix:/a" -> "/a"; "" when `address` is not a unix socket address.
std::string UnixSocketPath(const std::string& address);

}  // namespace opjit::rpc
