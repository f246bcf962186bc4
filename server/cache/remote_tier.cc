#include "server/cache/remote_tier.h"

#include <hiredis/hiredis.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <sys/time.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace opjit::cache {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMagic[4] = {'O', 'P', 'J', 'R'};
constexpr uint32_t kFormatVersion = 1;
constexpr size_t kMacBytes = 32;
// magic, version, payload length, HMAC.
constexpr size_t kHeaderBytes = 4 + 4 + 8 + kMacBytes;
constexpr size_t kPrefixBytes = 16;  // the part of the header the MAC covers
// Connections kept for reuse; more are made under load and closed after.
constexpr size_t kMaxIdle = 8;
// Read buffer a connection keeps between replies (hiredis' default: 16 KiB).
constexpr size_t kReaderBufferBytes = 1 << 20;

// Debian's absl::string_view is not std::string_view.
absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

bool ValidKind(std::string_view kind) {
  if (kind.empty() || kind.size() > 32) return false;
  return std::all_of(kind.begin(), kind.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

bool ValidKey(std::string_view key) {
  if (key.size() < 16 || key.size() > 128) return false;
  return std::all_of(key.begin(), key.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

void PutLe(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetLe(std::string_view in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<unsigned char>(in[at + i])} << (8 * i);
  return v;
}

std::string Prefix(uint64_t payload_bytes) {
  std::string p(kMagic, sizeof(kMagic));
  PutLe(&p, kFormatVersion, 4);
  PutLe(&p, payload_bytes, 8);
  return p;
}

// HMAC-SHA256(key, prefix | field(kind) | field(key) | field(payload)), where
// field(x) is x's u64 length, then x: no two (kind, key, payload) triples feed
// the MAC the same bytes.
std::string Mac(std::string_view cluster_key, std::string_view prefix, std::string_view kind,
                std::string_view key, std::string_view payload) {
  std::string out(kMacBytes, '\0');
  EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  EVP_MAC_CTX* ctx = mac ? EVP_MAC_CTX_new(mac) : nullptr;
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                         OSSL_PARAM_construct_end()};
  bool ok = ctx && EVP_MAC_init(ctx, reinterpret_cast<const unsigned char*>(cluster_key.data()),
                                cluster_key.size(), params) == 1;
  auto update = [&](std::string_view s) {
    ok = ok && EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(s.data()), s.size()) == 1;
  };
  auto field = [&](std::string_view s) {
    std::string len;
    PutLe(&len, s.size(), 8);
    update(len);
    update(s);
  };
  update(prefix);
  field(kind);
  field(key);
  field(payload);
  size_t n = 0;
  ok = ok && EVP_MAC_final(ctx, reinterpret_cast<unsigned char*>(out.data()), &n, out.size()) == 1 &&
       n == kMacBytes;
  EVP_MAC_CTX_free(ctx);
  EVP_MAC_free(mac);
  // An HMAC that cannot be computed never verifies: a random-looking value
  // would, for an all-zero MAC, be forgeable.
  if (!ok) out.clear();
  return out;
}

absl::Status ParseUrl(const std::string& url, bool* unix_socket, std::string* host, int* port) {
  const auto bad = [] {
    return absl::InvalidArgumentError(
        "cache.remote url must be redis://host[:port] or unix:/absolute/path.sock");
  };
  if (absl::StartsWith(url, "unix:")) {
    std::string path = url.substr(5);
    if (path.size() < 2 || path[0] != '/' || path.find('\0') != std::string::npos) return bad();
    *unix_socket = true;
    *host = path;
    *port = 0;
    return absl::OkStatus();
  }
  if (!absl::StartsWith(url, "redis://")) return bad();
  std::string rest = url.substr(8);
  std::string port_text;
  if (!rest.empty() && rest[0] == '[') {  // [v6 literal]:port
    const size_t close = rest.find(']');
    if (close == std::string::npos) return bad();
    *host = rest.substr(1, close - 1);
    std::string after = rest.substr(close + 1);
    if (!after.empty()) {
      if (after[0] != ':') return bad();
      port_text = after.substr(1);
      if (port_text.empty()) return bad();
    }
    if (host->empty() || !std::all_of(host->begin(), host->end(), [](char c) {
          return absl::ascii_isxdigit(c) || c == ':' || c == '.';
        })) {
      return bad();
    }
  } else {
    const size_t colon = rest.find(':');
    *host = rest.substr(0, colon);
    if (colon != std::string::npos) {
      port_text = rest.substr(colon + 1);
      if (port_text.empty()) return bad();
    }
    if (host->empty() || !std::all_of(host->begin(), host->end(), [](char c) {
          return absl::ascii_isalnum(c) || c == '.' || c == '-' || c == '_';
        })) {
      return bad();
    }
  }
  *port = 6379;
  if (!port_text.empty()) {
    if (!std::all_of(port_text.begin(), port_text.end(), absl::ascii_isdigit) ||
        port_text.size() > 5 || !absl::SimpleAtoi(port_text, port) || *port < 1 ||
        *port > 65535) {
      return bad();
    }
  }
  *unix_socket = false;
  return absl::OkStatus();
}

timeval ToTimeval(int64_t ms) {
  timeval tv;
  tv.tv_sec = ms / 1000;
  tv.tv_usec = (ms % 1000) * 1000;
  return tv;
}

std::chrono::milliseconds Backoff(int failures) {
  auto b = RemoteTier::kFirstBackoff;
  for (int i = 1; i < failures && b < RemoteTier::kMaxBackoff; ++i) b *= 2;
  return std::min(b, RemoteTier::kMaxBackoff);
}

}  // namespace

std::string RemoteTier::RedisKey(std::string_view kind, std::string_view key) {
  return absl::StrCat("opjit:v1:", Av(kind), ":", Av(key));
}

namespace {

// Fills the header of `value` (kHeaderBytes of room, then the payload).
void SealInPlace(std::string_view cluster_key, std::string_view kind, std::string_view key,
                 std::string* value) {
  const std::string_view payload = std::string_view(*value).substr(kHeaderBytes);
  const std::string prefix = Prefix(payload.size());
  const std::string mac = Mac(cluster_key, prefix, kind, key, payload);
  value->replace(0, kPrefixBytes, prefix);
  // An empty MAC (OpenSSL failed) leaves zeros, which never verify.
  value->replace(kPrefixBytes, mac.size(), mac);
}

std::string Unsealed(std::string_view payload) {
  std::string value(kHeaderBytes, '\0');
  value.append(payload.data(), payload.size());
  return value;
}

}  // namespace

std::string RemoteTier::Seal(std::string_view cluster_key, std::string_view kind,
                             std::string_view key, std::string_view payload) {
  std::string value = Unsealed(payload);
  SealInPlace(cluster_key, kind, key, &value);
  return value;
}

bool RemoteTier::Open(std::string_view kind, std::string_view key, std::string_view value,
                      std::string* payload, std::string* why) const {
  if (value.size() < kHeaderBytes) {
    *why = absl::StrCat("shorter than the header (", value.size(), " bytes)");
    return false;
  }
  if (std::memcmp(value.data(), kMagic, sizeof(kMagic)) != 0) {
    *why = "bad magic";
    return false;
  }
  if (GetLe(value, 4, 4) != kFormatVersion) {
    *why = absl::StrCat("format version ", GetLe(value, 4, 4));
    return false;
  }
  const uint64_t length = GetLe(value, 8, 8);
  if (length != value.size() - kHeaderBytes) {
    *why = absl::StrCat("length ", length, " but ", value.size() - kHeaderBytes, " payload bytes");
    return false;
  }
  const std::string_view body = value.substr(kHeaderBytes);
  const std::string want = Mac(options_.key, value.substr(0, kPrefixBytes), kind, key, body);
  if (want.size() != kMacBytes ||
      CRYPTO_memcmp(want.data(), value.data() + kPrefixBytes, kMacBytes) != 0) {
    *why = "HMAC mismatch (another cluster key, another key or kind, or altered)";
    return false;
  }
  payload->assign(body.data(), body.size());
  return true;
}

absl::StatusOr<std::unique_ptr<RemoteTier>> RemoteTier::Create(const RemoteTierOptions& options) {
  auto log = Logger("cache");
  if (options.url.empty()) return absl::InvalidArgumentError("cache.remote url is empty");
  bool unix_socket = false;
  std::string host;
  int port = 0;
  if (absl::Status s = ParseUrl(options.url, &unix_socket, &host, &port); !s.ok()) {
    log->error("remote cache tier: cannot use url \"{}\"", options.url);
    return s;
  }
  if (options.key.size() < 16) {
    return absl::InvalidArgumentError("cache.remote key must be at least 16 bytes");
  }
  if (options.timeout_ms <= 0) {
    return absl::InvalidArgumentError("cache.remote timeout_ms must be positive");
  }
  if (options.ttl_s < 0) return absl::InvalidArgumentError("cache.remote ttl_s must be >= 0");
  std::unique_ptr<RemoteTier> tier(new RemoteTier(options));
  tier->unix_ = unix_socket;
  tier->host_ = host;
  tier->port_ = port;
  tier->log_ = log;
  tier->writer_ = std::thread([t = tier.get()] { t->WriterLoop(); });
  log->info("remote cache tier: {} (timeout {} ms, entries up to {} MiB, ttl {} s)", options.url,
            options.timeout_ms, options.max_bytes >> 20, options.ttl_s);
  return tier;
}

RemoteTier::RemoteTier(const RemoteTierOptions& options) : options_(options) {}

RemoteTier::~RemoteTier() {
  {
    absl::MutexLock lock(&queue_mu_);
    stop_ = true;
    queue_cv_.SignalAll();
  }
  if (writer_.joinable()) writer_.join();
  absl::MutexLock lock(&conn_mu_);
  for (Connection& c : idle_) redisFree(c.ctx);
  idle_.clear();
}

RemoteTier::Connection RemoteTier::Acquire() {
  {
    absl::MutexLock lock(&conn_mu_);
    if (!idle_.empty()) {
      Connection c = idle_.back();
      idle_.pop_back();
      return c;
    }
    const auto now = Clock::now();
    if (now < retry_at_) return {};
    // Recovering: this call is the probe; others miss at once until it
    // succeeds (Release resets the backoff) or fails (a longer one).
    if (consecutive_failures_ > 0) retry_at_ = now + Backoff(consecutive_failures_);
  }
  const timeval tv = ToTimeval(options_.timeout_ms);
  redisContext* ctx = unix_ ? redisConnectUnixWithTimeout(host_.c_str(), tv)
                            : redisConnectWithTimeout(host_.c_str(), port_, tv);
  if (ctx == nullptr || ctx->err != 0 || redisSetTimeout(ctx, tv) != REDIS_OK) {
    std::string why = ctx == nullptr ? "out of memory" : ctx->errstr;
    if (ctx != nullptr) redisFree(ctx);
    RecordFailure(absl::StrCat("connect: ", why));
    return {};
  }
  // Keep a connection's read buffer (up to kReaderBufferBytes) between
  // replies instead of freeing and regrowing it for every one: on a VM each
  // regrowth is page faults and TLB flushes, ~50x the GET itself at 64 KiB.
  ctx->reader->maxbuf = kReaderBufferBytes;
  absl::MutexLock lock(&conn_mu_);
  return {ctx, generation_};
}

void RemoteTier::Release(Connection c, bool ok, const std::string& what) {
  if (!ok) {
    redisFree(c.ctx);
    RecordFailure(what);
    return;
  }
  bool recovered = false;
  {
    absl::MutexLock lock(&conn_mu_);
    recovered = consecutive_failures_ > 0;
    consecutive_failures_ = 0;
    contacted_ = true;
    retry_at_ = {};
    if (c.generation == generation_ && idle_.size() < kMaxIdle) {
      idle_.push_back(c);
      c.ctx = nullptr;
    }
  }
  if (c.ctx != nullptr) redisFree(c.ctx);
  if (recovered) log_->info("remote cache tier: {} answers again", options_.url);
}

void RemoteTier::RecordFailure(const std::string& what) {
  errors_.fetch_add(1);
  std::vector<Connection> stale;
  std::chrono::milliseconds backoff;
  {
    absl::MutexLock lock(&conn_mu_);
    ++generation_;
    stale.swap(idle_);
    ++consecutive_failures_;
    contacted_ = true;
    backoff = Backoff(consecutive_failures_);
    retry_at_ = Clock::now() + backoff;
  }
  for (Connection& c : stale) redisFree(c.ctx);
  uint64_t suppressed = 0;
  if (error_log_.Allow(&suppressed)) {
    log_->warn("remote cache tier: {} failed ({}); treating it as a miss, next try in {} ms{}",
               options_.url, what, backoff.count(),
               suppressed ? absl::StrCat(" (", suppressed, " similar suppressed)") : "");
  }
}

absl::StatusOr<std::string> RemoteTier::Get(std::string_view kind, std::string_view key) {
  if (!ValidKind(kind)) return absl::InvalidArgumentError("malformed cache kind");
  if (!ValidKey(key)) return absl::InvalidArgumentError("malformed cache key");
  const auto miss = [this] {
    misses_.fetch_add(1);
    return absl::NotFoundError("not in the shared cache");
  };
  Connection c = Acquire();
  if (c.ctx == nullptr) return miss();
  const std::string rkey = RedisKey(kind, key);
  auto* reply = static_cast<redisReply*>(redisCommand(c.ctx, "GET %b", rkey.data(), rkey.size()));
  if (reply == nullptr) {
    Release(c, false, absl::StrCat("GET: ", c.ctx->errstr));
    return miss();
  }
  std::string payload, why;
  bool hit = false, rejected = false;
  if (reply->type == REDIS_REPLY_STRING) {
    hit = Open(kind, key, std::string_view(reply->str, reply->len), &payload, &why);
    rejected = !hit;
  } else if (reply->type == REDIS_REPLY_ERROR) {
    // Redis answered, so the connection is fine; the entry is not usable.
    errors_.fetch_add(1);
    log_->debug("remote cache tier: GET {}: {}", rkey, std::string(reply->str, reply->len));
  }
  freeReplyObject(reply);
  Release(c, true, "");
  if (rejected) {
    rejected_.fetch_add(1);
    uint64_t suppressed = 0;
    if (reject_log_.Allow(&suppressed)) {
      log_->warn("remote cache tier: entry {}:{} rejected: {}; treated as a miss{}", kind,
                 key.substr(0, 12), why,
                 suppressed ? absl::StrCat(" (", suppressed, " more suppressed)") : "");
    }
  }
  if (!hit) return miss();
  hits_.fetch_add(1);
  return payload;
}

bool RemoteTier::BackingOff() const {
  absl::MutexLock lock(&conn_mu_);
  return idle_.empty() && Clock::now() < retry_at_;
}

bool RemoteTier::Put(std::string_view kind, std::string_view key, std::string_view payload) {
  if (!ValidKind(kind) || !ValidKey(key)) return false;
  if (payload.size() > options_.max_bytes) {
    oversize_.fetch_add(1);
    log_->debug("remote cache tier: {}:{} not shared: {} bytes is over the {} byte limit", kind,
                key.substr(0, 12), payload.size(), options_.max_bytes);
    return false;
  }
  if (BackingOff()) {
    dropped_.fetch_add(1);
    return false;
  }
  const auto fits = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(queue_mu_) {
    return !stop_ && queue_.size() < kMaxQueuedPuts &&
           queued_bytes_ + payload.size() <= QueueByteLimit();
  };
  {
    absl::MutexLock lock(&queue_mu_);
    if (!fits()) {
      dropped_.fetch_add(1);
      return false;
    }
  }
  // The copy (up to max_bytes) is made outside the lock; the one sealed
  // value is what the writer sends.
  PendingPut p{std::string(kind), std::string(key), Unsealed(payload)};
  absl::MutexLock lock(&queue_mu_);
  if (!fits()) {
    dropped_.fetch_add(1);
    return false;
  }
  queue_.push_back(std::move(p));
  queued_bytes_ += payload.size();
  ++enqueued_;
  queue_cv_.Signal();
  return true;
}

uint64_t RemoteTier::QueueByteLimit() const {
  return std::max<uint64_t>(4 * options_.max_bytes, kMinQueuedBytes);
}

void RemoteTier::Flush() {
  absl::MutexLock lock(&queue_mu_);
  const uint64_t target = enqueued_;
  while (done_ < target) done_cv_.Wait(&queue_mu_);
}

void RemoteTier::WriterLoop() {
  for (;;) {
    PendingPut p;
    {
      absl::MutexLock lock(&queue_mu_);
      while (!stop_ && queue_.empty()) queue_cv_.Wait(&queue_mu_);
      if (queue_.empty()) return;  // stopping, and everything was written
      p = std::move(queue_.front());
      queue_.pop_front();
      queued_bytes_ -= p.value.size() - kHeaderBytes;
    }
    Write(p);
    absl::MutexLock lock(&queue_mu_);
    ++done_;
    done_cv_.SignalAll();
  }
}

void RemoteTier::Write(PendingPut& p) {
  Connection c = Acquire();
  if (c.ctx == nullptr) {
    dropped_.fetch_add(1);
    return;
  }
  const std::string rkey = RedisKey(p.kind, p.key);
  SealInPlace(options_.key, p.kind, p.key, &p.value);
  const std::string& value = p.value;
  void* r = options_.ttl_s > 0
                ? redisCommand(c.ctx, "SET %b %b EX %lld", rkey.data(), rkey.size(), value.data(),
                               value.size(), static_cast<long long>(options_.ttl_s))
                : redisCommand(c.ctx, "SET %b %b", rkey.data(), rkey.size(), value.data(),
                               value.size());
  auto* reply = static_cast<redisReply*>(r);
  if (reply == nullptr) {
    dropped_.fetch_add(1);
    Release(c, false, absl::StrCat("SET: ", c.ctx->errstr));
    return;
  }
  if (reply->type == REDIS_REPLY_ERROR) {
    // E.g. OOM under maxmemory: Redis is up, this entry is just not stored.
    errors_.fetch_add(1);
    dropped_.fetch_add(1);
    uint64_t suppressed = 0;
    if (error_log_.Allow(&suppressed)) {
      log_->warn("remote cache tier: SET {}: {}", rkey, std::string(reply->str, reply->len));
    }
  } else {
    puts_.fetch_add(1);
  }
  freeReplyObject(reply);
  Release(c, true, "");
}

RemoteTierStats RemoteTier::Stats() const {
  RemoteTierStats s;
  s.hits = hits_.load();
  s.misses = misses_.load();
  s.rejected = rejected_.load();
  s.errors = errors_.load();
  s.puts = puts_.load();
  s.dropped = dropped_.load();
  s.oversize = oversize_.load();
  absl::MutexLock lock(&conn_mu_);
  s.consecutive_failures = consecutive_failures_;
  s.contacted = contacted_;
  return s;
}

}  // namespace opjit::cache
