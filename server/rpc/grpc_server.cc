#include "server/rpc/grpc_server.h"

#include <grp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <grpcpp/server_posix.h>
#include <grpcpp/security/server_credentials.h>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>

#include "absl/strings/str_cat.h"
#include "server/access/access.h"
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

// Binds and listens on the unix socket `path` with `mode` and `group`.
absl::StatusOr<int> ListenUnix(const std::string& path, unsigned mode, const std::string& group) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  // Bound with no access for anyone, then opened up: no window where the
  // socket has the umask's mode.
  const mode_t old_umask = umask(0777);
  const int rc = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  umask(old_umask);
  if (rc != 0) {
    const int e = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot bind unix:", path, ": ", std::strerror(e)));
  }
  if (!group.empty()) {
    const struct group* gr = getgrnam(group.c_str());
    if (gr == nullptr) {
      close(fd);
      unlink(path.c_str());
      return absl::InvalidArgumentError(absl::StrCat("socket_group \"", group, "\" does not exist"));
    }
    if (chown(path.c_str(), static_cast<uid_t>(-1), gr->gr_gid) != 0) {
      const int e = errno;
      close(fd);
      unlink(path.c_str());
      return absl::InvalidArgumentError(
          absl::StrCat("cannot give unix:", path, " to group ", group, ": ", std::strerror(e)));
    }
  }
  chmod(path.c_str(), mode);
  if (listen(fd, 128) != 0) {
    const int e = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("listen unix:", path, ": ", std::strerror(e)));
  }
  return fd;
}

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("tls.", what, ": cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (ss.str().empty()) return absl::InvalidArgumentError(absl::StrCat("tls.", what, ": ", path, " is empty"));
  return ss.str();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(
    const GrpcServerOptions& o) {
  if (o.tls_cert_file.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  auto cert = ReadPem(o.tls_cert_file, "cert");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem(o.tls_key_file, "key");
  if (!key.ok()) return key.status();
  pair.cert_chain = *cert;
  pair.private_key = *key;
  ssl.pem_key_cert_pairs.push_back(std::move(pair));
  if (!o.tls_client_ca_file.empty()) {
    auto ca = ReadPem(o.tls_client_ca_file, "client_ca");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = o.tls_require_client_cert
                                         ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                         : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  } else if (o.tls_require_client_cert) {
    return absl::InvalidArgumentError("tls.require_client_cert needs tls.client_ca");
  }
  return grpc::SslServerCredentials(ssl);
}

// Memory gRPC may hold for every guest connection together.
constexpr int kGuestQuotaBytes = 16 << 20;

using InterceptorFactory = grpc::experimental::ServerInterceptorFactoryInterface;

// One interceptor factory (metrics) installed on both servers.
class SharedInterceptorFactory final : public InterceptorFactory {
 public:
  explicit SharedInterceptorFactory(std::shared_ptr<InterceptorFactory> f) : f_(std::move(f)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return f_->CreateServerInterceptor(info);
  }

 private:
  std::shared_ptr<InterceptorFactory> f_;
};

// The decode guard, then `shared`.
void SetInterceptors(grpc::ServerBuilder& builder,
                     const std::vector<std::shared_ptr<InterceptorFactory>>& shared) {
  std::vector<std::unique_ptr<InterceptorFactory>> interceptors;
  interceptors.push_back(MakeDecodeGuardFactory());
  for (const auto& f : shared) interceptors.push_back(std::make_unique<SharedInterceptorFactory>(f));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
}

// Makes opjit's services into `services` and registers them on `builder`;
// returns the Server service (it is told the bound addresses later).
ServerService* AddServices(grpc::ServerBuilder& builder, const CoreRefs& core,
                           const ServerFacts& facts,
                           std::vector<std::unique_ptr<grpc::Service>>* services) {
  services->push_back(std::make_unique<RegistryService>(core));
  services->push_back(std::make_unique<CompilerService>(core));
  auto server_service = std::make_unique<ServerService>(core, facts);
  ServerService* server_info = server_service.get();
  services->push_back(std::move(server_service));
  if (core.regions != nullptr) services->push_back(std::make_unique<MemoryService>(core));
  if (core.executor != nullptr) services->push_back(std::make_unique<ExecutorService>(core));
  if (core.evaluator != nullptr) services->push_back(std::make_unique<EvaluatorService>(core));
  for (auto& service : *services) builder.RegisterService(service.get());
  return server_info;
}

}  // namespace

std::string UnixSocketPath(const std::string& address) {
  if (address.rfind("unix://", 0) == 0) return address.substr(7);
  if (address.rfind("unix:", 0) == 0) return address.substr(5);
  return "";
}

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(GrpcServerOptions options,
                                                              CoreRefs core, ServerFacts facts) {
  std::unique_ptr<GrpcServer> self(new GrpcServer());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  RouteProtobufLogs();
  grpc::ServerBuilder builder;
  std::vector<std::shared_ptr<InterceptorFactory>> shared;
  for (auto& f : options.interceptors) shared.push_back(std::move(f));
  SetInterceptors(builder, shared);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  auto tcp_creds = TcpCredentials(options);
  if (!tcp_creds.ok()) return tcp_creds.status();
  std::vector<std::unique_ptr<int>> ports;
  for (const std::string& address : options.listen) {
    const std::string path = UnixSocketPath(address);
    ports.push_back(std::make_unique<int>(0));
    if (!path.empty()) {
      if (absl::Status s = PrepareUnixSocket(path); !s.ok()) return s;
      auto fd = ListenUnix(path, options.socket_mode, options.socket_group);
      if (!fd.ok()) return fd.status();
      self->socket_files_.push_back(path);
      self->unix_fds_.push_back(*fd);
      *ports.back() = -1;  // bound by us
      continue;
    }
    builder.AddListeningPort(address, *tcp_creds, ports.back().get());
  }
  facts.listen = options.listen;
  ServerService* server_info = AddServices(builder, core, facts, &self->services_);
  ServerService* guest_info = nullptr;
  if (!self->unix_fds_.empty() && core.access != nullptr && core.access->enabled()) {
    // No listening port: AcceptLoop hands it the connections of peers that
    // map to no principal.
    grpc::ServerBuilder guest;
    SetInterceptors(guest, shared);
    guest.SetMaxReceiveMessageSize(options.guest_max_message_bytes);
    guest.SetMaxSendMessageSize(options.max_message_bytes);
    // gRPC's transport buffers a whole message before the size check: the
    // quota's reclaimer cancels a stream whose buffers outgrow it.
    grpc::ResourceQuota quota("opjit-guest");
    quota.Resize(static_cast<size_t>(kGuestQuotaBytes));
    guest.SetResourceQuota(quota);
    guest_info = AddServices(guest, core, facts, &self->guest_services_);
    self->guest_ = guest.BuildAndStart();
    if (self->guest_ == nullptr) return absl::UnavailableError("could not start the guest server");
    self->access_ = core.access;
  }

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
    } else {
      const std::string host = address.substr(0, address.rfind(':'));
      self->bound_.push_back(absl::StrCat(host, ":", *ports[i]));
    }
  }
  server_info->SetBound(self->bound_);
  if (guest_info != nullptr) guest_info->SetBound(self->bound_);
  if (!self->unix_fds_.empty()) {
    self->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (self->wake_fd_ < 0) return absl::UnavailableError("eventfd failed");
    GrpcServer* raw = self.get();
    self->acceptor_ = std::thread([raw] { raw->AcceptLoop(); });
  }
  self->server_->GetHealthCheckService()->SetServingStatus(true);
  if (self->guest_) self->guest_->GetHealthCheckService()->SetServingStatus(true);
  return self;
}

