#include "server/metrics/http_exporter.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/common/logging.h"

namespace opjit::metrics {
namespace {

constexpr char kIndexBody[] =
    "opjit metrics exporter\n"
    "Prometheus metrics are at /metrics\n";
// Pause after accept() fails for lack of descriptors or memory, so a full
// table does not turn the loop into a busy spin.
constexpr int kAcceptBackoffMs = 100;

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
  int release() { return std::exchange(fd_, -1); }

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

enum class Wait { kReady, kTimeout, kStop, kError };

// Waits until `fd` has one of `events`, the wake descriptor is readable
// (stop), or the steady-clock `deadline_ms` passes.
Wait WaitFor(int fd, short events, int wake_fd, int64_t deadline_ms) {
  for (;;) {
    const int64_t left = deadline_ms - NowMs();
    if (left <= 0) return Wait::kTimeout;
    pollfd fds[2] = {{fd, events, 0}, {wake_fd, POLLIN, 0}};
    const int n = poll(fds, 2, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Wait::kError;
    }
    if (n == 0) continue;  // the deadline check above decides
    if (fds[1].revents != 0) return Wait::kStop;
    if (fds[0].revents != 0) return Wait::kReady;  // errors surface in recv/send
  }
}

// Sends all of `data` before `deadline_ms`; false when the client is gone,
// too slow, or the exporter is stopping.
bool SendAll(int fd, std::string_view data, int wake_fd, int64_t deadline_ms) {
  while (!data.empty()) {
    const ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (WaitFor(fd, POLLOUT, wake_fd, deadline_ms) != Wait::kReady) return false;
      continue;
    }
    return false;
  }
  return true;
}

std::string HttpResponse(std::string_view status, std::string_view content_type,
                         std::string_view body, std::string_view extra_headers = "") {
  std::string out;
  out.reserve(160 + body.size());
  out.append("HTTP/1.0 ").append(status);
  out.append("\r\nContent-Type: ").append(content_type);
  out.append("\r\nContent-Length: ").append(std::to_string(body.size()));
  out.append("\r\n").append(extra_headers);
  out.append("Connection: close\r\n\r\n").append(body);
  return out;
}

std::string TextResponse(std::string_view status, std::string_view body,
                         std::string_view extra_headers = "") {
  return HttpResponse(status, "text/plain; charset=utf-8", body, extra_headers);
}

std::string_view StatusLine(int status) {
  switch (status) {
    case 200:
      return "200 OK";
    case 401:
      return "401 Unauthorized";
    case 403:
      return "403 Forbidden";
    case 404:
      return "404 Not Found";
    case 503:
      return "503 Service Unavailable";
    default:
      return "500 Internal Server Error";
  }
}

bool HasLineBreak(std::string_view s) { return s.find_first_of("\r\n") != std::string_view::npos; }

// Serialises what a handler answered; header lines that would split the
// response are dropped.
std::string HandlerResponse(const HttpExporter::Response& r) {
  std::string extra;
  for (const auto& [name, value] : r.headers) {
    if (name.empty() || HasLineBreak(name) || HasLineBreak(value) ||
        name.find(':') != std::string::npos) {
      Logger("metrics")->warn("metrics exporter: dropping a malformed response header");
      continue;
    }
    absl::StrAppend(&extra, name, ": ", value, "\r\n");
  }
  std::string_view content_type = r.content_type;
  if (content_type.empty() || HasLineBreak(content_type)) content_type = "text/plain";
  return HttpResponse(StatusLine(r.status), content_type, r.body, extra);
}

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

// Parses the header lines of a request head (everything after the request
// line, up to the blank line) into `*request`. False for a malformed head: a
// line without a colon or with an empty name, an obsolete folded line, a
// space before the colon, or a second Authorization header. The head was
// already bounded by Options::max_request_bytes, so this is linear in it.
bool ParseHeaders(std::string_view headers, HttpExporter::Request* request) {
  while (!headers.empty()) {
    const size_t eol = headers.find('\n');
    std::string_view line = headers.substr(0, eol);
    headers = eol == std::string_view::npos ? std::string_view() : headers.substr(eol + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) break;  // the blank line that ends the head
    if (line.front() == ' ' || line.front() == '\t') return false;  // obs-fold (RFC 9112 5.2)
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0) return false;
    const std::string_view name = line.substr(0, colon);
    if (name.find_first_of(" \t") != std::string_view::npos) return false;
    if (EqualsIgnoreCase(name, "authorization")) {
      if (request->authorization.has_value()) return false;
      request->authorization = std::string(TrimSpaces(line.substr(colon + 1)));
    }
  }
  return true;
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

}  // namespace

HttpExporter::Response HttpExporter::Response::Metrics(std::string body) {
  Response r;
  r.body = std::move(body);
  return r;
}

