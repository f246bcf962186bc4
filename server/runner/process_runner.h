// ProcessRunner: kernels run in sandboxed opjit-exec-worker processes.
//
// [exec] isolation = "process", the default. Every line of user code
// (Init, InferShape, the kernel, KernelData destructors, GPU modules and
// their CUDA context) runs in a worker; opjitd never maps user code.
//
// Pools. Workers belong to one namespace: kernels of two namespaces never
// share a process. A pool starts workers on demand, up to
// `workers_per_namespace`, and stops those idle for `idle_ms` (Maintain()).
//
// Tensors stay zero-copy: shm regions are handed to a worker as file
// descriptors and mapped there (once per worker, by region serial); inline
// tensors go through the worker's arena. See worker_protocol.h.
//
// Failures. A worker that dies (signal, exit) fails only the call it ran,
// with ABORTED naming the signal, and is replaced on the next call (Init
// runs again there). A call past its deadline or the kernel time limit
// gets its worker killed (DEADLINE_EXCEEDED), which frees the CPU at once.
// A kernel that kills its worker `quarantine_after` times in a row on one
// caller's calls (Caller: crashes are counted per kernel and caller
// principal) is quarantined for that caller: its calls answer
// FAILED_PRECONDITION, other callers' still run. Once
// `quarantine_callers` distinct principals that are not readers have it
// quarantined, it is for everyone. Either lasts until the op is registered
// again (a new version is a new instance label, and registering any
// version, even the identical one, lifts it), or an admin lifts it. An idle
// worker found dead when a call takes it (killed from outside) is replaced
// and counts against no kernel.
// Only crashes that are the kernel's count: a SIGBUS on a region its
// client shrank is the client's (FAILED_PRECONDITION, REGION_TOO_SMALL),
// and a worker that dies after serving other instances gets the call run
// once more in a fresh worker; only a crash there counts.
//
// Seams. Every executor process is started through
// ProcessRunnerOptions::spawn (subprocess::Spawn unless a test puts a
// recorder or a failure there), and idle time is read from
// ProcessRunnerOptions::clock, so tests check what the runner asks for and
// how it answers a failed start without root, and step time instead of
// sleeping (tests/unit/runner/process_runner_seam_test.cc).
//
// Thread-safety: all methods are thread-safe.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/common/clock.h"
#include "server/common/subprocess.h"
#include "server/runner/kernel_host.h"
#include "server/runner/kernel_runner.h"

