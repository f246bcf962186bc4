// Who calls: the rpc layer's bridge from a gRPC call to access::Principal.
//
// Unix-socket connections are accepted by GrpcServer itself and handed to
// gRPC by file descriptor, so their peer is "fd:<n>" and SO_PEERCRED can be
// read from that descriptor on every call (it stays open while any call of
// the connection is alive). TCP peers are "ipv4:..."/"ipv6:...".
#pragma once

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "server/access/access.h"
#include "server/runner/kernel_runner.h"

namespace opjit::rpc {

struct CoreRefs;

// What the transport tells about the caller of `ctx`.
access::PeerInfo PeerOf(const grpc::CallbackServerContext& ctx);

// Authenticates the caller and checks `action` on namespace `ns`. With no
// AccessControl in `core` (tests, in-process use) the caller is a local admin.
absl::StatusOr<std::shared_ptr<const access::Principal>> Admit(const CoreRefs& core,
                                                               const grpc::CallbackServerContext& ctx,
                                                               const std::string& ns,
                                                               access::Action action);

// Authenticates only (for calls that name no namespace).
absl::StatusOr<std::shared_ptr<const access::Principal>> Authenticate(
    const CoreRefs& core, const grpc::CallbackServerContext& ctx);

// The owner a region of (principal, client id) is leased to:
// "<principal>/<client id>".
std::string RegionOwner(const access::Principal& p, const std::string& client_id);
// The client id part of a region owner.
std::string ClientIdOf(const std::string& owner);
// The principal regions are filtered by: "" (all) for admins.
std::string RegionScope(const access::Principal& p);
// Whom a call's kernel crashes count against (fair quarantine).
runner::Caller QuarantineCaller(const access::Principal& p);

}  // namespace opjit::rpc

// In a unary handler: `var` = the admitted principal, or the call is answered
// with the refusal.
#define OPJIT_RPC_ADMIT(var, ns, action)                                   \
  auto var##_or = ::opjit::rpc::Admit(core_, *ctx, (ns), (action));        \
  if (!var##_or.ok()) return ::opjit::rpc::FinishNow(ctx, var##_or.status()); \
  const ::opjit::access::Principal& var = **var##_or
