#include "server/registry/registry.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/status_macros.h"
#include "server/common/text.h"
#include "server/registry/bprop_args.h"
#include "server/registry/canonical.h"
#include "server/registry/postgres_store.h"
#include "server/registry/sqlite_store.h"
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
  std::unique_ptr<Store> store;
  if (options.backend == "sqlite") {
    if (options.db_path.empty()) {
      return absl::InvalidArgumentError("registry: db_path must be set");
    }
    OPJIT_ASSIGN_OR_RETURN(store, SqliteStore::Open(options.db_path));
  } else if (options.backend == "postgres") {
    if (options.poll_ms <= 0) {
      return absl::InvalidArgumentError("registry: poll_ms must be positive");
    }
    OPJIT_ASSIGN_OR_RETURN(store,
                           PostgresStore::Open({.url = options.url, .password = options.password}));
  } else {
    return absl::InvalidArgumentError(absl::StrCat("registry: unknown backend \"", options.backend,
                                                   "\" (expected sqlite or postgres)"));
  }
  OPJIT_ASSIGN_OR_RETURN(Store::Snapshot snap, store->LoadSnapshot());
  OPJIT_ASSIGN_OR_RETURN(std::unique_ptr<ChangeWatcher> watcher, store->Watch());
  for (const OpRecord& rec : snap.records) {
    // Rules may have tightened since the record was stored; keep serving it.
    if (absl::Status s = ValidateOpDef(rec.def); !s.ok()) {
      log->warn("stored op {}/{} version {} no longer validates: {}", rec.def.ns, rec.def.name,
                rec.version, s.ToString());
    }
  }
  std::unique_ptr<Registry> reg(new Registry(std::move(store), options));
  size_t versions = snap.records.size();
  {
    absl::MutexLock wlock(&reg->write_mu_);
    reg->Apply(std::move(snap));
    absl::ReaderMutexLock lock(&reg->mu_);
    log->info("registry opened from {}: {} ops, {} versions", reg->store_->Describe(),
              reg->ops_.size(), versions);
  }
  if (watcher != nullptr) {
    reg->watcher_ = std::move(watcher);
    reg->sync_thread_ = std::thread([r = reg.get()] { r->SyncLoop(); });
  }
  return reg;
}

Registry::~Registry() {
  if (sync_thread_.joinable()) {
    stop_.store(true);
    watcher_->Interrupt();
    sync_thread_.join();
  }
}

void Registry::Apply(Store::Snapshot snap) {
  std::map<Key, OpEntry> ops;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (OpRecord& rec : snap.records) {
      Key key{rec.def.ns, rec.def.name};
      int64_t version = rec.version;
      std::shared_ptr<const OpRecord> ptr;
      // Keep the record callers may already hold when it did not change.
      if (auto it = ops_.find(key); it != ops_.end()) {
        auto vit = it->second.versions.find(version);
        if (vit != it->second.versions.end() && vit->second->content_hash == rec.content_hash) {
          ptr = vit->second;
        }
      }
      if (ptr == nullptr) ptr = std::make_shared<const OpRecord>(std::move(rec));
      ops[std::move(key)].versions[version] = std::move(ptr);
    }
  }
  {
    absl::MutexLock lock(&mu_);
    ops_.swap(ops);
  }
  store_generation_ = snap.generation;
  // `ops` (the old maps) is freed here, outside mu_.
}

void Registry::Changed() {
  generation_.fetch_add(1, std::memory_order_acq_rel);
  if (change_listener_) change_listener_();
}

void Registry::NoteLocalWrite(uint64_t store_generation) {
  ++local_writes_;
  max_local_generation_ = std::max(max_local_generation_, store_generation);
  if (store_generation == store_generation_ + 1) {
    store_generation_ = store_generation;
  } else if (watcher_ != nullptr) {
    // Someone else wrote in between: the memory misses it. Reload now rather
    // than at the next notification or poll.
    watcher_->Interrupt();
  }
  Changed();
}

