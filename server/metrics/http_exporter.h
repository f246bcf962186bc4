// A minimal HTTP server for Prometheus scrapes, on plain POSIX sockets.
//
//   auto exporter = HttpExporter::Start("127.0.0.1:9464",
//                                       [&registry] { return registry.Render(); });
//
// Serves:
//   GET /metrics  200, Content-Type "text/plain; version=0.0.4; charset=utf-8",
//                 the body render() returns
//   GET /         200, a short text pointing at /metrics
//   GET other     404
//   other method  405 (with "Allow: GET")
//   bad request   400; a request head over Options::max_request_bytes: 431
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
// Thread-safety: port() and address() may be called from any thread. render()
// runs on the exporter's thread, one call at a time. The destructor must not
// run concurrently with other calls.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace opjit::metrics {

class HttpExporter {
 public:
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
  // 0..65535, 0 picks a free one. Starts the thread; `render` must be callable
  // until the exporter is destroyed.
  // INVALID_ARGUMENT: `listen` is malformed (no port, empty or unknown host,
  //                   IPv6), or `render` is empty.
  // UNAVAILABLE:      the socket cannot be created or bound (port in use,
  //                   address not local, permission denied).
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
  HttpExporter(int listen_fd, int wake_fd, int port, std::string address,
               std::function<std::string()> render, const Options& options);

  void Loop();
  void HandleConnection(int fd);

  const int listen_fd_;
  const int wake_fd_;  // eventfd; written by the destructor to stop Loop()
  const int port_;
  const std::string address_;
  const std::function<std::string()> render_;
  const Options options_;
  std::thread thread_;  // started last, in the constructor
};

}  // namespace opjit::metrics
