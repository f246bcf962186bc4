#include "server/common/paths.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <system_error>

namespace opjit {

std::string DefaultStateDir() {
  if (const char* s = std::getenv("OPJIT_STATE_DIR"); s != nullptr && *s) return s;
  if (const char* h = std::getenv("HOME"); h != nullptr && *h) return std::string(h) + "/.opjit";
  return "/tmp/opjit-" + std::to_string(getuid());
}

std::string DefaultSocketAddress(const std::string& state_dir) {
  return "unix:" + state_dir + "/opjitd.sock";
}

std::string DefaultServerAddress() {
  if (const char* s = std::getenv("OPJIT_SERVER"); s != nullptr && *s) return s;
  const std::string own = DefaultStateDir() + "/opjitd.sock";
  // The system daemon (deploy/systemd) when the user runs none of their own.
  const char* state = std::getenv("OPJIT_STATE_DIR");
  if ((state == nullptr || *state == '\0') && ::access(own.c_str(), F_OK) != 0 &&
      ::access(kSystemSocket, F_OK) == 0) {
    return std::string("unix:") + kSystemSocket;
  }
  return "unix:" + own;
}

std::string FindHelperDir(const std::string& exe_dir) {
  const std::filesystem::path libexec =
      std::filesystem::path(exe_dir) / ".." / "libexec" / "opjit";
  if (::access((libexec / "opjit-compile-worker").c_str(), X_OK) == 0) {
    std::error_code ec;
    std::filesystem::path canonical = std::filesystem::canonical(libexec, ec);
    return ec ? libexec.string() : canonical.string();
  }
  return exe_dir;
}

std::string ReadSmallFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > (1u << 20)) break;  // no /proc or cgroup file this tool reads is that long
  }
  ::close(fd);
  return out;
}

}  // namespace opjit
