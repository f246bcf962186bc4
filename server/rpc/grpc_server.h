// Builds and runs the gRPC server: opjit's services, the standard health
// service and server reflection, on unix sockets and TCP ports.
//
// Thread-safety: Shutdown() may be called from any thread, once.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "server/common/mutex.h"
#include "server/rpc/services.h"

namespace grpc {
class Server;
namespace experimental {
class ServerInterceptorFactoryInterface;
}
}  // namespace grpc

namespace opjit::rpc {

// Largest message a unix-socket peer may send when its uid maps to no
// principal (see GrpcServerOptions::guest_max_message_bytes).
inline constexpr int kGuestMaxMessageBytes = 64 << 10;

struct GrpcServerOptions {
  // "unix:/path" or "host:port"; port 0 picks a free port. Required.
  std::vector<std::string> listen;
  // Largest message in either direction. Default: 64 MiB.
  int max_message_bytes = 64 << 20;
  // Identity before bytes. With principals configured, a unix connection
  // whose SO_PEERCRED uid (or gid) maps to no principal is checked when it is
  // accepted, before it sends a byte, and served by a second gRPC server
  // whose largest received message is this (its calls still authenticate:
  // a bearer token works, for small messages). A larger message is never
  // decoded: gRPC refuses it RESOURCE_EXHAUSTED, and the guest server's
  // resource quota (16 MiB for all guest connections, grpc_server.cc) resets
  // a stream whose buffered bytes outgrow it ("RST_STREAM with error code
  // 11"), so the daemon holds at most about that much for unknown peers.
  // A small request is answered UNAUTHENTICATED, naming the uid. A
  // connection keeps its server until it closes (a reload that maps the uid
  // applies to new connections). TCP peers are not covered: their token
  // arrives with the call, after gRPC has read the message.
  int guest_max_message_bytes = kGuestMaxMessageBytes;

  // TLS for every TCP address: PEM files. Empty cert: plaintext TCP.
  std::string tls_cert_file, tls_key_file;
  // CA that signs client certificates. Set: clients may present one (and
  // must, with tls_require_client_cert). Default: none.
  std::string tls_client_ca_file;
  bool tls_require_client_cert = false;

  // Mode and group of unix sockets. Default: 0660 and the daemon's group.
  unsigned socket_mode = 0660;
  std::string socket_group;

  // Extra interceptors (metrics), run after the decode guard.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
};

class GrpcServer {
 public:
  // Binds every address and starts serving. A unix socket that a live server
  // answers on is refused (FAILED_PRECONDITION); a stale socket file is
  // replaced. UNAVAILABLE when an address cannot be bound.
  // Unix sockets are accepted by the server's own thread and handed to gRPC
  // by descriptor, so that every call can read the peer's SO_PEERCRED.
  // INVALID_ARGUMENT for unreadable TLS files or an unknown socket group.
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(GrpcServerOptions options,
                                                           CoreRefs core, ServerFacts facts);
  ~GrpcServer();

  // The addresses actually bound (a TCP port 0 replaced by the chosen port).
  const std::vector<std::string>& bound() const { return bound_; }

  // Stops accepting calls, lets in-flight calls finish for up to `grace`, then
  // cancels the rest. Removes the unix socket files it created.
  void Shutdown(std::chrono::milliseconds grace);
  // Blocks until the server has shut down.
  void Wait();

  // What grpc.health.v1 reports for the whole server ("") and each opjit
  // service: SERVING when true. A service set by SetServiceServing reports
  // SERVING only while both say so.
  void SetServing(bool serving);

  // What grpc.health.v1 reports for `service`, a name of the daemon's own
  // (e.g. "opjit.registry.store") that a client can check on its own. The
  // first call makes the name known (before it: NOT_FOUND).
  void SetServiceServing(const std::string& service, bool serving);

 private:
  GrpcServer() = default;
  std::vector<std::unique_ptr<grpc::Service>> services_;
  std::unique_ptr<grpc::Server> server_;
  // Unix connections of peers that map to no principal (null: principals
  // are not configured, or no unix socket), and its own services.
  std::vector<std::unique_ptr<grpc::Service>> guest_services_;
  std::unique_ptr<grpc::Server> guest_;
  access::AccessControl* access_ = nullptr;
  std::vector<std::string> bound_;
  std::vector<std::string> socket_files_;
  // Unix listening sockets and the thread that accepts on them.
  std::vector<int> unix_fds_;
  int wake_fd_ = -1;
  std::thread acceptor_;
  std::atomic<bool> stopping_{false};
  // What SetServing and SetServiceServing were told last.
  Mutex health_mu_;
  bool serving_ ABSL_GUARDED_BY(health_mu_) = true;
  std::map<std::string, bool> service_serving_ ABSL_GUARDED_BY(health_mu_);

  void AcceptLoop();
  void StopAccepting();
  // Whether the unix connection `fd` goes to guest_: its peer maps to no
  // principal without a token.
  bool IsGuest(int fd) const;
};

// "unix:/a" -> "/a"; "" when `address` is not a unix socket address.
std::string UnixSocketPath(const std::string& address);

}  // namespace opjit::rpc