namespace opjit::runner {

// How ProcessRunner starts one executor process (a pool worker or a fast
// channel's): given everything the process gets (program, arguments,
// environment, descriptors, namespaces, ids), it returns the pid of a child
// of this process, which the runner then talks to, ends and reaps with
// subprocess::Reap; or UNAVAILABLE, whose message the runner passes on to
// the caller (so it names no host path, as subprocess::Spawn's does not).
// Called from several threads at once, never on a call's hot path (only
// when a worker starts).
using ExecutorSpawn = std::function<absl::StatusOr<pid_t>(const subprocess::SpawnOptions&)>;

struct ProcessRunnerOptions {
  // The opjit-exec-worker binary. Required.
  std::string worker_path;
  // Workers per namespace, at most. Default: 2.
  int workers_per_namespace = 2;
  // A worker idle this long is stopped by Maintain(). Default: 60 s.
  int64_t idle_ms = 60000;
  // A kernel call (or Init, or InferShape) running longer is killed.
  // Default: 60 s.
  int64_t kernel_timeout_ms = 60000;
  // A worker's memory (RLIMIT_DATA). Memory it could hold outside that
  // limit (memfd, System V shm, shared anonymous mappings) is refused, so
  // this, with scratch_bytes, bounds it; a namespace holds at most
  // workers_per_namespace (plus its fast channels) times that.
  // Default: 4 GiB.
  uint64_t memory_bytes = 4ull << 30;
  // Started as root, workers switch to this uid/gid. -1: keep. Ignored
  // when uid_first is set.
  int64_t uid = -1, gid = -1;
  // Started as root: each namespace's workers (pool and fast channel) run
  // as a uid of their own from [uid_first, uid_last], and the gid of the
  // same number, with no supplementary groups. A namespace takes the lowest
  // free uid on its first worker (claim_uid says which are free) and keeps
  // it for the runner's life; two namespaces never share one. Its scratch
  // directory is that uid's, mode 0700. When the range is used up, a new
  // namespace's spawn fails with RESOURCE_EXHAUSTED. 0: off (all namespaces
  // use uid/gid).
  uint32_t uid_first = 0, uid_last = 0;
  // With uid_first: takes the uid for a new namespace, the lowest of
  // [first, last] free host-wide (the daemon: UidClaims::Claim, so that no
  // two daemons on one host give their tenants one uid), or the status that
  // refuses the namespace (RESOURCE_EXHAUSTED when every uid is taken).
  // Called under the runner's lock, once per namespace. Empty: the runner
  // counts alone, uid_first + k for its k-th namespace (tests).
  std::function<absl::StatusOr<uint32_t>(uint32_t first, uint32_t last)> claim_uid;
  // With uid_first: the gid of the namespace that takes uid_first + k is
  // gid_first + k. 0: the gid of the same number as the uid. A daemon
  // without root sets both from its user's subordinate ids
  // (server/common/subordinate_ids.h); its workers then start in user
  // namespaces of their own whose uid 0 is that uid
  // (subprocess::SpawnOptions::user_namespace).
  uint32_t gid_first = 0;
  // Threads a worker may keep while no call runs in it. A pool worker that
  // has more when its call ends is stopped (its call answers
  // RESOURCE_EXHAUSTED, as the worker itself checks); an idle pool worker
  // and a fast channel's executor are counted every thread_watch_ms (one
  // fstat of /proc/<pid>/task each, by the runner's watcher thread and the
  // channel's own thread, never on a call's path), and one over the cap is
  // stopped there (a channel closes; a call that had just begun in it goes
  // back to its client to run again), counted in
  // RunnerStats::thread_cap_stops and charged to no kernel. 0: unchecked.
  // Default: 256.
  int threads_per_executor = 256;
  // How often idle executors' threads are counted, ms. Default: 100.
  int64_t thread_watch_ms = 100;
  // Threads and processes of all a namespace's workers together:
  // RLIMIT_NPROC, which counts per uid, so it is set only with uid_first.
  // Default: 1024.
  int threads_per_namespace = 1024;
  // Each worker in namespaces of its own (subprocess::PidNamespaces(): a
  // root daemon): PID, mount, IPC, network and UTS. It sees no other
  // process, has no network, and its scratch directory is a tmpfs of
  // scratch_bytes that only it sees and that goes with it. Without (a
  // non-root daemon), its scratch directory is a host directory of its own,
  // each file at most scratch_bytes (RLIMIT_FSIZE), removed when it is
  // reaped. Default: true.
  bool private_namespaces = true;
  // The memory of all of a namespace's workers together (heap, scratch
  // tmpfs, page cache), through a cgroup (memory_cgroups.h) where one is
  // writable; past it the kernel's OOM killer ends one of them. 0: none.
  // Default: 16 GiB.
  uint64_t namespace_memory_bytes = 16ull << 30;
  // A worker's scratch space. Default: 64 MiB.
  uint64_t scratch_bytes = 64ull << 20;
  // Busy-wait (yielding) of a worker for its next call before it sleeps.
  // Spinning makes the hop ~3 us instead of a ~20 us wake-up, but on a host
  // with few cores the spinner takes CPU the gRPC threads need (measured on
  // 2 cores: slower calls), so it is off by default. Default: 0.
  int64_t spin_us = 0;
  // Busy-wait (yielding) of the daemon for a call's result before it sleeps.
  // Default: 50 us.
  int64_t wait_spin_us = 50;
  // Crashes in a row of one caller's calls after which a kernel is
  // quarantined for that caller. Default: 3.
  int quarantine_after = 3;
  // Distinct callers, readers not counted, for whom a kernel must be
  // quarantined before it is quarantined for everyone. Default: 2.
  int quarantine_callers = 2;
  // Room for one call's inline tensors (inputs and outputs), per worker;
  // sparse, so only what calls use is memory. Default: 160 MiB.
  uint64_t arena_bytes = 160ull << 20;
  // Libraries kernels may use, and the GPU scratch directory.
  KernelHostOptions host;
  // Extra read-only paths in the worker sandbox (allowed libraries' dirs).
  std::vector<std::string> read_only_paths;
  // Starts executor processes. Empty: subprocess::Spawn. Tests record the
  // SpawnOptions and still run the real worker, or make a start fail or
  // hand back a process that dies at once.
  ExecutorSpawn spawn;
  // The time idle_ms is measured on (when a worker was last used, and
  // Maintain()'s now). Null: SteadyClock(). Call deadlines and the kernel
  // time limit always use the steady clock. Not owned; outlives the runner.
  const Clock* clock = nullptr;
};

class ProcessRunner : public KernelRunner {
 public:
  // Checks the options and the worker binary; starts no worker yet.
  // INVALID_ARGUMENT for bad options, NOT_FOUND without the worker binary.
  static absl::StatusOr<std::unique_ptr<ProcessRunner>> Create(const ProcessRunnerOptions& options);
  // Kills every worker.
  ~ProcessRunner() override;

  absl::StatusOr<std::shared_ptr<KernelInstance>> Instance(const InstanceSpec& spec) override;
  RunnerStats Stats() const override;
  const char* mode() const override { return "process"; }
  // A dedicated executor process for one client's fast channel; counts
  // against nothing here (the caller limits channels).
  absl::StatusOr<std::shared_ptr<Channel>> OpenChannel(const ChannelSpec& spec) override;
  // Stops workers idle for longer than idle_ms.
  void Maintain() override;
  int LiftQuarantine(const std::string& op) override;

  struct Impl;

 private:
  explicit ProcessRunner(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace opjit::runner
