#include "server/metrics/http_exporter.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_set>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/common/logging.h"

namespace opjit::metrics {
namespace {

constexpr char kTextType[] = "text/plain; charset=utf-8";
constexpr char kIndexBody[] =
    "opjit metrics exporter\n"
    "Prometheus metrics are at /metrics\n";
constexpr int kMaxThreads = 64;
// Room in each connection's memory pool beyond twice the largest head:
// libmicrohttpd's parsed-header records and the response header.
constexpr size_t kPoolSlackBytes = 8192;

// Closes the descriptor it holds unless released.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string ErrnoText(int err) {
  char buf[128];
  // GNU strerror_r returns the message, which may or may not be `buf`.
  return strerror_r(err, buf, sizeof(buf));
}

bool HasLineBreak(std::string_view s) { return s.find_first_of("\r\n") != std::string_view::npos; }

std::string_view TrimSpaces(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? char(c - 'A' + 'a') : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

// The statuses a handler may answer; anything else is sent as 500.
unsigned int KnownStatus(int status) {
  switch (status) {
    case 200:
    case 401:
    case 403:
    case 404:
    case 503:
      return static_cast<unsigned int>(status);
    default:
      return 500;
  }
}

// Parses "host:port" into an IPv4 socket address.
absl::Status ParseListen(const std::string& listen, sockaddr_in* addr) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics listen address \"", listen, "\" is not host:port"));
  }
  std::string host = listen.substr(0, colon);
  const std::string port_text = listen.substr(colon + 1);
  if (host.find_first_of(":[]") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("metrics listen address \"", listen,
                                                   "\": only IPv4 or localhost is supported"));
  }
  if (host.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics listen address \"", listen, "\" has no host"));
  }
  if (port_text.empty() || port_text.size() > 5 ||
      !std::all_of(port_text.begin(), port_text.end(),
                   [](char c) { return c >= '0' && c <= '9'; })) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics listen address \"", listen, "\" has no valid port"));
  }
  int port = 0;
  for (char c : port_text) port = port * 10 + (c - '0');
  if (port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics listen address \"", listen, "\": port out of range"));
  }
  if (host == "localhost") host = "127.0.0.1";
  *addr = {};
  addr->sin_family = AF_INET;
  addr->sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr->sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics listen address \"", listen,
                                                   "\": host is not an IPv4 address or localhost"));
  }
  return absl::OkStatus();
}

// What the request head said that the exporter checks, gathered by one pass
// over libmicrohttpd's parsed headers and query arguments.
struct HeadScan {
  HttpExporter::Request request;
  size_t bytes = 0;  // the head's size, as near as the parsed form tells
  bool malformed = false;
};

MHD_Result ScanHeader(void* cls, MHD_ValueKind kind, const char* key, const char* value) {
  auto* scan = static_cast<HeadScan*>(cls);
  const std::string_view name = key != nullptr ? key : "";
  const std::string_view text = value != nullptr ? value : "";
  if (kind == MHD_GET_ARGUMENT_KIND) {
    scan->bytes += name.size() + text.size() + 2;  // "name=value&"
    return MHD_YES;
  }
  scan->bytes += name.size() + text.size() + 4;  // "name: value\r\n"
  // libmicrohttpd keeps a space before the colon in the name; a request
  // that relies on it is ambiguous (RFC 9112 5.1).
  if (name.empty() || name.find_first_of(" \t") != std::string_view::npos) {
    scan->malformed = true;
  } else if (EqualsIgnoreCase(name, "authorization")) {
    if (scan->request.authorization.has_value()) scan->malformed = true;  // which one counts?
    scan->request.authorization = std::string(TrimSpaces(text));
  }
  return MHD_YES;
}

// A response that owns `body`, with Content-Type and "Connection: close".
MHD_Response* NewResponse(std::string body, const char* content_type) {
  auto* owned = new std::string(std::move(body));
  MHD_Response* r = MHD_create_response_from_buffer_with_free_callback_cls(
      owned->size(), owned->data(), [](void* p) { delete static_cast<std::string*>(p); }, owned);
  if (r == nullptr) {
    delete owned;
    return nullptr;
  }
  if (MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, content_type) != MHD_YES ||
      MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close") != MHD_YES) {
    MHD_destroy_response(r);
    return nullptr;
  }
  return r;
}

}  // namespace

// One open connection, from libmicrohttpd's "started" notice to its "closed"
// one; `fd` stays open (libmicrohttpd closes it after the notice) while the
// record is in Server::conns.
struct Conn {
  int fd;
  int64_t deadline_ms;  // steady clock: the head's, then the response's
  bool cut = false;     // shut down at its deadline; libmicrohttpd closes it
};

