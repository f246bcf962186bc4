// Who is calling and what they may do: principals, roles, namespaces.
//
// Every RPC resolves its caller to a Principal (Authenticator::Authenticate)
// and checks the namespace it names (AccessControl::Check) before anything
// else runs. The rules:
//   - unix socket: the peer's uid/gid/pid come from SO_PEERCRED; a principal
//     configured with that uid (or primary gid) is the caller. The daemon's
//     own uid and root are admins.
//   - TCP (and the unix socket too): "authorization: Bearer <token>"; the
//     config holds sha256(token) per principal, never the token.
//   - no principals configured (the embedded default): every caller of the
//     unix socket and of loopback TCP is the local admin, as before.
//   - reader: describe and call; user: also register, compile and delete;
//     admin: everything, every namespace, and creates namespaces.
//   - a namespace the principal has no access to is NOT_FOUND, exactly like
//     one that does not exist; a right the role lacks is PERMISSION_DENIED.
//
// Thread-safe. No gRPC types: the rpc layer fills PeerInfo.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace opjit::access {

// kMetrics is for a metrics scraper: it sees every series of the Prometheus
// endpoint and may do nothing over gRPC (it sees no namespace), so the
// scraper never holds a token that can run code or clear caches.
enum class Role { kReader, kUser, kAdmin, kMetrics };

// "admin", "user", "reader", "metrics".
const char* RoleName(Role role);
std::optional<Role> ParseRole(const std::string& name);

// What an RPC does to a namespace.
enum class Action {
  kDescribe,  // GetOp, ListOps, ListRegions
  kCall,      // Forward, Backward, GradCheck, contexts, regions and leases
  kWrite,     // RegisterOp, DeleteOp, Compile
  kAdmin,     // ClearCache, server-wide statistics
};

const char* ActionName(Action action);

// One configured principal.
struct PrincipalConfig {
  std::string name;  // [A-Za-z0-9_.@-]{1,64}
  Role role = Role::kUser;
  std::vector<std::string> namespaces;     // ignored for admins (they have all); none for metrics
  std::vector<std::string> token_sha256;   // lowercase hex sha256 of each bearer token
  std::vector<uint32_t> uids;              // unix-socket peers with these uids
  std::vector<uint32_t> gids;              // ... or this primary gid
};

struct AccessOptions {
  // Empty: the embedded default (local admin, no tokens).
  std::vector<PrincipalConfig> principals;
  // The daemon's uid: on the unix socket it is admin. Default: getuid().
  uid_t daemon_uid = 0;
  // Upper bound on the number of namespaces (admins create them by using a
  // new one). Default: 64.
  size_t max_namespaces = 64;
};

// The caller of one RPC, as the transport saw it.
struct PeerInfo {
  enum class Transport { kUnix, kTcp, kInProcess };
  Transport transport = Transport::kInProcess;
  // SO_PEERCRED of a unix-socket peer.
  std::optional<uid_t> uid;
  std::optional<gid_t> gid;
  std::optional<pid_t> pid;
  bool loopback = false;      // a TCP peer on 127.0.0.0/8 or ::1
  bool tls = false;           // the connection is TLS
  // The value of the "authorization" metadata, if sent.
  std::optional<std::string> authorization;
};

struct Principal {
  std::string name;
  Role role = Role::kReader;
  std::set<std::string> namespaces;  // empty for admins: all
  std::optional<uid_t> uid;          // of a unix-socket peer
  bool admin() const { return role == Role::kAdmin; }
  // Whether a metrics scrape shows it every series (else: its namespaces').
  bool scrapes_all() const { return role == Role::kAdmin || role == Role::kMetrics; }
  // Whether the principal may see `ns` at all.
  bool Sees(const std::string& ns) const { return admin() || namespaces.count(ns) > 0; }
};

// Every problem of a set of principals (bad name, token hash or role
// combination; a duplicate name, token, uid or gid), as (index into
// `principals`, message). Empty when they are valid. Messages never contain
// a token hash.
std::vector<std::pair<size_t, std::string>> PrincipalProblems(
    const std::vector<PrincipalConfig>& principals);

class AccessControl {
 public:
  // INVALID_ARGUMENT for a bad principal (name, token hash, duplicate token,
  // uid mapped twice).
  static absl::StatusOr<std::unique_ptr<AccessControl>> Create(AccessOptions options);

  // Whether principals are configured (false: the embedded default).
  bool enabled() const;

  // The caller's principal. UNAUTHENTICATED (reason UNAUTHENTICATED) for a
  // missing or unknown token, or an unmapped unix peer.
  absl::StatusOr<std::shared_ptr<const Principal>> Authenticate(const PeerInfo& peer) const;

  // OK when `principal` may do `action` in `ns`. NOT_FOUND (reason
  // NAMESPACE_NOT_FOUND) when it cannot see `ns`; PERMISSION_DENIED (reason
  // PERMISSION_DENIED, metadata role and action) when its role lacks the
  // right. An admin writing to (or calling in) a namespace not seen before
  // creates it; past max_namespaces that is RESOURCE_EXHAUSTED
  // (QUOTA_EXCEEDED "namespaces").
  absl::Status Check(const Principal& principal, const std::string& ns, Action action);

  // Replaces the principals (a config reload). Validated as Create does:
  // INVALID_ARGUMENT and nothing changes when they are not valid;
  // FAILED_PRECONDITION when the change would switch between no principals
  // (the embedded default, where every local caller is admin) and some:
  // that changes who may connect at all and needs a restart. A call already
  // authenticated keeps its Principal; the next call sees the new set.
  // Namespaces the new principals name become existing ones.
  absl::Status SetPrincipals(std::vector<PrincipalConfig> principals);

  // Replaces the bound on the number of namespaces (a config reload);
  // namespaces that exist stay, even above it.
  void SetMaxNamespaces(size_t max_namespaces);

  // Marks namespaces that already hold data (the registry at startup) as
  // existing.
  void AddExisting(const std::vector<std::string>& namespaces);

  size_t namespace_count() const;

 private:
  // The principals and their lookup maps (pointing into `principals`).
  // Immutable once built; replaced whole on a reload.
  struct Table {
    std::vector<PrincipalConfig> principals;
    std::map<std::string, const PrincipalConfig*> by_token;  // sha256 hex -> principal
    std::map<uint32_t, const PrincipalConfig*> by_uid;
    std::map<uint32_t, const PrincipalConfig*> by_gid;
  };
  static absl::StatusOr<std::shared_ptr<const Table>> BuildTable(
      std::vector<PrincipalConfig> principals);

  explicit AccessControl(AccessOptions options);
  std::shared_ptr<const Table> table() const;

  const uid_t daemon_uid_;

  mutable absl::Mutex table_mu_;
  std::shared_ptr<const Table> table_ ABSL_GUARDED_BY(table_mu_);

  mutable absl::Mutex mu_;
  size_t max_namespaces_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> namespaces_ ABSL_GUARDED_BY(mu_);
};

// "Bearer <token>" -> "<token>"; nullopt when `authorization` is not that.
std::optional<std::string> BearerToken(const std::string& authorization);

}  // namespace opjit::access
