// The HTTP endpoint Prometheus scrapes, served by GNU libmicrohttpd.
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
//   HEAD          as GET, without the body
//   other method  405 (with "Allow: GET, HEAD")
//   bad request   400 (also a header name that is empty or holds a space or
//                 tab, or Authorization given twice); a request head over
//                 Options::max_request_bytes: 431 (414 when the request line
//                 alone is too long to buffer)
// The query string is ignored. Every response carries Content-Length and
// "Connection: close", and the connection is closed after it (no
// keep-alive). An obsolete folded header line is not rejected, but it never
// yields an Authorization value. A request body, if any, is not read.
//
// Connections are served by Options::threads threads, each polling its own
// share (libmicrohttpd's thread pool), so an idle or slow client costs one
// connection slot and no thread: it delays nobody's scrape. Each connection
// has Options::read_timeout_ms from accept to send its whole request head and
// then Options::write_timeout_ms to take the response; past either it is
// closed. At most Options::max_connections are open at once (further ones
// wait in the listen queue) and at most Options::max_connections_per_address
// from one IPv4 address (further ones are closed at once).
//
// Thread-safety: port() and address() may be called from any thread. The
// handler (or render()) runs on one of the exporter's threads, one call at a
// time. The destructor must not run concurrently with other calls.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
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
    // (through the blank line), however it trickles in. A connection that
    // takes longer is closed without a response. Default: 2000.
    int read_timeout_ms = 2000;
    // Time a response may take to send, from the end of the head; a client
    // that reads slower is cut off. Default: 10000.
    int write_timeout_ms = 10000;
    // Bytes a request head may have; a larger one is answered 431. It also
    // sizes each connection's buffer (about twice this plus 8 KiB).
    // Default: 8192.
    size_t max_request_bytes = 8192;
    // Threads that serve connections (at least 1). Default: 4.
    int threads = 4;
    // Connections open at once (at least `threads`); more wait in the
    // listen queue until one closes. Default: 128.
    int max_connections = 128;
    // Connections open at once from one IPv4 address (0: no limit); more
    // are closed as soon as they are accepted. Default: 32.
    int max_connections_per_address = 32;
  };

  // Listens on `listen`, "host:port": host is an IPv4 address ("127.0.0.1",
  // "0.0.0.0" for every interface) or "localhost" (127.0.0.1); port is
  // 0..65535, 0 picks a free one. Starts the threads; `handler` answers every
  // GET /metrics and must be callable until the exporter is destroyed.
  // Options out of range are clamped (timeouts to at least 1 ms, threads to
  // 1..64, max_connections to at least threads).
  // INVALID_ARGUMENT: `listen` is malformed (no port, empty or unknown host,
  //                   IPv6), or `handler` is empty.
  // UNAVAILABLE:      the socket cannot be created or bound (port in use,
  //                   address not local, permission denied), or the HTTP
  //                   server cannot start (no threads, no memory).
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

  // Stops the threads, waiting at most for the end of the render() call in
  // progress (a connection being read or written is dropped at once), then
  // closes the sockets.
  ~HttpExporter();
  HttpExporter(const HttpExporter&) = delete;
  HttpExporter& operator=(const HttpExporter&) = delete;

  // The port actually bound (the one picked when Start was given port 0).
  int port() const { return port_; }
  // "host:port" actually bound, e.g. "127.0.0.1:41235".
  std::string address() const { return address_; }

 private:
  struct Server;  // libmicrohttpd's daemon and what its callbacks share

  HttpExporter(int port, std::string address, std::unique_ptr<Server> server);

  const int port_;
  const std::string address_;
  std::unique_ptr<Server> server_;
};

}  // namespace opjit::metrics