HttpExporter::Response HttpExporter::Response::Unauthorized(const std::string& realm) {
  Response r;
  r.status = 401;
  r.content_type = "text/plain; charset=utf-8";
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
  if (::listen(fd.get(), 64) != 0) {
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

  ScopedFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (wake.get() < 0) {
    return absl::UnavailableError(absl::StrCat("metrics exporter: eventfd: ", ErrnoText(errno)));
  }
  Options clamped = options;
  clamped.read_timeout_ms = std::max(clamped.read_timeout_ms, 1);
  clamped.write_timeout_ms = std::max(clamped.write_timeout_ms, 1);
  std::unique_ptr<HttpExporter> exporter(new HttpExporter(fd.release(), wake.release(), port,
                                                          absl::StrCat(host, ":", port),
                                                          std::move(handler), clamped));
  Logger("metrics")->debug("serving metrics on http://{}/metrics", exporter->address());
  return exporter;
}

HttpExporter::HttpExporter(int listen_fd, int wake_fd, int port, std::string address,
                           Handler handler, const Options& options)
    : listen_fd_(listen_fd),
      wake_fd_(wake_fd),
      port_(port),
      address_(std::move(address)),
      handler_(std::move(handler)),
      options_(options) {
  thread_ = std::thread([this] { Loop(); });
}

HttpExporter::~HttpExporter() {
  const uint64_t one = 1;
  while (write(wake_fd_, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
  close(wake_fd_);
}

void HttpExporter::Loop() {
  pthread_setname_np(pthread_self(), "opjit-metrics");
  LogLimiter limiter;
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    const int n = poll(fds, 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 || (fds[0].revents & (POLLERR | POLLNVAL)) != 0) {
      const int err = n < 0 ? errno : EIO;
      uint64_t suppressed = 0;
      if (limiter.Allow(&suppressed)) {
        Logger("metrics")->warn("metrics exporter: poll: {} ({} more suppressed)", ErrnoText(err),
                                suppressed);
      }
      if (WaitFor(wake_fd_, POLLIN, wake_fd_, NowMs() + kAcceptBackoffMs) != Wait::kTimeout) {
        return;
      }
      continue;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (conn < 0) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ECONNABORTED) continue;
      uint64_t suppressed = 0;
      if (limiter.Allow(&suppressed)) {
        Logger("metrics")->warn("metrics exporter: accept: {} ({} more suppressed)", ErrnoText(err),
                                suppressed);
      }
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        // Stop early if the destructor wakes us during the pause.
        if (WaitFor(wake_fd_, POLLIN, wake_fd_, NowMs() + kAcceptBackoffMs) != Wait::kTimeout) {
          return;
        }
      }
      continue;
    }
    HandleConnection(conn);
    close(conn);
  }
}

void HttpExporter::HandleConnection(int fd) {
  const size_t max_bytes = options_.max_request_bytes;
  const int64_t read_deadline = NowMs() + options_.read_timeout_ms;
  std::string request;
  size_t head_end = std::string::npos;
  char buf[4096];
  for (;;) {
    // A head ends with an empty line; bare "\n" line ends are tolerated.
    const size_t crlf = request.find("\r\n\r\n");
    const size_t lf = request.find("\n\n");
    if (crlf != std::string::npos) head_end = crlf + 4;
    if (lf != std::string::npos) head_end = std::min(head_end, lf + 2);
    if (head_end != std::string::npos || request.size() > max_bytes) break;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n > 0) {
      request.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) return;  // closed before the head was complete: nothing to answer
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return;
    if (WaitFor(fd, POLLIN, wake_fd_, read_deadline) != Wait::kReady) return;
  }

  std::string response;
  if (head_end == std::string::npos || head_end > max_bytes) {
    response = TextResponse("431 Request Header Fields Too Large", "request too large\n");
  } else {
    // Request line: METHOD SP TARGET SP HTTP/x.y
    std::string_view line(request.data(), request.find('\n'));
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const size_t sp1 = line.find(' ');
    const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
    const bool well_formed = sp1 != std::string_view::npos && sp1 > 0 &&
                             sp2 != std::string_view::npos && sp2 > sp1 + 1 &&
                             line.find(' ', sp2 + 1) == std::string_view::npos &&
                             line.substr(sp2 + 1).substr(0, 5) == "HTTP/";
    HttpExporter::Request parsed;
    const size_t line_end = request.find('\n') + 1;
    if (!well_formed ||
        !ParseHeaders(std::string_view(request).substr(line_end, head_end - line_end), &parsed)) {
      response = TextResponse("400 Bad Request", "bad request\n");
    } else {
      const std::string_view method = line.substr(0, sp1);
      std::string_view path = line.substr(sp1 + 1, sp2 - sp1 - 1);
      // Absolute form (a proxy's "http://host:port/metrics") names the same path.
      if (path.substr(0, 7) == "http://") {
        const size_t slash = path.find('/', 7);
        path = slash == std::string_view::npos ? std::string_view("/") : path.substr(slash);
      }
      path = path.substr(0, path.find_first_of("?#"));
      if (method != "GET") {
        response =
            TextResponse("405 Method Not Allowed", "only GET is supported\n", "Allow: GET\r\n");
      } else if (path == "/metrics") {
        response = HandlerResponse(handler_(parsed));
      } else if (path == "/") {
        response = TextResponse("200 OK", kIndexBody);
      } else {
        response = TextResponse("404 Not Found", "not found; metrics are at /metrics\n");
      }
    }
  }
  if (!SendAll(fd, response, wake_fd_, NowMs() + options_.write_timeout_ms)) return;
  shutdown(fd, SHUT_WR);
  // Read what the client already sent beyond the head, so closing does not
  // reset the connection (which could discard the response in flight).
  for (int i = 0; i < 16 && recv(fd, buf, sizeof(buf), 0) > 0; ++i) {
  }
}

}  // namespace opjit::metrics