absl::StatusOr<Registry::RegisterResult> Registry::Register(OpDef def, const TargetRules& rules) {
  auto log = Logger("registry");
  if (absl::Status s = ValidateOpDef(def, rules); !s.ok()) {
    return s.code() == absl::StatusCode::kInvalidArgument ? WithReason(s, reason::kInvalidSpec) : s;
  }
  std::string hash = ContentHash(def);
  Key key{def.ns, def.name};
  const Store::Limits limits{options_.max_ops_per_namespace, options_.max_versions_per_op};

  absl::MutexLock wlock(&write_mu_);
  OPJIT_RETURN_IF_ERROR(CheckBackwardLinks(def));
  OPJIT_ASSIGN_OR_RETURN(Store::InsertResult inserted,
                         store_->RegisterVersion(def, hash, NowUnixMs(), limits));
  if (!inserted.created) {
    log->debug("register {}/{}: unchanged, version {} ({})", def.ns, def.name,
               inserted.record.version, ShortHash(hash));
    if (watcher_ != nullptr) {
      bool current;
      {
        absl::ReaderMutexLock lock(&mu_);
        auto it = ops_.find(key);
        current =
            it != ops_.end() && it->second.versions.rbegin()->first == inserted.record.version;
      }
      // Another daemon registered it and we have not caught up yet.
      if (!current) watcher_->Interrupt();
    }
    return RegisterResult{std::move(inserted.record), /*created=*/false};
  }
  auto record = std::make_shared<const OpRecord>(std::move(inserted.record));
  RegisterResult result{*record, /*created=*/true};
  {
    absl::MutexLock lock(&mu_);
    ops_[key].versions[record->version] = std::move(record);
  }
  NoteLocalWrite(inserted.generation);
  log->info("registered {}/{} version {} ({})", key.first, key.second, result.record.version,
            ShortHash(result.record.content_hash));
  return result;
}

std::vector<int64_t> Registry::VersionsOf(const Key& key) const {
  std::vector<int64_t> have;
  auto it = ops_.find(key);
  if (it != ops_.end()) {
    for (const auto& [v, rec] : it->second.versions) have.push_back(v);
  }
  return have;
}

absl::Status Registry::NotFound(const std::string& ns, const std::string& name, int64_t version,
                                const std::vector<int64_t>& versions) {
  if (versions.empty() || version == 0) {
    return WithReason(
        absl::NotFoundError(absl::StrCat("op \"", Excerpt(ns), "/", Excerpt(name), "\" not found")),
        reason::kOpNotFound, {{"op", Excerpt(name)}});
  }
  return WithReason(
      absl::NotFoundError(absl::StrCat("op \"", Excerpt(ns), "/", Excerpt(name),
                                       "\" has no version ", version, " (versions: ",
                                       absl::StrJoin(versions, ", "), ")")),
      reason::kVersionNotFound, {{"op", Excerpt(name)}, {"version", absl::StrCat(version)}});
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
  absl::Status s = NotFound(ns, name, version, VersionsOf({ns, name}));
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
  OPJIT_ASSIGN_OR_RETURN(Store::DeleteResult deleted, store_->DeleteOp(ns, name, version));
  if (deleted.deleted == 0) {
    if (watcher_ != nullptr) {
      bool stale;
      {
        absl::ReaderMutexLock lock(&mu_);
        stale = VersionsOf({ns, name}) != deleted.live_versions;
      }
      if (stale) watcher_->Interrupt();  // another daemon changed it; catch up
    }
    return NotFound(ns, name, version, deleted.live_versions);
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = ops_.find({ns, name});
    if (it != ops_.end()) {
      if (version == 0) {
        ops_.erase(it);
      } else {
        it->second.versions.erase(version);
        if (it->second.versions.empty()) ops_.erase(it);
      }
    }
  }
  NoteLocalWrite(deleted.generation);
  Logger("registry")
      ->info("deleted {}/{} {} ({} versions)", ns, name,
             version == 0 ? std::string("all versions") : absl::StrCat("version ", version),
             deleted.deleted);
  return deleted.deleted;
}

absl::StatusOr<bool> Registry::CheckAndReload() {
  uint64_t seen, writes;
  {
    absl::MutexLock wlock(&write_mu_);
    seen = store_generation_;
    writes = local_writes_;
  }
  OPJIT_ASSIGN_OR_RETURN(uint64_t current, watcher_->Generation());
  if (current == seen) return false;
  const auto start = std::chrono::steady_clock::now();
  OPJIT_ASSIGN_OR_RETURN(Store::Snapshot snap, watcher_->LoadSnapshot());
  absl::MutexLock wlock(&write_mu_);
  if (snap.generation == store_generation_) return false;  // a local write caught up
  // A local write that committed after the snapshot was taken would be lost
  // from memory by applying it; take a newer snapshot instead.
  if (local_writes_ != writes && snap.generation < max_local_generation_) return true;
  const uint64_t from = store_generation_;
  size_t versions = snap.records.size();
  Apply(std::move(snap));
  reloads_.fetch_add(1, std::memory_order_relaxed);
  Changed();
  size_t ops;
  {
    absl::ReaderMutexLock lock(&mu_);
    ops = ops_.size();
  }
  Logger("registry")
      ->info(
          "registry reloaded (changed elsewhere): generation {} -> {}, {} ops, {} versions, {} ms",
          from, store_generation_, ops, versions,
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                start)
              .count());
  return false;
}

