#include "server/registry/registry.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/status_macros.h"
#include "server/registry/canonical.h"
#include "server/registry/validate.h"

namespace opjit::registry {
namespace {

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string ShortHash(const std::string& hash) { return hash.substr(0, 12); }

}  // namespace

absl::StatusOr<std::unique_ptr<Registry>> Registry::Create(const Options& options) {
  auto log = Logger("registry");
  if (options.db_path.empty()) {
    return absl::InvalidArgumentError("registry: db_path must be set");
  }
  OPJIT_ASSIGN_OR_RETURN(std::unique_ptr<Store> store, Store::Open(options.db_path));
  OPJIT_ASSIGN_OR_RETURN(std::vector<OpRecord> records, store->LoadAll());
  OPJIT_ASSIGN_OR_RETURN(std::vector<Store::HighWater> marks, store->LoadHighWater());
  std::unique_ptr<Registry> reg(new Registry(std::move(store), options));
  size_t versions = records.size();
  {
    absl::MutexLock wlock(&reg->write_mu_);
    absl::MutexLock lock(&reg->mu_);
    for (const Store::HighWater& m : marks) reg->high_water_[{m.ns, m.name}] = m.max_version;
    for (OpRecord& rec : records) {
      // Rules may have tightened since the record was stored; keep serving it.
      if (absl::Status s = ValidateOpDef(rec.def); !s.ok()) {
        log->warn("stored op {}/{} version {} no longer validates: {}", rec.def.ns, rec.def.name,
                  rec.version, s.ToString());
      }
      Key key{rec.def.ns, rec.def.name};
      int64_t& mark = reg->high_water_[key];
      mark = std::max(mark, rec.version);
      int64_t version = rec.version;
      reg->ops_[key].versions[version] = std::make_shared<const OpRecord>(std::move(rec));
    }
    log->info("registry opened from {}: {} ops, {} versions", options.db_path, reg->ops_.size(),
              versions);
  }
  return reg;
}

absl::StatusOr<Registry::RegisterResult> Registry::Register(OpDef def) {
  auto log = Logger("registry");
  if (absl::Status s = ValidateOpDef(def); !s.ok()) {
    return s.code() == absl::StatusCode::kInvalidArgument ? WithReason(s, reason::kInvalidSpec) : s;
  }
  std::string hash = ContentHash(def);
  Key key{def.ns, def.name};

  absl::MutexLock wlock(&write_mu_);
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = ops_.find(key);
    if (it != ops_.end()) {
      const auto& latest = it->second.versions.rbegin()->second;
      if (latest->content_hash == hash) {
        log->debug("register {}/{}: unchanged, version {} ({})", def.ns, def.name, latest->version,
                   ShortHash(hash));
        return RegisterResult{*latest, /*created=*/false};
      }
      if (options_.max_versions_per_op > 0 &&
          it->second.versions.size() >= options_.max_versions_per_op) {
        return QuotaExceeded("versions", absl::StrCat(options_.max_versions_per_op), def.ns,
                             absl::StrCat("op \"", def.name, "\" already has that many versions; "
                                          "delete old ones (DeleteOp with a version) first"));
      }
    } else if (options_.max_ops_per_namespace > 0) {
      size_t in_ns = 0;
      for (auto o = ops_.lower_bound({def.ns, ""}); o != ops_.end() && o->first.first == def.ns;
           ++o) {
        ++in_ns;
      }
      if (in_ns >= options_.max_ops_per_namespace) {
        return QuotaExceeded("ops", absl::StrCat(options_.max_ops_per_namespace), def.ns,
                             "the namespace already holds that many ops; delete some first");
      }
    }
  }
  int64_t& mark = high_water_[key];
  auto record = std::make_shared<OpRecord>();
  record->version = mark + 1;
  record->content_hash = std::move(hash);
  record->created_unix_ms = NowUnixMs();
  record->def = std::move(def);
  // Durable before it is visible or acknowledged.
  OPJIT_RETURN_IF_ERROR(store_->Insert(*record));
  mark = record->version;
  RegisterResult result{*record, /*created=*/true};
  {
    absl::MutexLock lock(&mu_);
    ops_[key].versions[record->version] = std::move(record);
  }
  generation_.fetch_add(1, std::memory_order_acq_rel);
  if (change_listener_) change_listener_();
  log->info("registered {}/{} version {} ({})", key.first, key.second, result.record.version,
            ShortHash(result.record.content_hash));
  return result;
}

