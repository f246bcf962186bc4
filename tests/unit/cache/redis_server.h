// A throwaway redis-server for tests: a free loopback port (or a unix socket)
// in a temp dir, no persistence, killed on destruction. Shared by the cache and
// compiler unit tests.
#pragma once

#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace opjit::cache::testing {

inline constexpr char kRedisServer[] = "/usr/bin/redis-server";

inline bool HaveRedisServer() { return ::access(kRedisServer, X_OK) == 0; }

// A loopback TCP port nothing listens on right now.
inline int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

class RedisServer {
 public:
  // `dir`: an existing empty directory for its log (and socket).
  // `unix_socket`: listen on <dir>/redis.sock instead of TCP.
  explicit RedisServer(std::string dir, bool unix_socket = false)
      : dir_(std::move(dir)), unix_(unix_socket) {
    port_ = unix_ ? 0 : FreePort();
  }
  ~RedisServer() {
    if (pid_ > 0) {
      ::kill(pid_, SIGCONT);
      Kill();
    }
  }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  // Starts it (again, on the same port) and waits until it answers PING.
  ::testing::AssertionResult Start() {
    std::vector<std::string> args = {kRedisServer, "--port", std::to_string(port_),
                                     "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                     "--dir", dir_, "--logfile", dir_ + "/redis.log"};
    if (unix_) {
      args.insert(args.end(), {"--unixsocket", socket_path(), "--unixsocketperm", "700"});
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    // fork + exec rather than posix_spawn: the child dies with the test even
    // when the test crashes (only async-signal-safe calls in the child).
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::execv(kRedisServer, argv.data());
      ::_exit(127);
    }
    if (pid_ < 0) return ::testing::AssertionFailure() << "cannot fork for redis-server";
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      redisContext* c = Connect();
      if (c != nullptr) {
        auto* r = static_cast<redisReply*>(redisCommand(c, "PING"));
        const bool up = r != nullptr && r->type == REDIS_REPLY_STATUS;
        if (r != nullptr) freeReplyObject(r);
        redisFree(c);
        if (up) return ::testing::AssertionSuccess();
      }
      int status;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return ::testing::AssertionFailure() << "redis-server exited; see " << dir_ << "/redis.log";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return ::testing::AssertionFailure() << "redis-server did not answer within 10 s";
  }

  // SIGKILL, and reaps it.
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  // Freezes it (connections stay open, nothing answers) or thaws it.
  void Stop() { ::kill(pid_, SIGSTOP); }
  void Continue() { ::kill(pid_, SIGCONT); }

  std::string url() const {
    return unix_ ? "unix:" + socket_path() : "redis://127.0.0.1:" + std::to_string(port_);
  }
  std::string socket_path() const { return dir_ + "/redis.sock"; }

  // A direct connection, for tampering with entries; nullptr if none.
  redisContext* Connect() const {
    timeval tv{1, 0};
    redisContext* c = unix_ ? redisConnectUnixWithTimeout(socket_path().c_str(), tv)
                            : redisConnectWithTimeout("127.0.0.1", port_, tv);
    if (c != nullptr && c->err != 0) {
      redisFree(c);
      return nullptr;
    }
    return c;
  }

  // GET `key`: true and the value if it is a string.
  bool RawGet(const std::string& key, std::string* value) const {
    redisContext* c = Connect();
    if (c == nullptr) return false;
    auto* r = static_cast<redisReply*>(redisCommand(c, "GET %b", key.data(), key.size()));
    const bool ok = r != nullptr && r->type == REDIS_REPLY_STRING;
    if (ok) value->assign(r->str, r->len);
    if (r != nullptr) freeReplyObject(r);
    redisFree(c);
    return ok;
  }
  // SET `key` `value` (no expiry).
  bool RawSet(const std::string& key, const std::string& value) const {
    redisContext* c = Connect();
    if (c == nullptr) return false;
    auto* r = static_cast<redisReply*>(
        redisCommand(c, "SET %b %b", key.data(), key.size(), value.data(), value.size()));
    const bool ok = r != nullptr && r->type == REDIS_REPLY_STATUS;
    if (r != nullptr) freeReplyObject(r);
    redisFree(c);
    return ok;
  }
  // An integer command's answer (TTL, EXISTS, DBSIZE, ...) or -100 on failure.
  long long RawInt(const std::string& command, const std::string& key = "") const {
    redisContext* c = Connect();
    if (c == nullptr) return -100;
    auto* r = static_cast<redisReply*>(
        key.empty() ? redisCommand(c, command.c_str())
                    : redisCommand(c, "%s %b", command.c_str(), key.data(), key.size()));
    const long long v = r != nullptr && r->type == REDIS_REPLY_INTEGER ? r->integer : -100;
    if (r != nullptr) freeReplyObject(r);
    redisFree(c);
    return v;
  }
  // Every key matching `pattern`.
  std::vector<std::string> Keys(const std::string& pattern) const {
    std::vector<std::string> out;
    redisContext* c = Connect();
    if (c == nullptr) return out;
    auto* r = static_cast<redisReply*>(
        redisCommand(c, "KEYS %b", pattern.data(), pattern.size()));
    if (r != nullptr && r->type == REDIS_REPLY_ARRAY) {
      for (size_t i = 0; i < r->elements; ++i) {
        out.emplace_back(r->element[i]->str, r->element[i]->len);
      }
    }
    if (r != nullptr) freeReplyObject(r);
    redisFree(c);
    return out;
  }

 private:
  std::string dir_;
  bool unix_;
  int port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace opjit::cache::testing
