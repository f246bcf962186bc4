#include "server/runner/memory_cgroups.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/common/paths.h"
#include "server/common/sha256.h"

namespace opjit::runner {
namespace {

constexpr char kRoot[] = "/sys/fs/cgroup";

// Writes `text` to a cgroup file; the errno text on failure.
absl::Status WriteText(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return absl::InternalError(absl::StrCat("open: ", std::strerror(errno)));
  const ssize_t n = ::write(fd, text.data(), text.size());
  const int err = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(text.size())) {
    return absl::InternalError(absl::StrCat("write: ", std::strerror(err)));
  }
  return absl::OkStatus();
}

bool MakeDir(const std::string& path) { return ::mkdir(path.c_str(), 0755) == 0 || errno == EEXIST; }

// This process's cgroup path in the hierarchy whose controller list holds
// `controller` ("" for the cgroup v2 line "0::/path"); "" if none.
std::string OwnPath(const std::string& controller) {
  const std::string text = ReadSmallFile("/proc/self/cgroup");
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string list = line.substr(a + 1, b - a - 1);
    bool match = controller.empty() ? list.empty() : false;
    for (size_t p = 0; !controller.empty() && p <= list.size();) {
      size_t q = list.find(',', p);
      if (q == std::string::npos) q = list.size();
      if (list.compare(p, q - p, controller) == 0) match = true;
      p = q + 1;
    }
    if (match) return line.substr(b + 1);
  }
  return "";
}

// The "name N" counter of a flat-keyed cgroup file; 0 if absent.
uint64_t Counter(const std::string& text, const std::string& name) {
  size_t p = 0;
  while ((p = text.find(name + " ", p)) != std::string::npos) {
    if (p == 0 || text[p - 1] == '\n') return std::strtoull(text.c_str() + p + name.size() + 1, nullptr, 10);
    p += name.size();
  }
  return 0;
}

// Removes the empty "ns-*" cgroups under `dir` (a killed predecessor's).
void RemoveLeftovers(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    if (std::strncmp(e->d_name, "ns-", 3) == 0) names.push_back(e->d_name);
  }
  ::closedir(d);
  for (const auto& n : names) ::rmdir((dir + "/" + n).c_str());
}

}  // namespace

std::unique_ptr<MemoryCgroups> MemoryCgroups::Open(const std::string& tag, uint64_t bytes) {
  if (bytes == 0) return nullptr;
  // cgroup v2, delegated: the daemon's own cgroup is writable and offers
  // the memory controller.
  if (::access((std::string(kRoot) + "/cgroup.controllers").c_str(), F_OK) == 0) {
    const std::string base = std::string(kRoot) + OwnPath("");
    const std::string controllers = ReadSmallFile(base + "/cgroup.controllers");
    if (controllers.find("memory") != std::string::npos && ::access(base.c_str(), W_OK) == 0) {
      // A cgroup with children holds no process: the daemon moves to a
      // leaf of its own first.
      const std::string leaf = base + "/opjitd";
      if (MakeDir(leaf) && WriteText(leaf + "/cgroup.procs", std::to_string(::getpid())).ok() &&
          WriteText(base + "/cgroup.subtree_control", "+memory").ok()) {
        RemoveLeftovers(base);
        return std::unique_ptr<MemoryCgroups>(new MemoryCgroups("cgroup2", base, bytes));
      }
    }
    return nullptr;
  }
  // cgroup v1's memory hierarchy (a hybrid host), where this process may
  // create cgroups (root).
  const std::string root = std::string(kRoot) + "/memory";
  if (::access((root + "/memory.limit_in_bytes").c_str(), F_OK) != 0) return nullptr;
  std::string base = root + OwnPath("memory");
  if (::access(base.c_str(), F_OK) != 0) base = root;  // a cgroup namespace shows its root only
  const std::string dir = base + "/opjit-" + tag;
  if (::access(base.c_str(), W_OK) != 0 || !MakeDir(dir)) return nullptr;
  RemoveLeftovers(dir);
  return std::unique_ptr<MemoryCgroups>(new MemoryCgroups("cgroup1", dir, bytes));
}

MemoryCgroups::~MemoryCgroups() {
  MutexLock lock(&mu_);
  // Empty once their executors are gone; one still ending stays, and the
  // next daemon on this state dir removes it.
  for (const auto& [ns, path] : made_) ::rmdir(path.c_str());
  if (mode_ == "cgroup1") ::rmdir(dir_.c_str());
}

std::string MemoryCgroups::PathOf(const std::string& ns) const {
  return absl::StrCat(dir_, "/ns-", Sha256Hex(ns).substr(0, 16));
}

absl::Status MemoryCgroups::Place(const std::string& ns, pid_t pid) {
  std::string path;
  {
    MutexLock lock(&mu_);
    auto it = made_.find(ns);
    if (it == made_.end()) {
      path = PathOf(ns);
      if (!MakeDir(path)) {
        return absl::InternalError(absl::StrCat("memory cgroup: mkdir: ", std::strerror(errno)));
      }
      const std::string cap = std::to_string(bytes_);
      absl::Status s = mode_ == "cgroup2" ? WriteText(path + "/memory.max", cap)
                                          : WriteText(path + "/memory.limit_in_bytes", cap);
      if (!s.ok()) {
        ::rmdir(path.c_str());
        return absl::InternalError(absl::StrCat("memory cgroup: limit: ", s.message()));
      }
      if (mode_ == "cgroup2") (void)WriteText(path + "/memory.swap.max", "0");  // absent without swap
      if (tasks_ != 0) {
        if (absl::Status t = WriteText(path + "/pids.max", std::to_string(tasks_)); !t.ok()) {
          ::rmdir(path.c_str());
          return absl::InternalError(absl::StrCat("pids cgroup: limit: ", t.message()));
        }
      }
      made_.emplace(ns, path);
    } else {
      path = it->second;
    }
  }
  if (absl::Status s = WriteText(path + "/cgroup.procs", std::to_string(pid)); !s.ok()) {
    return absl::InternalError(absl::StrCat("memory cgroup: move: ", s.message()));
  }
  return absl::OkStatus();
}

bool MemoryCgroups::CapTasks(uint64_t tasks) {
  if (mode_ != "cgroup2" || tasks == 0) return false;
  // The pids controller, where the daemon's cgroup offers it (a unit with
  // Delegate=memory pids), for the namespaces' cgroups too.
  if (ReadSmallFile(dir_ + "/cgroup.controllers").find("pids") == std::string::npos ||
      !WriteText(dir_ + "/cgroup.subtree_control", "+pids").ok()) {
    return false;
  }
  MutexLock lock(&mu_);
  tasks_ = tasks;
  return true;
}

uint64_t MemoryCgroups::OomKills(const std::string& ns) {
  std::string path;
  {
    MutexLock lock(&mu_);
    auto it = made_.find(ns);
    if (it == made_.end()) return 0;
    path = it->second;
  }
  return Counter(ReadSmallFile(path + (mode_ == "cgroup2" ? "/memory.events" : "/memory.oom_control")),
                 "oom_kill");
}

}  // namespace opjit::runner