// The libmicrohttpd daemon and what its callbacks share. libmicrohttpd's own
// timeout is one of inactivity, in whole seconds; the reaper thread gives
// each connection an overall deadline instead (a client that trickles its
// head one byte at a time is still cut off), by shutting its socket down so
// that libmicrohttpd sees the end of it and closes it.
struct HttpExporter::Server {
  Server(Handler h, const Options& o) : handler(std::move(h)), options(o) {}
  ~Server();

  // libmicrohttpd callbacks (`cls` is the Server).
  static MHD_Result Answer(void* cls, MHD_Connection* connection, const char* url,
                           const char* method, const char* version, const char* upload_data,
                           size_t* upload_data_size, void** request_context);
  static void Notify(void* cls, MHD_Connection* connection, void** socket_context,
                     MHD_ConnectionNotificationCode code);
  static void Log(void* cls, const char* format, va_list args);

  // The response to a complete request head; nullptr when none can be built.
  MHD_Response* Respond(MHD_Connection* connection, std::string_view url, std::string_view method,
                        unsigned int* status);
  void Reap();

  const Handler handler;
  const Options options;
  MHD_Daemon* daemon = nullptr;  // set once by Start, stopped by ~Server
  std::thread reaper;
  LogLimiter log_limiter;

  absl::Mutex handler_mu;  // one handler call at a time, as documented

  absl::Mutex mu;
  absl::CondVar wake;  // a deadline earlier than next_wake_ms, or stopping
  std::unordered_set<Conn*> conns ABSL_GUARDED_BY(mu);
  int64_t next_wake_ms ABSL_GUARDED_BY(mu) = std::numeric_limits<int64_t>::max();
  bool stopping ABSL_GUARDED_BY(mu) = false;
};

HttpExporter::Server::~Server() {
  // Joins libmicrohttpd's threads (after the handler call in progress) and
  // closes every connection, each "closed" notice removing its record.
  if (daemon != nullptr) MHD_stop_daemon(daemon);
  {
    absl::MutexLock lock(&mu);
    stopping = true;
    wake.Signal();
  }
  if (reaper.joinable()) reaper.join();
}

void HttpExporter::Server::Notify(void* cls, MHD_Connection* connection, void** socket_context,
                                  MHD_ConnectionNotificationCode code) {
  auto* self = static_cast<Server*>(cls);
  if (code == MHD_CONNECTION_NOTIFY_STARTED) {
    const MHD_ConnectionInfo* info =
        MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (info == nullptr) return;  // not tracked: only libmicrohttpd's own timeout applies
    auto* conn = new Conn{info->connect_fd, NowMs() + self->options.read_timeout_ms};
    *socket_context = conn;
    absl::MutexLock lock(&self->mu);
    self->conns.insert(conn);
    if (conn->deadline_ms < self->next_wake_ms) self->wake.Signal();
    return;
  }
  auto* conn = static_cast<Conn*>(*socket_context);
  if (conn == nullptr) return;
  {
    absl::MutexLock lock(&self->mu);
    self->conns.erase(conn);
  }
  *socket_context = nullptr;
  delete conn;
}

void HttpExporter::Server::Reap() {
  pthread_setname_np(pthread_self(), "opjit-metrics");
  absl::MutexLock lock(&mu);
  while (!stopping) {
    const int64_t now = NowMs();
    int64_t next = std::numeric_limits<int64_t>::max();
    for (Conn* conn : conns) {
      if (conn->cut) continue;
      if (conn->deadline_ms > now) {
        next = std::min(next, conn->deadline_ms);
        continue;
      }
      // The record is still in `conns`, so libmicrohttpd has not closed
      // the descriptor yet: it is this connection's.
      shutdown(conn->fd, SHUT_RDWR);
      conn->cut = true;
      Logger("metrics")->debug("metrics exporter: closed a connection past its deadline");
    }
    next_wake_ms = next;
    if (next == std::numeric_limits<int64_t>::max()) {
      wake.Wait(&mu);
    } else {
      wake.WaitWithTimeout(&mu, absl::Milliseconds(next - now));
    }
  }
}

void HttpExporter::Server::Log(void* cls, const char* format, va_list args) {
  auto* self = static_cast<Server*>(cls);
  uint64_t suppressed = 0;
  if (!self->log_limiter.Allow(&suppressed)) return;
  char buf[512];
  vsnprintf(buf, sizeof(buf), format, args);
  std::string_view text(buf);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.remove_suffix(1);
  Logger("metrics")->debug("metrics exporter: libmicrohttpd: {} ({} more suppressed)",
                           std::string(text), suppressed);
}

