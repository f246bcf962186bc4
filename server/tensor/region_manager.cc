#include "server/tensor/region_manager.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/random.h"
#include "server/common/status_macros.h"

namespace opjit::tensor {
namespace {

constexpr size_t kMaxNameLength = 128;
constexpr size_t kMaxIdLength = 256;   // ns and owner.
constexpr size_t kMaxKeyLength = 255;  // NAME_MAX of /dev/shm.
constexpr size_t kMaxTagLength = 64;
constexpr int kRandomHexDigits = 32;
constexpr std::string_view kShmDir = "/dev/shm";

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == '-';
}

bool IsHexDigit(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

// For messages: at most 64 characters of untrusted text.
std::string Clip(std::string_view s) {
  return s.size() <= 64 ? std::string(s) : std::string(s.substr(0, 64)) + "...";
}

absl::Status ValidateName(const std::string& name) {
  bool ok = !name.empty() && name.size() <= kMaxNameLength;
  for (char c : name) ok = ok && IsNameChar(c);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("region name '", Clip(name), "' must match [A-Za-z0-9_.-]{1,128}"));
}

absl::Status ValidateId(const std::string& value, std::string_view what) {
  bool ok = value.size() <= kMaxIdLength;
  for (char c : value) ok = ok && c >= 0x20 && c < 0x7f;
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(std::string(what) +
                                    " must be at most 256 printable ASCII characters");
}

absl::Status ValidateShmKey(const std::string& key) {
  if (key.size() < 2 || key.size() > kMaxKeyLength || key[0] != '/' ||
      key.find('/', 1) != std::string::npos || key.find('\0') != std::string::npos || key == "/." ||
      key == "/..") {
    return absl::InvalidArgumentError(
        absl::StrCat("shm key '", Clip(key),
                     "' must start with '/', contain no other '/', and be 2 to 255 "
                     "characters long"));
  }
  return absl::OkStatus();
}


// strerror() is not thread-safe; this is.
std::string ErrnoText(int err) {
  char buf[128];
  return ::strerror_r(err, buf, sizeof(buf));  // GNU strerror_r: returns the text.
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Unlinks /dev/shm/opjit.<tag>.<32 hex> objects owned by this user; returns
// how many.
int UnlinkOrphans(const std::string& tag) {
  const std::string prefix = absl::StrCat("opjit.", tag, ".");
  DIR* dir = ::opendir(std::string(kShmDir).c_str());
  if (dir == nullptr) {
    Logger("tensor")->warn("cannot scan {} for leftover regions: {}", kShmDir, ErrnoText(errno));
    return 0;
  }
  int removed = 0;
  const uid_t uid = ::geteuid();
  // readdir is safe here: no other thread uses this DIR stream.
  while (struct dirent* ent = ::readdir(dir)) {  // NOLINT(concurrency-mt-unsafe)
    std::string_view name(ent->d_name);
    if (name.size() != prefix.size() + kRandomHexDigits ||
        name.substr(0, prefix.size()) != prefix) {
      continue;
    }
    bool hex = true;
    for (char c : name.substr(prefix.size())) hex = hex && IsHexDigit(c);
    if (!hex) continue;
    struct stat st;
    if (::fstatat(::dirfd(dir), ent->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISREG(st.st_mode) || st.st_uid != uid) {
      continue;
    }
    std::string key = "/" + std::string(name);
    if (::shm_unlink(key.c_str()) == 0) {
      ++removed;
    } else if (errno != ENOENT) {
      Logger("tensor")->warn("cannot unlink leftover region {}: {}", key, ErrnoText(errno));
    }
  }
  ::closedir(dir);
  return removed;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RegionManager>> RegionManager::Create(
    const RegionManagerOptions& options) {
  const std::string& tag = options.instance_tag;
  bool tag_ok = !tag.empty() && tag.size() <= kMaxTagLength;
  for (char c : tag) tag_ok = tag_ok && IsNameChar(c) && c != '.';
  if (!tag_ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("instance_tag '", Clip(tag), "' must match [A-Za-z0-9_-]{1,64}"));
  }
  if (options.namespace_quota_bytes == 0 || options.max_regions_per_namespace == 0) {
    return absl::InvalidArgumentError(
        "namespace_quota_bytes and max_regions_per_namespace must be > 0");
  }
  if (options.default_lease_ms <= 0 || options.max_lease_ms <= 0 ||
      options.default_lease_ms > options.max_lease_ms) {
    return absl::InvalidArgumentError(absl::StrCat("leases must satisfy 0 < default_lease_ms (",
                                                   options.default_lease_ms, ") <= max_lease_ms (",
                                                   options.max_lease_ms, ")"));
  }
  int orphans = UnlinkOrphans(tag);
  Logger("tensor")->info("region manager for instance {}: removed {} leftover shm object(s)", tag,
                         orphans);
  return std::unique_ptr<RegionManager>(new RegionManager(options));
}

RegionManager::RegionManager(const RegionManagerOptions& options)
    : options_(options), key_prefix_(absl::StrCat("/opjit.", options.instance_tag, ".")) {}

RegionManager::~RegionManager() {
  std::vector<std::shared_ptr<const Region>> doomed;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [ns, space] : namespaces_) {
      while (!space.regions.empty()) doomed.push_back(EraseLocked(space, space.regions.begin()));
    }
    namespaces_.clear();
  }
  // `doomed` drops here: mappings no call holds are unmapped now.
}

absl::StatusOr<int64_t> RegionManager::EffectiveLeaseMs(int64_t lease_ms) const {
  if (lease_ms < 0) {
    return absl::InvalidArgumentError(absl::StrCat("lease_ms must be >= 0, got ", lease_ms));
  }
  if (lease_ms == 0) return options_.default_lease_ms;
  return std::min(lease_ms, options_.max_lease_ms);
}

absl::StatusOr<int64_t> RegionManager::Reserve(const std::string& ns, const std::string& owner,
                                               const std::string& name, uint64_t bytes,
                                               int64_t lease_ms) {
  OPJIT_RETURN_IF_ERROR(ValidateId(ns, "namespace"));
  OPJIT_RETURN_IF_ERROR(ValidateId(owner, "owner"));
  OPJIT_RETURN_IF_ERROR(ValidateName(name));
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("region '", name, "': size must be > 0 bytes"));
  }
  OPJIT_ASSIGN_OR_RETURN(int64_t lease, EffectiveLeaseMs(lease_ms));
  absl::MutexLock lock(&mu_);
  const auto emplaced = namespaces_.try_emplace(ns);
  const auto space_it = emplaced.first;
  const bool inserted = emplaced.second;
  Namespace& space = space_it->second;
  // Refusals must not leave an empty namespace behind.
  auto refuse = [&](absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (inserted) namespaces_.erase(space_it);
    return status;
  };
  if (space.regions.contains(name) || space.pending.contains(name)) {
    return refuse(absl::AlreadyExistsError(
        absl::StrCat("region '", name, "' is already registered in namespace '", ns, "'")));
  }
  if (space.regions.size() + space.pending.size() >= options_.max_regions_per_namespace) {
    return refuse(QuotaExceeded("shm_regions", absl::StrCat(options_.max_regions_per_namespace), ns,
                                "the namespace already has that many regions; unregister some first"));
  }
  uint64_t after;
  if (__builtin_add_overflow(space.bytes, bytes, &after) ||
      after > options_.namespace_quota_bytes) {
    return refuse(QuotaExceeded(
        "shm_bytes", absl::StrCat(options_.namespace_quota_bytes), ns,
        absl::StrCat("the namespace would use ",
                     after < space.bytes ? std::string("more than 2^64") : absl::StrCat(after),
                     " bytes of shared memory; unregister regions or release clients first")));
  }
  if (options_.total_quota_bytes > 0) {
    uint64_t total = 0;
    for (const auto& [other, sp] : namespaces_) total += sp.bytes;
    if (total + bytes > options_.total_quota_bytes || total + bytes < total) {
      return refuse(QuotaExceeded("total_shm_bytes", absl::StrCat(options_.total_quota_bytes), "",
                                  "the server's shared memory is full; try again later"));
    }
  }
  space.bytes = after;
  space.pending.insert(name);
  return lease;
}

