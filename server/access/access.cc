#include "server/access/access.h"

#include <unistd.h>

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/sha256.h"
#include "server/common/text.h"

namespace opjit::access {
namespace {

bool ValidName(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s) {
    if (!(absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-' ||
          c == '@')) {
      return false;
    }
  }
  return true;
}

bool ValidHexSha256(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

absl::Status Unauthenticated(const std::string& why) {
  return WithReason(absl::UnauthenticatedError(why), reason::kUnauthenticated);
}

std::shared_ptr<const Principal> FromConfig(const PrincipalConfig& c, std::optional<uid_t> uid) {
  auto p = std::make_shared<Principal>();
  p->name = c.name;
  p->role = c.role;
  if (c.role != Role::kAdmin) p->namespaces.insert(c.namespaces.begin(), c.namespaces.end());
  p->uid = uid;
  return p;
}

std::shared_ptr<const Principal> LocalAdmin(std::optional<uid_t> uid) {
  auto p = std::make_shared<Principal>();
  p->name = "local";
  p->role = Role::kAdmin;
  p->uid = uid;
  return p;
}

}  // namespace

const char* RoleName(Role role) {
  switch (role) {
    case Role::kReader:
      return "reader";
    case Role::kUser:
      return "user";
    case Role::kAdmin:
      return "admin";
    case Role::kMetrics:
      return "metrics";
  }
  return "?";
}

std::optional<Role> ParseRole(const std::string& name) {
  if (name == "reader") return Role::kReader;
  if (name == "user") return Role::kUser;
  if (name == "admin") return Role::kAdmin;
  if (name == "metrics") return Role::kMetrics;
  return std::nullopt;
}

const char* ActionName(Action action) {
  switch (action) {
    case Action::kDescribe:
      return "describe";
    case Action::kCall:
      return "call";
    case Action::kWrite:
      return "write";
    case Action::kAdmin:
      return "admin";
  }
  return "?";
}

std::optional<std::string> BearerToken(const std::string& authorization) {
  constexpr absl::string_view kPrefix = "Bearer ";
  if (authorization.size() <= kPrefix.size() ||
      !absl::EqualsIgnoreCase(authorization.substr(0, kPrefix.size()), kPrefix)) {
    return std::nullopt;
  }
  std::string token = authorization.substr(kPrefix.size());
  while (!token.empty() && token.front() == ' ') token.erase(token.begin());
  if (token.empty()) return std::nullopt;
  return token;
}

std::vector<std::pair<size_t, std::string>> PrincipalProblems(
    const std::vector<PrincipalConfig>& principals) {
  std::vector<std::pair<size_t, std::string>> problems;
  std::set<std::string> names, tokens;
  std::set<uint32_t> uids, gids;
  for (size_t i = 0; i < principals.size(); ++i) {
    const PrincipalConfig& c = principals[i];
    auto problem = [&](const std::string& why) { problems.emplace_back(i, why); };
    const std::string where = absl::StrCat("principal \"", c.name, "\": ");
    if (!ValidName(c.name)) {
      problem(absl::StrCat("principal name \"", c.name, "\" must match [A-Za-z0-9_.@-]{1,64}"));
    } else if (!names.insert(c.name).second) {
      problem(absl::StrCat(where, "defined twice"));
    }
    if (c.role == Role::kMetrics && !c.namespaces.empty()) {
      problem(absl::StrCat(
          where, "a metrics principal scrapes every namespace's series and has no namespaces"));
    }
    if (c.role != Role::kAdmin && c.role != Role::kMetrics && c.namespaces.empty()) {
      problem(absl::StrCat(where, "a ", RoleName(c.role), " needs at least one namespace"));
    }
    for (const std::string& h : c.token_sha256) {
      if (!ValidHexSha256(h)) {
        problem(absl::StrCat(
            where, "token_sha256 entries are 64 lowercase hex digits (opjit token prints one)"));
      } else if (!tokens.insert(h).second) {
        problem(absl::StrCat(where, "a token is given to two principals"));
      }
    }
    for (uint32_t uid : c.uids) {
      if (!uids.insert(uid).second) problem(absl::StrCat(where, "uid ", uid, " is mapped twice"));
    }
    for (uint32_t gid : c.gids) {
      if (!gids.insert(gid).second) problem(absl::StrCat(where, "gid ", gid, " is mapped twice"));
    }
  }
  return problems;
}

AccessControl::AccessControl(AccessOptions options)
    : daemon_uid_(options.daemon_uid), max_namespaces_(options.max_namespaces) {}

absl::StatusOr<std::shared_ptr<const AccessControl::Table>> AccessControl::BuildTable(
    std::vector<PrincipalConfig> principals) {
  if (auto problems = PrincipalProblems(principals); !problems.empty()) {
    return absl::InvalidArgumentError(problems.front().second);
  }
  auto t = std::make_shared<Table>();
  t->principals = std::move(principals);
  // The vector is not resized from here on: the maps point into it.
  for (const PrincipalConfig& c : t->principals) {
    for (const std::string& h : c.token_sha256) t->by_token.emplace(h, &c);
    for (uint32_t uid : c.uids) t->by_uid.emplace(uid, &c);
    for (uint32_t gid : c.gids) t->by_gid.emplace(gid, &c);
  }
  return std::shared_ptr<const Table>(std::move(t));
}

absl::StatusOr<std::unique_ptr<AccessControl>> AccessControl::Create(AccessOptions options) {
  auto table = BuildTable(options.principals);
  if (!table.ok()) return table.status();
  std::unique_ptr<AccessControl> ac(new AccessControl(std::move(options)));
  {
    absl::MutexLock lock(&ac->table_mu_);
    ac->table_ = *std::move(table);
  }
  absl::MutexLock lock(&ac->mu_);
  ac->namespaces_.insert("default");
  for (const PrincipalConfig& c : ac->table()->principals) {
    ac->namespaces_.insert(c.namespaces.begin(), c.namespaces.end());
  }
  return ac;
}

std::shared_ptr<const AccessControl::Table> AccessControl::table() const {
  absl::ReaderMutexLock lock(&table_mu_);
  return table_;
}

bool AccessControl::enabled() const { return !table()->principals.empty(); }

absl::Status AccessControl::SetPrincipals(std::vector<PrincipalConfig> principals) {
  auto next = BuildTable(std::move(principals));
  if (!next.ok()) return next.status();
  {
    absl::MutexLock lock(&table_mu_);
    if (table_->principals.empty() != (*next)->principals.empty()) {
      return absl::FailedPreconditionError(
          "switching between no principals (every local caller is admin) and principals "
          "needs a restart");
    }
    table_ = *next;
  }
  absl::MutexLock lock(&mu_);
  for (const PrincipalConfig& c : (*next)->principals) {
    namespaces_.insert(c.namespaces.begin(), c.namespaces.end());
  }
  return absl::OkStatus();
}

void AccessControl::SetMaxNamespaces(size_t max_namespaces) {
  absl::MutexLock lock(&mu_);
  max_namespaces_ = max_namespaces;
}

absl::StatusOr<std::shared_ptr<const Principal>> AccessControl::Authenticate(
    const PeerInfo& peer) const {
  if (peer.transport == PeerInfo::Transport::kInProcess) return LocalAdmin(std::nullopt);
  const std::shared_ptr<const Table> t = table();
  const bool enabled = !t->principals.empty();
  if (peer.authorization.has_value()) {
    std::optional<std::string> token = BearerToken(*peer.authorization);
    if (!token) {
      return Unauthenticated("the authorization metadata must be \"Bearer <token>\"");
    }
    auto it = t->by_token.find(Sha256Hex(*token));
    if (it == t->by_token.end()) return Unauthenticated("the bearer token is not valid");
    return FromConfig(*it->second, peer.uid);
  }
  if (peer.transport == PeerInfo::Transport::kUnix) {
    if (!peer.uid.has_value()) return Unauthenticated("the unix peer's credentials are unknown");
    if (!enabled || *peer.uid == daemon_uid_ || *peer.uid == 0) {
      return LocalAdmin(peer.uid);
    }
    if (auto it = t->by_uid.find(*peer.uid); it != t->by_uid.end()) {
      return FromConfig(*it->second, peer.uid);
    }
    if (peer.gid.has_value()) {
      if (auto it = t->by_gid.find(*peer.gid); it != t->by_gid.end()) {
        return FromConfig(*it->second, peer.uid);
      }
    }
    return Unauthenticated(absl::StrCat("uid ", *peer.uid,
                                        " is not mapped to a principal; ask the operator, or "
                                        "send \"authorization: Bearer <token>\""));
  }
  // TCP without a token: only the embedded default on loopback (or on an
  // address the operator opened with allow_insecure_tcp).
  if (!enabled) return LocalAdmin(std::nullopt);
  return Unauthenticated(
      "this server requires \"authorization: Bearer <token>\" metadata on TCP");
}

absl::Status AccessControl::Check(const Principal& principal, const std::string& ns,
                                  Action action) {
  // Server-wide operations name no real namespace: the role decides alone.
  if (action == Action::kAdmin && !principal.admin()) {
    return WithReason(absl::PermissionDeniedError(absl::StrCat(
                          "role ", RoleName(principal.role), " may not do this: admins only")),
                      reason::kPermissionDenied,
                      {{"role", RoleName(principal.role)}, {"action", ActionName(action)}});
  }
  if (!principal.Sees(ns)) {
    return WithReason(absl::NotFoundError(absl::StrCat("namespace '", Excerpt(ns), "' not found")),
                      reason::kNamespaceNotFound, {{"namespace", Excerpt(ns)}});
  }
  bool allowed = false;
  switch (principal.role) {
    case Role::kAdmin:
      allowed = true;
      break;
    case Role::kUser:
      allowed = action != Action::kAdmin;
      break;
    case Role::kReader:
      allowed = action == Action::kDescribe || action == Action::kCall;
      break;
    case Role::kMetrics:
      allowed = false;  // it sees no namespace: refused above already
      break;
  }
  if (!allowed) {
    return WithReason(
        absl::PermissionDeniedError(absl::StrCat("role ", RoleName(principal.role), " may not ",
                                                 ActionName(action), " in namespace '",
                                                 Excerpt(ns), "'")),
        reason::kPermissionDenied,
        {{"role", RoleName(principal.role)}, {"action", ActionName(action)}});
  }
  if (action == Action::kDescribe) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (namespaces_.count(ns)) return absl::OkStatus();
  if (namespaces_.size() >= max_namespaces_) {
    return QuotaExceeded("namespaces", absl::StrCat(max_namespaces_), "",
                         absl::StrCat("the server already has that many namespaces; namespace '",
                                      Excerpt(ns), "' cannot be created"));
  }
  namespaces_.insert(ns);
  Logger("access")->info("namespace '{}' created by {}", Excerpt(ns), principal.name);
  return absl::OkStatus();
}

void AccessControl::AddExisting(const std::vector<std::string>& namespaces) {
  absl::MutexLock lock(&mu_);
  namespaces_.insert(namespaces.begin(), namespaces.end());
}

size_t AccessControl::namespace_count() const {
  absl::MutexLock lock(&mu_);
  return namespaces_.size();
}

}  // namespace opjit::access
