#include "server/common/subordinate_ids.h"

#include <pwd.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace opjit::subordinate {

std::optional<Range> Find(const std::string& text, const std::string& name, uint32_t id) {
  const std::string id_text = std::to_string(id);
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    std::vector<absl::string_view> f = absl::StrSplit(line, ':');
    if (f.size() != 3) continue;
    if (!(f[0] == id_text || (!name.empty() && f[0] == name))) continue;
    uint64_t first = 0, count = 0;
    if (!absl::SimpleAtoi(f[1], &first) || !absl::SimpleAtoi(f[2], &count) || count == 0 ||
        first + count > (uint64_t{1} << 32) - 1) {
      return std::nullopt;
    }
    return Range{static_cast<uint32_t>(first), static_cast<uint32_t>(count)};
  }
  return std::nullopt;
}

namespace {

std::string ReadText(const char* path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

std::optional<Ids> ForThisUser() {
  if (::access("/usr/bin/newuidmap", X_OK) != 0 || ::access("/usr/bin/newgidmap", X_OK) != 0) {
    return std::nullopt;
  }
  const uid_t uid = ::geteuid();
  std::string name;
  passwd pw{};
  passwd* found = nullptr;
  char buf[4096];
  if (::getpwuid_r(uid, &pw, buf, sizeof(buf), &found) == 0 && found != nullptr) {
    name = found->pw_name;
  }
  std::optional<Range> uids = Find(ReadText("/etc/subuid"), name, uid);
  std::optional<Range> gids = Find(ReadText("/etc/subgid"), name, uid);
  if (!uids || !gids) return std::nullopt;
  return Ids{*uids, *gids};
}

}  // namespace opjit::subordinate
