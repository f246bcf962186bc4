// Subordinate ids: the uids and gids that /etc/subuid and /etc/subgid give
// a user to map into user namespaces (through Debian's uidmap package:
// newuidmap and newgidmap, set-uid root, check these files). A daemon
// without root runs each namespace's executors as one of its user's
// subordinate uids, so that no two namespaces, and never the daemon, share
// a uid.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

namespace opjit::subordinate {

// A run of ids: [first, first + count).
struct Range {
  uint32_t first = 0;
  uint32_t count = 0;
};

// The first range that `text` (the format of /etc/subuid: one
// "<user name or uid>:<first>:<count>" per line; '#' starts a comment)
// gives to the user named `name` or numbered `id`. nullopt when none, or
// when a matching line is malformed or runs past the 32-bit id space.
std::optional<Range> Find(const std::string& text, const std::string& name, uint32_t id);

// What this process's user (its effective uid, and that uid's name) owns in
// /etc/subuid and /etc/subgid, where both give it a range and both newuidmap
// and newgidmap are installed; nullopt otherwise. The two ranges may differ;
// the caller uses min(count) of each.
struct Ids {
  Range uids, gids;
};
std::optional<Ids> ForThisUser();

}  // namespace opjit::subordinate