absl::StatusOr<RegionInfo> RegionManager::Commit(const std::string& ns, const std::string& name,
                                                 uint64_t bytes, int64_t lease_ms,
                                                 absl::StatusOr<std::unique_ptr<Region>> region) {
  absl::MutexLock lock(&mu_);
  Namespace& space = namespaces_[ns];
  space.pending.erase(name);
  if (!region.ok()) {
    space.bytes -= bytes;
    if (space.regions.empty() && space.pending.empty()) namespaces_.erase(ns);
    return region.status();
  }
  Entry& entry = space.regions[name];
  entry.region = std::shared_ptr<const Region>(std::move(*region));
  entry.lease_expires_unix_ms = NowUnixMs() + lease_ms;
  ++total_regions_;
  total_bytes_ += bytes;
  if (entry.region->info().daemon_owned) {
    ++created_;
  } else {
    ++registered_;
  }
  return InfoOf(entry);
}

absl::StatusOr<RegionInfo> RegionManager::CreateRegion(const std::string& ns,
                                                       const std::string& owner,
                                                       const std::string& name, uint64_t bytes,
                                                       int64_t lease_ms,
                                                       std::optional<uid_t> client_uid) {
  OPJIT_ASSIGN_OR_RETURN(int64_t lease, Reserve(ns, owner, name, bytes, lease_ms));
  RegionInfo info;
  info.ns = ns;
  info.name = name;
  info.owner = owner;
  absl::StatusOr<std::unique_ptr<Region>> region = absl::InternalError("no attempt");
  // A 128-bit name collides only if the random source is broken; retry a
  // couple of times rather than fail on a freak.
  for (int attempt = 0; attempt < 3; ++attempt) {
    absl::StatusOr<std::string> hex = RandomHex128();
    if (!hex.ok()) {
      region = hex.status();
      break;
    }
    region = Region::CreateShm(key_prefix_ + *hex, bytes, info, client_uid);
    if (!absl::IsAlreadyExists(region.status())) break;
  }
  if (!region.ok()) {
    Logger("tensor")->warn("create region '{}' ({} bytes) in namespace '{}' failed: {}", name,
                           bytes, ns, region.status().ToString());
  }
  OPJIT_ASSIGN_OR_RETURN(RegionInfo out, Commit(ns, name, bytes, lease, std::move(region)));
  Logger("tensor")->debug("created region '{}' in namespace '{}' for '{}': {} bytes at {}", name,
                          ns, owner, bytes, out.shm_key);
  return out;
}