void GrpcServer::AcceptLoop() {
  std::vector<pollfd> fds;
  for (int fd : unix_fds_) fds.push_back({fd, POLLIN, 0});
  fds.push_back({wake_fd_, POLLIN, 0});
  while (!stopping_.load()) {
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      Logger("rpc")->error("poll on unix sockets: {}", std::strerror(errno));
      return;
    }
    if (fds.back().revents != 0) break;
    for (size_t i = 0; i + 1 < fds.size(); ++i) {
      if ((fds[i].revents & POLLIN) == 0) continue;
      while (true) {
        int conn = accept4(fds[i].fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (conn < 0) {
          if (errno == EMFILE || errno == ENFILE) {
            Logger("rpc")->warn("out of file descriptors; a unix connection waits");
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
          }
          break;  // EAGAIN, or a connection that went away
        }
        grpc::AddInsecureChannelFromFd(IsGuest(conn) ? guest_.get() : server_.get(), conn);
      }
    }
  }
}

bool GrpcServer::IsGuest(int fd) const {
  if (guest_ == nullptr) return false;
  access::PeerInfo peer;
  peer.transport = access::PeerInfo::Transport::kUnix;
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && len == sizeof(cred) &&
      cred.pid > 0) {
    peer.uid = cred.uid;
    peer.gid = cred.gid;
    peer.pid = cred.pid;
  }
  return !access_->Authenticate(peer).ok();
}

void GrpcServer::StopAccepting() {
  if (!acceptor_.joinable()) return;
  stopping_.store(true);
  uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    // The loop also sees stopping_ on its next wake-up.
  }
  acceptor_.join();
}

void GrpcServer::SetServing(bool serving) {
  if (server_ == nullptr) return;
  MutexLock lock(&health_mu_);
  serving_ = serving;
  // gRPC's SetServingStatus(bool) sets every service it knows, ours too:
  // put those back.
  for (grpc::Server* s : {server_.get(), guest_.get()}) {
    if (s == nullptr) continue;
    s->GetHealthCheckService()->SetServingStatus(serving);
    for (const auto& [service, up] : service_serving_) {
      s->GetHealthCheckService()->SetServingStatus(service, serving && up);
    }
  }
}

void GrpcServer::SetServiceServing(const std::string& service, bool serving) {
  if (server_ == nullptr) return;
  MutexLock lock(&health_mu_);
  service_serving_[service] = serving;
  server_->GetHealthCheckService()->SetServingStatus(service, serving_ && serving);
  if (guest_) guest_->GetHealthCheckService()->SetServingStatus(service, serving_ && serving);
}

GrpcServer::~GrpcServer() {
  StopAccepting();
  for (grpc::Server* s : {guest_.get(), server_.get()}) {
    if (s == nullptr) continue;
    s->Shutdown(std::chrono::system_clock::now());
    s->Wait();
  }
  for (int fd : unix_fds_) close(fd);
  if (wake_fd_ >= 0) close(wake_fd_);
  for (const auto& path : socket_files_) unlink(path.c_str());
}

void GrpcServer::Shutdown(std::chrono::milliseconds grace) {
  StopAccepting();
  const auto deadline = std::chrono::system_clock::now() + grace;
  if (guest_) {
    guest_->GetHealthCheckService()->SetServingStatus(false);
    guest_->Shutdown(deadline);
  }
  server_->GetHealthCheckService()->SetServingStatus(false);
  server_->Shutdown(deadline);
}

void GrpcServer::Wait() {
  if (guest_) guest_->Wait();
  server_->Wait();
}

}  // namespace opjit::rpc
