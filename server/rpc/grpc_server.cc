#include "server/rpc/grpc_server.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "server/common/logging.h"
#include "server/rpc/decode_guard.h"

namespace opjit::rpc {
namespace {

// True when something accepts connections on the unix socket `path`.
bool SocketIsLive(const std::string& path) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  bool live = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return live;
}

absl::Status PrepareUnixSocket(const std::string& path) {
  if (path.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unix socket path is too long (", path.size(), " bytes, max ",
                     sizeof(sockaddr_un::sun_path) - 1, "): ", path));
  }
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " exists and is not a socket; refusing to replace it"));
  }
  if (SocketIsLive(path)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "another server is already listening on unix:", path,
        "; stop it first or pass a different --listen/--state-dir"));
  }
  Logger("rpc")->info("replacing stale socket {}", path);
  if (unlink(path.c_str()) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot remove stale socket ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

std::string UnixSocketPath(const std::string& address) {
  if (address.rfind("unix://", 0) == 0) return address.substr(7);
  if (address.rfind("unix:", 0) == 0) return address.substr(5);
  return "";
}

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const GrpcServerOptions& options,
                                                              CoreRefs core, ServerFacts facts) {
  std::unique_ptr<GrpcServer> self(new GrpcServer());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  RouteProtobufLogs();
  grpc::ServerBuilder builder;
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(MakeDecodeGuardFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  std::vector<std::unique_ptr<int>> ports;
  for (const std::string& address : options.listen) {
    const std::string path = UnixSocketPath(address);
    if (!path.empty()) {
      if (absl::Status s = PrepareUnixSocket(path); !s.ok()) return s;
      self->socket_files_.push_back(path);
    }
    ports.push_back(std::make_unique<int>(0));
    builder.AddListeningPort(address, grpc::InsecureServerCredentials(), ports.back().get());
  }
  facts.listen = options.listen;
  self->services_.push_back(std::make_unique<RegistryService>(core));
  self->services_.push_back(std::make_unique<CompilerService>(core));
  auto server_service = std::make_unique<ServerService>(core, facts);
  ServerService* server_info = server_service.get();
  self->services_.push_back(std::move(server_service));
  if (core.regions != nullptr) self->services_.push_back(std::make_unique<MemoryService>(core));
  if (core.executor != nullptr) self->services_.push_back(std::make_unique<ExecutorService>(core));
  for (auto& service : self->services_) builder.RegisterService(service.get());

  self->server_ = builder.BuildAndStart();
  if (self->server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "could not bind every listen address (", options.listen.size(),
        " given); is a port in use or a directory missing? Run with --log-level debug for gRPC's reason"));
  }
  for (size_t i = 0; i < options.listen.size(); ++i) {
    const std::string& address = options.listen[i];
    if (*ports[i] == 0) {
      self->server_->Shutdown();
      return absl::UnavailableError(absl::StrCat("could not bind ", address));
    }
    if (!UnixSocketPath(address).empty()) {
      self->bound_.push_back(address);
      chmod(UnixSocketPath(address).c_str(), 0660);
    } else {
      const std::string host = address.substr(0, address.rfind(':'));
      self->bound_.push_back(absl::StrCat(host, ":", *ports[i]));
    }
  }
  server_info->SetBound(self->bound_);
  self->server_->GetHealthCheckService()->SetServingStatus(true);
  return self;
}

GrpcServer::~GrpcServer() {
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
  }
  for (const auto& path : socket_files_) unlink(path.c_str());
}

void GrpcServer::Shutdown(std::chrono::milliseconds grace) {
  server_->GetHealthCheckService()->SetServingStatus(false);
  server_->Shutdown(std::chrono::system_clock::now() + grace);
}

void GrpcServer::Wait() { server_->Wait(); }

}  // namespace opjit::rpc