void Registry::SyncLoop() {
  auto log = Logger("registry");
  using Clock = std::chrono::steady_clock;
  const int64_t poll_ms = options_.poll_ms;
  const int64_t max_backoff_ms = std::min<int64_t>(poll_ms, PostgresStore::kMaxBackoffMs);
  int64_t backoff_ms = 50;
  bool check = true;  // compare generations before waiting (writes may predate LISTEN)
  bool failing = false;
  Clock::time_point next_poll = Clock::now();
  while (!stop_.load()) {
    if (check) {
      absl::StatusOr<bool> again = CheckAndReload();
      if (!again.ok()) {
        if (!failing) log->warn("registry sync: {}", again.status().ToString());
        failing = true;
        // Wait out the backoff (Wait reconnects, or sleeps when it cannot).
        (void)watcher_->Wait(backoff_ms);
        backoff_ms = std::min(backoff_ms * 2, max_backoff_ms);
        continue;
      }
      if (failing) log->info("registry sync: working again");
      failing = false;
      backoff_ms = 50;
      check = *again;
      next_poll = Clock::now() + std::chrono::milliseconds(poll_ms);
      if (check) continue;
    }
    int64_t left = std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(next_poll - Clock::now()).count());
    absl::StatusOr<ChangeWatcher::Event> ev = watcher_->Wait(left);
    if (!ev.ok()) {
      check = true;  // notifications may have been lost with the connection
      continue;
    }
    switch (ev->kind) {
      case ChangeWatcher::Event::kNotified: {
        absl::MutexLock wlock(&write_mu_);
        // Our own writes are announced too; those are in memory already.
        check = ev->generation > store_generation_;
        break;
      }
      case ChangeWatcher::Event::kTimeout:
      case ChangeWatcher::Event::kInterrupted:
        check = true;
        break;
    }
  }
}

absl::Status Registry::CheckBackwardLinks(const OpDef& def) const {
  absl::ReaderMutexLock lock(&mu_);
  if (!def.backward.op.empty()) {
    auto it = ops_.find({def.ns, def.backward.op});
    if (it != ops_.end() && !it->second.versions.empty()) {
      OPJIT_RETURN_IF_ERROR(CheckBpropSignature(def, it->second.versions.rbegin()->second->def));
    }
  }
  for (auto it = ops_.lower_bound({def.ns, ""}); it != ops_.end() && it->first.first == def.ns;
       ++it) {
    if (it->first.second == def.name || it->second.versions.empty()) continue;
    const OpDef& fwd = it->second.versions.rbegin()->second->def;
    if (fwd.backward.op == def.name) OPJIT_RETURN_IF_ERROR(CheckBpropSignature(fwd, def));
  }
  return absl::OkStatus();
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
      out.push_back(absl::StrCat("backward.op: \"", def.backward.op,
                                 "\" is not a registered op in namespace \"", def.ns,
                                 "\"; the op is registered, but its backward fails until \"",
                                 def.backward.op, "\" is registered"));
    }
  }
  // No rule and no InferShape (OpService stores infer_shape rules for a CPU
  // kernel that exports one): say which rule is assumed, never a silent guess.
  if (def.output_rules.empty() && !def.outputs.empty() && !def.inputs.empty()) {
    std::string why = "no kernel exports <entry>InferShape";
    for (const Implementation& impl : def.implementations) {
      if (impl.target == Target::kCpu) {
        why = absl::StrCat("the CPU kernel exports no \"", impl.entry, "InferShape\"");
        break;
      }
      why = "GPU kernels have no InferShape";
    }
    out.push_back(absl::StrCat(
        "output_rules: none given, and ", why, ", so every output takes the shape of input 0 (\"",
        def.inputs[0].name, "\") and its dtype from dtype_formats; give output_rules to say so "
        "(e.g. [{\"kind\": \"same_as\", \"input\": 0}])"));
  }
  return out;
}

size_t Registry::Size() const {
  absl::ReaderMutexLock lock(&mu_);
  return ops_.size();
}

}  // namespace opjit::registry
