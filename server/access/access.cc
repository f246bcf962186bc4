#include "server/access/access.h"

#include <unistd.h>

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/sha256.h"

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

AccessControl::AccessControl(AccessOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<AccessControl>> AccessControl::Create(AccessOptions options) {
  std::unique_ptr<AccessControl> ac(new AccessControl(std::move(options)));
  std::set<std::string> names;
  absl::MutexLock lock(&ac->mu_);
  ac->namespaces_.insert("default");
  for (const PrincipalConfig& c : ac->options_.principals) {
    const std::string where = absl::StrCat("principal \"", c.name, "\": ");
    if (!ValidName(c.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("principal name \"", c.name, "\" must match [A-Za-z0-9_.@-]{1,64}"));
    }
    if (!names.insert(c.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, "defined twice"));
    }
    if (c.role == Role::kMetrics && !c.namespaces.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "a metrics principal scrapes every namespace's series and has no namespaces"));
    }
    if (c.role != Role::kAdmin && c.role != Role::kMetrics && c.namespaces.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, "a ", RoleName(c.role),
                                                     " needs at least one namespace"));
    }
    for (const std::string& ns : c.namespaces) ac->namespaces_.insert(ns);
    for (const std::string& h : c.token_sha256) {
      if (!ValidHexSha256(h)) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, "token_sha256 entries are 64 lowercase hex digits (opjit token prints one)"));
      }
      if (!ac->by_token_.emplace(h, &c).second) {
        return absl::InvalidArgumentError(absl::StrCat(where, "a token is given to two principals"));
      }
    }
    for (uint32_t uid : c.uids) {
      if (!ac->by_uid_.emplace(uid, &c).second) {
        return absl::InvalidArgumentError(absl::StrCat(where, "uid ", uid, " is mapped twice"));
      }
    }
    for (uint32_t gid : c.gids) {
      if (!ac->by_gid_.emplace(gid, &c).second) {
        return absl::InvalidArgumentError(absl::StrCat(where, "gid ", gid, " is mapped twice"));
      }
    }
  }
  return ac;
}

absl::StatusOr<std::shared_ptr<const Principal>> AccessControl::Authenticate(
    const PeerInfo& peer) const {
  if (peer.transport == PeerInfo::Transport::kInProcess) return LocalAdmin(std::nullopt);
  if (peer.authorization.has_value()) {
    std::optional<std::string> token = BearerToken(*peer.authorization);
    if (!token) {
      return Unauthenticated("the authorization metadata must be \"Bearer <token>\"");
    }
    auto it = by_token_.find(Sha256Hex(*token));
    if (it == by_token_.end()) return Unauthenticated("the bearer token is not valid");
    return FromConfig(*it->second, peer.uid);
  }
  if (peer.transport == PeerInfo::Transport::kUnix) {
    if (!peer.uid.has_value()) return Unauthenticated("the unix peer's credentials are unknown");
    if (!enabled() || *peer.uid == options_.daemon_uid || *peer.uid == 0) {
      return LocalAdmin(peer.uid);
    }
    if (auto it = by_uid_.find(*peer.uid); it != by_uid_.end()) {
      return FromConfig(*it->second, peer.uid);
    }
    if (peer.gid.has_value()) {
      if (auto it = by_gid_.find(*peer.gid); it != by_gid_.end()) {
        return FromConfig(*it->second, peer.uid);
      }
    }
    return Unauthenticated(absl::StrCat("uid ", *peer.uid,
                                        " is not mapped to a principal; ask the operator, or "
                                        "send \"authorization: Bearer <token>\""));
  }
  // TCP without a token: only the embedded default on loopback (or on an
  // address the operator opened with allow_insecure_tcp).
  if (!enabled()) return LocalAdmin(std::nullopt);
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
    return WithReason(absl::NotFoundError(absl::StrCat("namespace '", ns, "' not found")),
                      reason::kNamespaceNotFound, {{"namespace", ns}});
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
                                                 ActionName(action), " in namespace '", ns, "'")),
        reason::kPermissionDenied,
        {{"role", RoleName(principal.role)}, {"action", ActionName(action)}});
  }
  if (action == Action::kDescribe) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (namespaces_.count(ns)) return absl::OkStatus();
  if (namespaces_.size() >= options_.max_namespaces) {
    return QuotaExceeded("namespaces", absl::StrCat(options_.max_namespaces), "",
                         absl::StrCat("the server already has that many namespaces; namespace '",
                                      ns, "' cannot be created"));
  }
  namespaces_.insert(ns);
  Logger("access")->info("namespace '{}' created by {}", ns, principal.name);
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