absl::Status Registry::NotFound(const std::string& ns, const std::string& name,
                                int64_t version) const {
  auto it = ops_.find({ns, name});
  if (it == ops_.end() || version == 0) {
    return WithReason(absl::NotFoundError(absl::StrCat("op \"", ns, "/", name, "\" not found")),
                      reason::kOpNotFound, {{"op", name}});
  }
  std::vector<int64_t> have;
  for (const auto& [v, rec] : it->second.versions) have.push_back(v);
  return WithReason(
      absl::NotFoundError(absl::StrCat("op \"", ns, "/", name, "\" has no version ", version,
                                       " (versions: ", absl::StrJoin(have, ", "), ")")),
      reason::kVersionNotFound, {{"op", name}, {"version", absl::StrCat(version)}});
}

absl::StatusOr<std::shared_ptr<const OpRecord>> Registry::GetShared(const std::string& ns,
                                                                    const std::string& name,
                                                                    int64_t version) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = ops_.find({ns, name});
  if (it != ops_.end()) {
    const auto& versions = it->second.versions;
    if (version == 0) return versions.rbegin()->second;
    auto vit = versions.find(version);
    if (vit != versions.end()) return vit->second;
  }
  absl::Status s = NotFound(ns, name, version);
  Logger("registry")->debug("get {}/{} version {}: {}", ns, name, version, s.ToString());
  return s;
}

absl::StatusOr<OpRecord> Registry::Get(const std::string& ns, const std::string& name,
                                       int64_t version) const {
  OPJIT_ASSIGN_OR_RETURN(std::shared_ptr<const OpRecord> rec, GetShared(ns, name, version));
  return *rec;
}

std::vector<std::string> Registry::Namespaces() const {
  std::vector<std::string> out;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [key, entry] : ops_) {
    if (out.empty() || out.back() != key.first) out.push_back(key.first);
  }
  return out;
}

std::vector<OpRecord> Registry::List(const std::string& ns, bool all_versions) const {
  std::vector<OpRecord> out;
  absl::ReaderMutexLock lock(&mu_);
  auto it = ns.empty() ? ops_.begin() : ops_.lower_bound({ns, ""});
  for (; it != ops_.end(); ++it) {
    if (!ns.empty() && it->first.first != ns) break;
    const auto& versions = it->second.versions;
    if (all_versions) {
      for (const auto& [v, rec] : versions) out.push_back(*rec);
    } else {
      out.push_back(*versions.rbegin()->second);
    }
  }
  return out;
}

absl::StatusOr<int> Registry::Delete(const std::string& ns, const std::string& name,
                                     int64_t version) {
  absl::MutexLock wlock(&write_mu_);
  int count = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = ops_.find({ns, name});
    if (it == ops_.end() || (version != 0 && !it->second.versions.count(version))) {
      return NotFound(ns, name, version);
    }
    count = version == 0 ? static_cast<int>(it->second.versions.size()) : 1;
  }
  OPJIT_RETURN_IF_ERROR(store_->DeleteOp(ns, name, version));
  {
    absl::MutexLock lock(&mu_);
    auto it = ops_.find({ns, name});
    if (version == 0) {
      ops_.erase(it);
    } else {
      it->second.versions.erase(version);
      if (it->second.versions.empty()) ops_.erase(it);
    }
  }
  generation_.fetch_add(1, std::memory_order_acq_rel);
  if (change_listener_) change_listener_();
  Logger("registry")
      ->info("deleted {}/{} {} ({} versions)", ns, name,
             version == 0 ? std::string("all versions") : absl::StrCat("version ", version), count);
  return count;
}

std::vector<std::string> Registry::Warnings(const OpDef& def) const {
  std::vector<std::string> out;
  if (!def.backward.op.empty()) {
    bool found;
    {
      absl::ReaderMutexLock lock(&mu_);
      found = ops_.count({def.ns, def.backward.op}) != 0;
    }
    if (!found) {
      out.push_back(absl::StrCat(
          "backward.op: \"", def.backward.op, "\" is not a registered op in namespace \"", def.ns,
          "\"; the op is registered, but its backward fails until \"", def.backward.op,
          "\" is registered"));
    }
  }
  return out;
}

size_t Registry::Size() const {
  absl::ReaderMutexLock lock(&mu_);
  return ops_.size();
}

}  // namespace opjit::registry