absl::StatusOr<RegionInfo> RegionManager::RegisterRegion(
    const std::string& ns, const std::string& owner, const std::string& name,
    const std::string& shm_key, uint64_t offset, uint64_t byte_size, int64_t lease_ms,
    std::optional<uid_t> caller_uid) {
  OPJIT_RETURN_IF_ERROR(ValidateShmKey(shm_key));
  OPJIT_ASSIGN_OR_RETURN(int64_t lease, Reserve(ns, owner, name, byte_size, lease_ms));
  RegionInfo info;
  info.ns = ns;
  info.name = name;
  info.owner = owner;
  absl::StatusOr<std::unique_ptr<Region>> region =
      Region::MapExisting(shm_key, offset, byte_size, std::move(info), caller_uid);
  if (!region.ok()) {
    // Prefix the region name so the client sees which registration failed.
    region = absl::Status(region.status().code(),
                          absl::StrCat("region '", name, "': ", region.status().message()));
  }
  OPJIT_ASSIGN_OR_RETURN(RegionInfo out, Commit(ns, name, byte_size, lease, std::move(region)));
  Logger("tensor")->debug("registered region '{}' in namespace '{}' for '{}': {} bytes at {}+{}",
                          name, ns, owner, byte_size, shm_key, offset);
  return out;
}

