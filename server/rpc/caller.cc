#include "server/rpc/caller.h"

#include <sys/socket.h>

#include <cstdlib>
#include <string_view>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/text.h"
#include "server/registry/validate.h"
#include "server/rpc/services.h"

namespace opjit::rpc {
namespace {

bool LoopbackPeer(absl::string_view peer) {
  if (absl::StartsWith(peer, "ipv4:127.")) return true;
  if (absl::StartsWith(peer, "ipv6:[::1]")) return true;
  if (absl::StartsWith(peer, "ipv6:[::ffff:127.")) return true;
  return false;
}

}  // namespace

access::PeerInfo PeerOf(const grpc::CallbackServerContext& ctx) {
  access::PeerInfo p;
  const std::string peer = ctx.peer();
  if (absl::StartsWith(peer, "fd:")) {
    p.transport = access::PeerInfo::Transport::kUnix;
    char* end = nullptr;
    const long fd = std::strtol(peer.c_str() + 3, &end, 10);
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (end != nullptr && *end == '\0' && fd >= 0 &&
        getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 &&
        len == sizeof(cred) && cred.pid > 0) {
      p.uid = cred.uid;
      p.gid = cred.gid;
      p.pid = cred.pid;
    }
  } else if (absl::StartsWith(peer, "unix:")) {
    p.transport = access::PeerInfo::Transport::kUnix;  // no credentials known
  } else {
    p.transport = access::PeerInfo::Transport::kTcp;
    p.loopback = LoopbackPeer(peer);
  }
  if (auto auth = ctx.auth_context(); auth != nullptr) {
    for (const auto& v : auth->FindPropertyValues("transport_security_type")) {
      if (std::string_view(v.data(), v.size()) == "ssl") p.tls = true;
    }
  }
  const auto& md = ctx.client_metadata();
  if (auto it = md.find("authorization"); it != md.end()) {
    p.authorization = std::string(it->second.data(), it->second.size());
  }
  return p;
}

absl::StatusOr<std::shared_ptr<const access::Principal>> Authenticate(
    const CoreRefs& core, const grpc::CallbackServerContext& ctx) {
  if (core.access == nullptr) {
    auto p = std::make_shared<access::Principal>();
    p->name = "local";
    p->role = access::Role::kAdmin;
    return std::shared_ptr<const access::Principal>(std::move(p));
  }
  return core.access->Authenticate(PeerOf(ctx));
}

absl::StatusOr<std::shared_ptr<const access::Principal>> Admit(
    const CoreRefs& core, const grpc::CallbackServerContext& ctx, const std::string& ns,
    access::Action action) {
  auto p = Authenticate(core, ctx);
  if (!p.ok() || core.access == nullptr) return p;
  // A name no namespace can have is refused before access control records
  // it: a caller could otherwise fill the namespace table with 100 KB names.
  if (!ns.empty() && !registry::IsValidNamespace(ns)) {
    const std::string why = absl::StrCat("namespace '", Excerpt(ns),
                                         "' is not a valid name (names match [a-z0-9_-]{1,64})");
    if (action == access::Action::kWrite) {
      return WithReason(absl::InvalidArgumentError(why), reason::kInvalidSpec);
    }
    return WithReason(absl::NotFoundError(why), reason::kNamespaceNotFound);
  }
  if (absl::Status s = core.access->Check(**p, ns, action); !s.ok()) return s;
  return p;
}

std::string RegionOwner(const access::Principal& p, const std::string& client_id) {
  return absl::StrCat(p.name, "/", client_id);
}

std::string ClientIdOf(const std::string& owner) {
  const size_t slash = owner.find('/');
  return slash == std::string::npos ? owner : owner.substr(slash + 1);
}

std::string RegionScope(const access::Principal& p) { return p.admin() ? "" : p.name; }

runner::Caller QuarantineCaller(const access::Principal& p) {
  return {p.name, p.role == access::Role::kReader};
}

}  // namespace opjit::rpc
