// A minimal HTTP server for Prometheus scrapes, on plain POSIX sockets.
//
//   auto exporter = HttpExporter::Start("127.0.0.1:9464",
//                                       [&registry] { return registry.Render(); });
//
// or, to decide per request (e.g. by its Authorization header):
//
//   HttpExporter::Start("127.0.0.1:9464", [&](const HttpExporter::Request& r) {
//     if (!Allowed(r.authorization)) return HttpExporter::Response::Unauthorized("opjit");
//     return HttpExporter::Response::Metrics(registry.Render());
//   });
//
// Serves:
//   GET /metrics  what the handler returns; the simple form always answers
//                 200, Content-Type "text/plain; version=0.0.4; charset=utf-8",
//                 the body render() returns
//   GET /         200, a short text pointing at /metrics
//   GET other     404
//   other method  405 (with "Allow: GET")
//   bad request   400 (also a header line without a colon, an obsolete
//                 folded line, or Authorization given twice); a request head
//                 over Options::max_request_bytes: 431
// The query string is ignored. Every response is HTTP/1.0-style: it carries
// Content-Length and "Connection: close", and the connection is closed after
// it (no keep-alive).
//
// One thread polls the listening socket and handles connections one at a time,
// each within Options::read_timeout_ms to receive the request head and
// Options::write_timeout_ms to send the response, so a slow or idle client
// delays other scrapes by at most that much and costs no extra thread. A
// request body, if any, is not read.
//
// Thread-safety: port() and address() may be called from any thread. The
// handler (or render()) runs on the exporter's thread, one call at a time.
// The destructor must not run concurrently with other calls.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace opjit::metrics {

class HttpExporter {
 public:
  // What the handler learns of a GET /metrics request.
  struct Request {
    // The value of the Authorization header (name matched case-insensitively,
    // surrounding spaces and tabs trimmed); nullopt when absent.
    std::optional<std::string> authorization;
  };

  // What the handler answers.
  struct Response {
    int status = 200;  // 200, 401, 403, 404, 500 or 503 (others are sent as 500)
    std::string content_type = "text/plain; version=0.0.4; charset=utf-8";
    std::string body;
    // Extra header lines, e.g. {"WWW-Authenticate", "Bearer realm=\"x\""}.
    // A name or value holding CR or LF is dropped (with a warning).
    std::vector<std::pair<std::string, std::string>> headers;

    // 200 with the Prometheus text format.
    static Response Metrics(std::string body);
    // 401 with `WWW-Authenticate: Bearer realm="<realm>"` and a short text
    // body that says nothing about why the credentials were refused.
    static Response Unauthorized(const std::string& realm);
  };

  using Handler = std::function<Response(const Request&)>;

  struct Options {
    // Time a connection has, from accept, to send its whole request head
    // (through the blank line). A connection that takes longer is closed
    // without a response. Default: 2000.
    int read_timeout_ms = 2000;
    // Time a response may take to send; a client that reads slower is cut
    // off. Default: 10000.
    int write_timeout_ms = 10000;
    // Bytes a request head may have; a larger one is answered 431.
    // Default: 8192.
    size_t max_request_bytes = 8192;
  };

  // Listens on `listen`, "host:port": host is an IPv4 address ("127.0.0.1",
  // "0.0.0.0" for every interface) or "localhost" (127.0.0.1); port is
  // 0..65535, 0 picks a free one. Starts the thread; `handler` answers every
  // GET /metrics and must be callable until the exporter is destroyed.
  // INVALID_ARGUMENT: `listen` is malformed (no port, empty or unknown host,
  //                   IPv6), or `handler` is empty.
  // UNAVAILABLE:      the socket cannot be created or bound (port in use,
  //                   address not local, permission denied).
  static absl::StatusOr<std::unique_ptr<HttpExporter>> Start(const std::string& listen,
                                                             Handler handler);
  static absl::StatusOr<std::unique_ptr<HttpExporter>> Start(const std::string& listen,
                                                             Handler handler,
                                                             const Options& options);
  // The simple form: every GET /metrics is answered 200 with render().
  static absl::StatusOr<std::unique_ptr<HttpExporter>> Start(const std::string& listen,
                                                             std::function<std::string()> render);
  static absl::StatusOr<std::unique_ptr<HttpExporter>> Start(const std::string& listen,
                                                             std::function<std::string()> render,
                                                             const Options& options);

  // Wakes the thread, waits for it (at most the end of the render() call in
  // progress; a connection being read or written is dropped at once), then
  // closes the sockets.
  ~HttpExporter();
  HttpExporter(const HttpExporter&) = delete;
  HttpExporter& operator=(const HttpExporter&) = delete;

  // The port actually bound (the one picked when Start was given port 0).
  int port() const { return port_; }
  // "host:port" actually bound, e.g. "127.0.0.1:41235".
  std::string address() const { return address_; }

 private:
  HttpExporter(int listen_fd, int wake_fd, int port, std::string address, Handler handler,
               const Options& options);

  void Loop();
  void HandleConnection(int fd);

  const int listen_fd_;
  const int wake_fd_;  // eventfd; written by the destructor to stop Loop()
  const int port_;
  const std::string address_;
  const Handler handler_;
  const Options options_;
  std::thread thread_;  // started last, in the constructor
};

}  // namespace opjit::metrics