namespace {

// Whether a region leased to `owner` ("<principal>/<client id>" or a bare
// client id) belongs to `principal`; "" matches every owner.
bool OwnedBy(const std::string& owner, const std::string& principal) {
  if (principal.empty()) return true;
  return owner.size() > principal.size() && owner.compare(0, principal.size(), principal) == 0 &&
         owner[principal.size()] == '/';
}

absl::Status RegionNotFound(const std::string& ns, const std::string& name) {
  return WithReason(absl::NotFoundError(absl::StrCat("region '", Clip(name),
                                                     "' is not registered in namespace '",
                                                     Clip(ns), "'")),
                    reason::kRegionNotRegistered, {{"region", Clip(name)}});
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Region>> RegionManager::Acquire(
    const std::string& ns, const std::string& name, const std::string& principal) const {
  absl::ReaderMutexLock lock(&mu_);
  auto space = namespaces_.find(ns);
  if (space != namespaces_.end()) {
    auto it = space->second.regions.find(name);
    if (it != space->second.regions.end() && OwnedBy(it->second.region->info().owner, principal)) {
      return it->second.region;
    }
  }
  return RegionNotFound(ns, name);
}

std::shared_ptr<const Region> RegionManager::EraseLocked(
    Namespace& space, std::map<std::string, Entry>::iterator it) {
  std::shared_ptr<const Region> region = std::move(it->second.region);
  space.regions.erase(it);
  const RegionInfo& info = region->info();
  space.bytes -= info.byte_size;
  --total_regions_;
  total_bytes_ -= info.byte_size;
  // Unlink at once, so no new client can map a name that is gone; the memory
  // is freed when the last mapping (ours in flight, or a client's) goes.
  if (info.daemon_owned && ::shm_unlink(info.shm_key.c_str()) != 0 && errno != ENOENT) {
    Logger("tensor")->warn("shm_unlink {} failed: {}", info.shm_key, ErrnoText(errno));
  }
  return region;
}

absl::Status RegionManager::Unregister(const std::string& ns, const std::string& name,
                                       const std::string& principal) {
  std::shared_ptr<const Region> doomed;
  {
    absl::MutexLock lock(&mu_);
    auto space = namespaces_.find(ns);
    if (space != namespaces_.end()) {
      auto it = space->second.regions.find(name);
      if (it != space->second.regions.end() &&
          OwnedBy(it->second.region->info().owner, principal)) {
        doomed = EraseLocked(space->second, it);
        if (space->second.regions.empty() && space->second.pending.empty()) {
          namespaces_.erase(space);
        }
      }
    }
  }
  if (doomed == nullptr) return RegionNotFound(ns, name);
  Logger("tensor")->debug("unregistered region '{}' in namespace '{}'", name, ns);
  NotifyRemoved({doomed});
  return absl::OkStatus();  // `doomed` drops here, outside the lock.
}

absl::StatusOr<int> RegionManager::ReleaseOwner(const std::string& ns, const std::string& owner) {
  std::vector<std::shared_ptr<const Region>> doomed;
  {
    absl::MutexLock lock(&mu_);
    auto space = namespaces_.find(ns);
    if (space == namespaces_.end()) return 0;
    auto& regions = space->second.regions;
    for (auto it = regions.begin(); it != regions.end();) {
      auto next = std::next(it);
      if (it->second.region->info().owner == owner)
        doomed.push_back(EraseLocked(space->second, it));
      it = next;
    }
    if (regions.empty() && space->second.pending.empty()) namespaces_.erase(space);
  }
  if (!doomed.empty()) {
    Logger("tensor")->debug("released {} region(s) of '{}' in namespace '{}'", doomed.size(), owner,
                            ns);
  }
  NotifyRemoved(doomed);
  return static_cast<int>(doomed.size());
}

std::vector<std::shared_ptr<const Region>> RegionManager::EraseWhereLocked(
    const std::function<bool(const std::string& ns, const Entry& entry)>& doomed_if) {
  std::vector<std::shared_ptr<const Region>> doomed;
  for (auto space = namespaces_.begin(); space != namespaces_.end();) {
    auto& regions = space->second.regions;
    for (auto it = regions.begin(); it != regions.end();) {
      auto next = std::next(it);
      if (doomed_if(space->first, it->second)) doomed.push_back(EraseLocked(space->second, it));
      it = next;
    }
    if (regions.empty() && space->second.pending.empty()) {
      space = namespaces_.erase(space);
    } else {
      ++space;
    }
  }
  return doomed;
}

int RegionManager::ReleaseWhere(const OwnerPredicate& doomed_if) {
  std::vector<std::shared_ptr<const Region>> doomed;
  {
    absl::MutexLock lock(&mu_);
    doomed = EraseWhereLocked([&](const std::string& ns, const Entry& e) {
      return doomed_if(ns, e.region->info().owner);
    });
  }
  if (!doomed.empty()) Logger("tensor")->debug("released {} region(s) by predicate", doomed.size());
  NotifyRemoved(doomed);
  return static_cast<int>(doomed.size());
}

absl::StatusOr<int64_t> RegionManager::Renew(const std::string& ns, const std::string& owner,
                                             int64_t lease_ms) {
  OPJIT_ASSIGN_OR_RETURN(int64_t lease, EffectiveLeaseMs(lease_ms));
  const int64_t expires = NowUnixMs() + lease;
  int renewed = 0;
  absl::MutexLock lock(&mu_);
  auto space = namespaces_.find(ns);
  if (space != namespaces_.end()) {
    for (auto& [name, entry] : space->second.regions) {
      if (entry.region->info().owner != owner) continue;
      entry.lease_expires_unix_ms = expires;
      ++renewed;
    }
  }
  if (renewed == 0) {
    return absl::NotFoundError(
        absl::StrCat("owner '", Clip(owner), "' has no regions in namespace '", Clip(ns), "'"));
  }
  return expires;
}

int RegionManager::ExpireLeases(int64_t now_unix_ms) {
  std::vector<std::shared_ptr<const Region>> doomed;
  {
    absl::MutexLock lock(&mu_);
    doomed = EraseWhereLocked(
        [&](const std::string&, const Entry& e) { return e.lease_expires_unix_ms <= now_unix_ms; });
    expired_ += doomed.size();
  }
  for (const auto& region : doomed) {
    const RegionInfo& info = region->info();
    Logger("tensor")->info(
        "lease of region '{}' in namespace '{}' (owner '{}', {} bytes) lapsed; "
        "unregistered it",
        info.name, info.ns, info.owner, info.byte_size);
  }
  NotifyRemoved(doomed);
  return static_cast<int>(doomed.size());
}

RegionInfo RegionManager::InfoOf(const Entry& entry) {
  RegionInfo info = entry.region->info();
  info.lease_expires_unix_ms = entry.lease_expires_unix_ms;
  info.id = entry.region->serial();
  return info;
}

absl::StatusOr<std::shared_ptr<const Region>> RegionManager::AcquireById(
    const std::string& ns, uint64_t id, const std::string& owner) const {
  {
    absl::ReaderMutexLock lock(&mu_);
    auto space = namespaces_.find(ns);
    if (space != namespaces_.end()) {
      for (const auto& [name, entry] : space->second.regions) {
        if (entry.region->serial() == id && entry.region->info().owner == owner) {
          return entry.region;
        }
      }
    }
  }
  return WithReason(absl::NotFoundError(absl::StrCat("region id ", id,
                                                     " is not one of this client's regions in "
                                                     "namespace '", Clip(ns), "'")),
                    reason::kRegionNotRegistered);
}

bool RegionManager::HasOwner(const std::string& ns, const std::string& owner) const {
  absl::ReaderMutexLock lock(&mu_);
  auto space = namespaces_.find(ns);
  if (space == namespaces_.end()) return false;
  for (const auto& [name, entry] : space->second.regions) {
    if (entry.region->info().owner == owner) return true;
  }
  return false;
}

std::vector<RegionInfo> RegionManager::List(const std::string& ns,
                                            const std::string& principal) const {
  std::vector<RegionInfo> out;
  absl::ReaderMutexLock lock(&mu_);
  auto space = namespaces_.find(ns);
  if (space == namespaces_.end()) return out;
  out.reserve(space->second.regions.size());
  for (const auto& [name, entry] : space->second.regions) {
    if (OwnedBy(entry.region->info().owner, principal)) out.push_back(InfoOf(entry));
  }
  return out;
}

std::map<std::string, uint64_t> RegionManager::BytesByNamespace() const {
  std::map<std::string, uint64_t> out;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [ns, space] : namespaces_) out[ns] = space.bytes;
  return out;
}

RegionManager::Stats RegionManager::GetStats() const {
  absl::ReaderMutexLock lock(&mu_);
  return Stats{.regions = total_regions_,
               .bytes = total_bytes_,
               .created = created_,
               .registered = registered_,
               .expired = expired_};
}

}  // namespace opjit::tensor
