// The client side of the same-host fast path: a mapped fast channel (the
// slot ring of proto/opjit/wire/fast_channel.h, served by an executor process
// of one namespace) and the per-Client state that lets Client::Forward run
// calls on it transparently (prepared handles by call shape, region ids,
// open channels).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/cpp/opjit_client.h"
#include "proto/opjit/wire/fast_channel.h"
#include "server/common/mutex.h"

namespace opjit::client {

// Fast-path modes (ClientOptions::fast).
enum class FastMode { kAuto, kOn, kOff };

// "on"/"1"/"true", "off"/"0"/"false", "auto" or empty (auto). Unknown words:
// INVALID_ARGUMENT.
absl::StatusOr<FastMode> ParseFastMode(const std::string& text);

// One open fast channel. Thread-safe: up to `slots` calls run at once, one
// per slot; more wait for a free slot.
class FastChannel {
 public:
  // Maps the channel OpenChannel answered. The mapping is unmapped on
  // destruction (the shm object belongs to the daemon's region).
  static absl::StatusOr<std::unique_ptr<FastChannel>> Map(const v1::OpenChannelResponse& info);
  ~FastChannel();
  FastChannel(const FastChannel&) = delete;
  FastChannel& operator=(const FastChannel&) = delete;

  // The outcome of one call.
  struct Result {
    absl::Status status;   // the executor's reply (code, message, reason)
    double kernel_ms = 0;  // when ok
    // The call never ran: the channel closed (or its executor died) while
    // the call was still waiting to be taken. Safe to retry on a new channel.
    bool not_run = false;
  };

  // Runs one call: `tensors` are the handle's inputs then its outputs.
  // `deadline_ns` is CLOCK_MONOTONIC (0: none). `flags`: Slot::flags
  // (fast::kKeepOutputBytes). Blocks until the reply.
  Result Call(uint64_t handle, std::span<const FastTensorRef> tensors, int64_t deadline_ns,
              uint32_t flags = 0);

  // The daemon closed the channel (executor gone, region released), or a
  // call found it dead: it takes no more calls.
  bool closed() const;
  const std::string& region() const { return info_.region(); }
  int32_t worker_pid() const { return info_.worker_pid(); }
  uint32_t max_tensors() const { return max_tensors_; }

 private:
  FastChannel(v1::OpenChannelResponse info, void* base, uint32_t slots, uint32_t max_tensors);
  int TakeSlot();
  void GiveSlot(int slot);
  bool WorkerGone() const;

  const v1::OpenChannelResponse info_;
  void* const base_;
  const uint32_t slots_;
  const uint32_t max_tensors_;
  const int64_t spin_ns_;

  Mutex mu_;
  CondVar slot_freed_;
  std::vector<int> free_ ABSL_GUARDED_BY(mu_);  // slots this process may take
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  // Set when a call gave up on a slot that the executor may still write (a
  // lost executor): the channel is not used again.
  std::atomic<bool> broken_{false};
  // opjitd (info_.daemon_pid): once it exits, nobody answers a call waiting
  // on this ring.
  const fast::ProcessWatch daemon_;
};

// What a Client keeps for the fast path.
struct FastState {
  FastMode mode = FastMode::kAuto;
  // The daemon the fast path would reach is on a unix socket (with several
  // addresses: the home daemon, once chosen).
  std::atomic<bool> unix_socket{false};

  Mutex mu;
  // Prepared handles by call shape (see ShapeKey in fast_call.cc).
  std::map<std::string, std::shared_ptr<const PreparedCall>> handles ABSL_GUARDED_BY(mu);
  // Region ids of this client's regions: ns -> name -> id.
  std::map<std::string, std::map<std::string, uint64_t>> region_ids ABSL_GUARDED_BY(mu);
  // Names of regions in each ns that are not this client's (they go over gRPC).
  std::map<std::string, std::map<std::string, bool>> foreign_regions ABSL_GUARDED_BY(mu);
  // Open channels by namespace.
  std::map<std::string, std::shared_ptr<FastChannel>> channels ABSL_GUARDED_BY(mu);
  // Namespaces where OpenChannel was refused (auto mode stays on gRPC there).
  std::map<std::string, absl::Status> no_channel ABSL_GUARDED_BY(mu);
  // Serializes channel opening (one OpenChannel per namespace at a time).
  Mutex open_mu ABSL_ACQUIRED_BEFORE(mu);
};

}  // namespace opjit::client