MHD_Result HttpExporter::Server::Answer(void* cls, MHD_Connection* connection, const char* url,
                                        const char* method, const char* /*version*/,
                                        const char* /*upload_data*/, size_t* upload_data_size,
                                        void** request_context) {
  auto* self = static_cast<Server*>(cls);
  // A request body is never read: a later call for one only discards it
  // (the response was queued on the first call).
  static int answered;
  if (*request_context == &answered) {
    *upload_data_size = 0;
    return MHD_YES;
  }
  *request_context = &answered;

  // The head is complete: from here on the response's deadline applies.
  if (const MHD_ConnectionInfo* info =
          MHD_get_connection_info(connection, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
      info != nullptr && info->socket_context != nullptr) {
    auto* conn = static_cast<Conn*>(info->socket_context);
    absl::MutexLock lock(&self->mu);
    conn->deadline_ms = NowMs() + self->options.write_timeout_ms;
    if (conn->deadline_ms < self->next_wake_ms) self->wake.Signal();
  }

  unsigned int status = 500;
  MHD_Response* response = self->Respond(connection, url != nullptr ? url : "",
                                         method != nullptr ? method : "", &status);
  if (response == nullptr) return MHD_NO;  // closes the connection
  const MHD_Result queued = MHD_queue_response(connection, status, response);
  MHD_destroy_response(response);
  return queued;
}

MHD_Response* HttpExporter::Server::Respond(MHD_Connection* connection, std::string_view url,
                                            std::string_view method, unsigned int* status) {
  HeadScan scan;
  scan.bytes = method.size() + url.size() + 16;  // " HTTP/1.1\r\n" and the blank line
  MHD_get_connection_values(connection, MHD_HEADER_KIND, &ScanHeader, &scan);
  MHD_get_connection_values(connection, MHD_GET_ARGUMENT_KIND, &ScanHeader, &scan);
  if (scan.bytes > options.max_request_bytes) {
    *status = MHD_HTTP_REQUEST_HEADER_FIELDS_TOO_LARGE;
    return NewResponse("request too large\n", kTextType);
  }
  if (scan.malformed) {
    *status = MHD_HTTP_BAD_REQUEST;
    return NewResponse("bad request\n", kTextType);
  }
  if (method != MHD_HTTP_METHOD_GET && method != MHD_HTTP_METHOD_HEAD) {
    *status = MHD_HTTP_METHOD_NOT_ALLOWED;
    MHD_Response* r = NewResponse("only GET and HEAD are supported\n", kTextType);
    if (r != nullptr && MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD") != MHD_YES) {
      MHD_destroy_response(r);
      return nullptr;
    }
    return r;
  }
  std::string_view path = url;
  // Absolute form (a proxy's "http://host:port/metrics") names the same path.
  if (path.substr(0, 7) == "http://") {
    const size_t slash = path.find('/', 7);
    path = slash == std::string_view::npos ? std::string_view("/") : path.substr(slash);
  }
  path = path.substr(0, path.find_first_of("?#"));
  if (path == "/") {
    *status = MHD_HTTP_OK;
    return NewResponse(kIndexBody, kTextType);
  }
  if (path != "/metrics") {
    *status = MHD_HTTP_NOT_FOUND;
    return NewResponse("not found; metrics are at /metrics\n", kTextType);
  }

  Response answer;
  {
    absl::MutexLock lock(&handler_mu);
    answer = handler(scan.request);
  }
  std::string content_type = std::move(answer.content_type);
  if (content_type.empty() || HasLineBreak(content_type)) content_type = "text/plain";
  MHD_Response* r = NewResponse(std::move(answer.body), content_type.c_str());
  if (r == nullptr) return nullptr;
  for (const auto& [name, value] : answer.headers) {
    // Header lines that would split the response are dropped.
    if (name.empty() || HasLineBreak(name) || HasLineBreak(value) ||
        name.find(':') != std::string::npos ||
        MHD_add_response_header(r, name.c_str(), value.c_str()) != MHD_YES) {
      Logger("metrics")->warn("metrics exporter: dropping a malformed response header");
    }
  }
  *status = KnownStatus(answer.status);
  return r;
}

HttpExporter::Response HttpExporter::Response::Metrics(std::string body) {
  Response r;
  r.body = std::move(body);
  return r;
}

HttpExporter::Response HttpExporter::Response::Unauthorized(const std::string& realm) {
  Response r;
  r.status = 401;
  r.content_type = kTextType;
  r.body = "unauthorized: send \"Authorization: Bearer <token>\"\n";
  r.headers.emplace_back("WWW-Authenticate", absl::StrCat("Bearer realm=\"", realm, "\""));
  return r;
}

absl::StatusOr<std::unique_ptr<HttpExporter>> HttpExporter::Start(
    const std::string& listen, std::function<std::string()> render) {
  return Start(listen, std::move(render), Options{});
}

absl::StatusOr<std::unique_ptr<HttpExporter>> HttpExporter::Start(
    const std::string& listen, std::function<std::string()> render, const Options& options) {
  if (!render) return absl::InvalidArgumentError("metrics exporter needs a render function");
  return Start(
      listen, [render = std::move(render)](const Request&) { return Response::Metrics(render()); },
      options);
}

absl::StatusOr<std::unique_ptr<HttpExporter>> HttpExporter::Start(const std::string& listen,
                                                                  Handler handler) {
  return Start(listen, std::move(handler), Options{});
}

absl::StatusOr<std::unique_ptr<HttpExporter>> HttpExporter::Start(const std::string& listen,
                                                                  Handler handler,
                                                                  const Options& options) {
  if (!handler) return absl::InvalidArgumentError("metrics exporter needs a handler");
  sockaddr_in addr;
  if (absl::Status s = ParseListen(listen, &addr); !s.ok()) return s;

  Options clamped = options;
  clamped.read_timeout_ms = std::max(clamped.read_timeout_ms, 1);
  clamped.write_timeout_ms = std::max(clamped.write_timeout_ms, 1);
  clamped.threads = std::clamp(clamped.threads, 1, kMaxThreads);
  clamped.max_connections = std::max(clamped.max_connections, clamped.threads);
  clamped.max_connections_per_address = std::max(clamped.max_connections_per_address, 0);

  // The socket is bound here rather than by libmicrohttpd, for the same
  // errors and address handling as ever; libmicrohttpd is handed a copy.
  ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (fd.get() < 0) {
    return absl::UnavailableError(absl::StrCat("metrics exporter: socket: ", ErrnoText(errno)));
  }
  const int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics exporter: bind ", listen, ": ", ErrnoText(errno)));
  }
  if (::listen(fd.get(), std::max(64, clamped.max_connections)) != 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics exporter: listen ", listen, ": ", ErrnoText(errno)));
  }
  sockaddr_in bound{};
  socklen_t len = sizeof(bound);
  if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics exporter: getsockname: ", ErrnoText(errno)));
  }
  char host[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &bound.sin_addr, host, sizeof(host));
  const int port = ntohs(bound.sin_port);
  // libmicrohttpd closes the socket it is given, on stop and on most of its
  // start failures (not all), so it gets a duplicate and `fd` stays ours.
  const int mhd_fd = fcntl(fd.get(), F_DUPFD_CLOEXEC, 0);
  if (mhd_fd < 0) {
    return absl::UnavailableError(absl::StrCat("metrics exporter: dup: ", ErrnoText(errno)));
  }

  auto server = std::make_unique<Server>(std::move(handler), clamped);
  server->reaper = std::thread([s = server.get()] { s->Reap(); });
  // libmicrohttpd's own (inactivity) timeout backs up the reaper's deadlines.
  const int idle_timeout_ms = std::max(clamped.read_timeout_ms, clamped.write_timeout_ms);
  server->daemon = MHD_start_daemon(
      MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ITC | MHD_USE_ERROR_LOG, 0, nullptr, nullptr,
      &Server::Answer, server.get(),  //
      MHD_OPTION_LISTEN_SOCKET, mhd_fd,  //
      MHD_OPTION_THREAD_POOL_SIZE, static_cast<unsigned int>(clamped.threads),
      MHD_OPTION_CONNECTION_LIMIT, static_cast<unsigned int>(clamped.max_connections),
      MHD_OPTION_PER_IP_CONNECTION_LIMIT,
      static_cast<unsigned int>(clamped.max_connections_per_address),
      MHD_OPTION_CONNECTION_TIMEOUT, static_cast<unsigned int>((idle_timeout_ms + 999) / 1000),
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, 2 * clamped.max_request_bytes + kPoolSlackBytes,
      MHD_OPTION_NOTIFY_CONNECTION, &Server::Notify, server.get(),  //
      MHD_OPTION_EXTERNAL_LOGGER, &Server::Log, server.get(),  //
      MHD_OPTION_END);
  if (server->daemon == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("metrics exporter: cannot start the HTTP server on ", listen));
  }
  std::unique_ptr<HttpExporter> exporter(
      new HttpExporter(port, absl::StrCat(host, ":", port), std::move(server)));
  Logger("metrics")->debug("serving metrics on http://{}/metrics ({} threads)",
                           exporter->address(), clamped.threads);
  return exporter;
}

HttpExporter::HttpExporter(int port, std::string address, std::unique_ptr<Server> server)
    : port_(port), address_(std::move(address)), server_(std::move(server)) {}

HttpExporter::~HttpExporter() = default;

}  // namespace opjit::metrics
