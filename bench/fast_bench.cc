// The same-host fast path against gRPC and against raw floors, side by side
// in one run (the sides alternate in short batches, so all see the same
// machine state):
//   - tiny call (leaky_relu on 16 float32, tensors in shm) from C++:
//       fast:      Client::Forward picking the fast channel itself;
//       fast_raw:  Client::CallPrepared on a prepared handle (no protobuf);
//       grpc:      Client::Forward over the unix socket (fast = off);
//     against two floors of our own between two processes (this one and a
//     forked child): a one-byte socketpair ping-pong, and a shared-memory
//     slot ping-pong that spins up to 20 µs before a futex wait;
//   - 1 MiB and 64 MiB calls through shm: the call against the kernel's own
//     kernel_ms: Client::Forward on the fast channel, CallPrepared with the
//     output zero-filled (the default) and with keep_output_bytes, and gRPC;
//   - 8 clients (threads, each its own Client, region and channel): calls/s,
//     fast against gRPC;
//   - CPU burned (user + system seconds per second of wall time) by the
//     daemon, the executor processes and this client process: idle (2 s, no
//     calls, channels open), at 1 client and at 8 clients.
//
//   fast_bench [OUT.json] [OPJITD]
//
// Starts its own opjitd (OPJITD, default: next to this binary) in a temp
// state dir; FAST_BENCH_EXEC="key = value; ..." adds [exec] settings.
// Channel calls draw credit from [quota] calls_per_second like gRPC calls:
// FAST_BENCH_QUOTA sets it (default 1e7: never reached here, and the
// smallest batch of credit a busy namespace gets, 64 calls, so the cost of
// asking for credit is in the numbers; 0 is no bound, 4096-call batches).
// FAST_BENCH_COMPARE=OPJITD2 starts a second daemon from another build (say,
// the one before a change) and adds its fast sides to the tiny calls'
// alternation, so both builds are measured side by side in one run.
// Prints a markdown table (medians and ratios) and writes the raw numbers to
// OUT.json. A part that fails is reported as such; no number is made up.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/proc_cpu.h"
#include "client/cpp/opjit_client.h"
#include "client/cpp/shm_region.h"
#include "proto/opjit/wire/fast_channel.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
namespace v1 = opjit::v1;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
using opjit::client::Client;

constexpr int kTinyFloats = 16;
constexpr int64_t kFloorSpinNs = 20'000;  // the shm floor's spin before its futex wait

double UsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

using opjit::bench::CpuSeconds;

double SelfCpuSeconds() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// ---------------------------------------------------------------------------
// The floors: two processes (this one and a forked child) ping-ponging.

// One byte each way over a socketpair.
class SocketFloor {
 public:
  bool Start() {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return false;
    pid_ = fork();
    if (pid_ < 0) return false;
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      close(sv[0]);
      char c;
      while (read(sv[1], &c, 1) == 1) {
        if (write(sv[1], &c, 1) != 1) break;
      }
      _exit(0);
    }
    close(sv[1]);
    fd_ = sv[0];
    return true;
  }
  bool Call() {
    char c = 1;
    return write(fd_, &c, 1) == 1 && read(fd_, &c, 1) == 1;
  }
  ~SocketFloor() {
    if (fd_ >= 0) close(fd_);
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }

 private:
  int fd_ = -1;
  pid_t pid_ = -1;
};

// A shared-memory slot: the waiting side spins up to kFloorSpinNs on the
// word, then sleeps on it with FUTEX_WAIT after announcing itself.
class ShmFloor {
 public:
  struct Words {
    std::atomic<uint32_t> req, resp, child_sleeping, parent_sleeping;
  };
  static constexpr uint32_t kStop = 0xffffffffu;

  bool Start() {
    void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return false;
    w_ = new (p) Words{};
    pid_ = fork();
    if (pid_ < 0) return false;
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      uint32_t seen = 0;
      for (;;) {
        seen = Await(w_->req, seen, w_->child_sleeping);
        if (seen == kStop) _exit(0);
        Signal(w_->resp, seen, w_->parent_sleeping);
      }
    }
    return true;
  }
  void Call() {
    const uint32_t seq = ++seq_;
    Signal(w_->req, seq, w_->child_sleeping);
    while (Await(w_->resp, seq - 1, w_->parent_sleeping) != seq) {
    }
  }
  ~ShmFloor() {
    if (pid_ > 0) {
      Signal(w_->req, kStop, w_->child_sleeping);
      waitpid(pid_, nullptr, 0);
    }
  }

 private:
  // Waits until `word` differs from `old`; returns its value.
  static uint32_t Await(std::atomic<uint32_t>& word, uint32_t old, std::atomic<uint32_t>& sleeping) {
    const int64_t end = opjit::fast::MonotonicNs() + kFloorSpinNs;
    for (int i = 0;; ++i) {
      const uint32_t v = word.load(std::memory_order_acquire);
      if (v != old) return v;
      if ((i & 63) == 63 && opjit::fast::MonotonicNs() > end) break;
      __builtin_ia32_pause();
    }
    for (;;) {
      sleeping.store(1, std::memory_order_seq_cst);
      const uint32_t v = word.load(std::memory_order_seq_cst);
      if (v != old) {
        sleeping.store(0);
        return v;
      }
      opjit::fast::FutexWait(&word, old, 50'000'000);
    }
  }
  static void Signal(std::atomic<uint32_t>& word, uint32_t v, std::atomic<uint32_t>& sleeping) {
    word.store(v, std::memory_order_seq_cst);
    if (sleeping.load(std::memory_order_seq_cst) != 0) opjit::fast::FutexWake(&word);
  }

  Words* w_ = nullptr;
  pid_t pid_ = -1;
  uint32_t seq_ = 0;
};

// ---------------------------------------------------------------------------
// The opjitd under test.

class Daemon {
 public:
  ~Daemon() { Stop(); }
  std::optional<std::string> Start(const std::string& binary, const std::string& dir) {
    address_ = "unix:" + dir + "/s.sock";
    std::ofstream toml(dir + "/c.toml");
    toml << "max_message_mb = 600\n";
    if (const char* exec = std::getenv("FAST_BENCH_EXEC")) {
      std::string lines = exec;
      std::replace(lines.begin(), lines.end(), ';', '\n');
      toml << "[exec]\n" << lines << "\n";
    }
    const char* quota = std::getenv("FAST_BENCH_QUOTA");
    toml << "[quota]\ncalls_per_second = " << (quota != nullptr ? quota : "10000000") << "\n";
    toml.close();
    log_ = dir + "/opjitd.log";
    std::vector<std::string> argv = {binary,    "--state-dir", dir + "/state", "--listen",
                                     address_, "--config",    dir + "/c.toml"};
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    const int log_fd = open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, log_fd, 1);
    posix_spawn_file_actions_adddup2(&fa, log_fd, 2);
    const int rc = posix_spawn(&pid_, binary.c_str(), &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    close(log_fd);
    if (rc != 0) {
      pid_ = -1;
      return "cannot spawn " + binary + ": " + std::strerror(rc);
    }
    auto c = Client::Connect({.address = address_, .fast = "off"});
    if (!c.ok()) return c.status().ToString();
    const auto give_up = Clock::now() + std::chrono::seconds(60);
    while (Clock::now() < give_up) {
      if ((*c)->WaitForReady(std::chrono::milliseconds(100)).ok() && (*c)->Info().ok()) {
        return std::nullopt;
      }
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return "opjitd exited during startup: " + ReadFile(log_);
      }
    }
    return "opjitd did not answer within 60 s";
  }
  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }

 private:
  std::string address_, log_;
  pid_t pid_ = -1;
};

// ---------------------------------------------------------------------------
// A client with its own region, and the calls the sides make.

float Input(uint64_t i) { return static_cast<float>(i % 97) * 0.1f - 4.0f; }

struct Caller {
  std::unique_ptr<Client> client;
  std::unique_ptr<opjit::client::ShmMapping> map;
  std::string region;
  uint64_t out_offset = 0;
  v1::ForwardRequest req;
  opjit::client::PreparedCall prepared;
  std::vector<opjit::client::FastTensorRef> refs;

  // A client (fast "on" or "off") with a region for n floats in and out.
  static absl::StatusOr<std::unique_ptr<Caller>> Make(const std::string& address,
                                                      const std::string& fast,
                                                      const std::string& region, int64_t n) {
    auto out = std::make_unique<Caller>();
    auto c = Client::Connect({.address = address, .fast = fast});
    if (!c.ok()) return c.status();
    out->client = *std::move(c);
    out->region = region;
    const uint64_t bytes = static_cast<uint64_t>(n) * 4;
    out->out_offset = (bytes + 4095) / 4096 * 4096;
    auto info = out->client->CreateRegion("", region, 2 * out->out_offset);
    if (!info.ok()) return info.status();
    auto map = opjit::client::ShmMapping::Open(info->shm_key(), info->byte_size());
    if (!map.ok()) return map.status();
    out->map = *std::move(map);
    float* x = reinterpret_cast<float*>(out->map->data());
    for (int64_t i = 0; i < n; ++i) x[i] = Input(i);
    out->req.set_op("leaky_relu");
    *out->req.add_inputs()->add_tensors() = opjit::client::ShmTensor("float32", {n}, region, 0);
    out->req.add_outputs()->mutable_shm()->set_region(region);
    out->req.mutable_outputs(0)->mutable_shm()->set_offset(out->out_offset);
    return out;
  }

  // Prepares the handle for CallPrepared (fast clients).
  absl::Status PrepareRaw() {
    v1::PrepareRequest p;
    p.set_op("leaky_relu");
    // Prepare takes dtype and shape only.
    auto* t = p.add_inputs()->add_tensors();
    t->set_dtype(req.inputs(0).tensors(0).dtype());
    *t->mutable_shape() = req.inputs(0).tensors(0).shape();
    auto call = client->PrepareHandle(p);
    if (!call.ok()) return call.status();
    prepared = *std::move(call);
    auto id = client->RegionId("", region);
    if (!id.ok()) return id.status();
    refs = {{*id, 0}, {*id, out_offset}};
    return absl::OkStatus();
  }

  absl::StatusOr<double> Forward() {
    auto r = client->Forward(req);
    if (!r.ok()) return r.status();
    return r->kernel_ms();
  }
  absl::StatusOr<double> Raw(bool keep_output_bytes = false) {
    return client->CallPrepared(prepared, refs, {}, keep_output_bytes);
  }

  bool OutputRight(int64_t n) const {
    const float* y = reinterpret_cast<const float*>(map->data() + out_offset);
    for (int64_t i = 0; i < n; i += std::max<int64_t>(1, n / 64)) {
      const float x = Input(i);
      if (y[i] != (x > 0 ? x : 0.01f * x)) return false;
    }
    return true;
  }
};

struct Samples {
  std::vector<double> us, kernel_ms;
  std::string error;
};

json SamplesJson(const Samples& s) {
  if (!s.error.empty()) return {{"error", s.error}};
  json j = {{"calls", s.us.size()},
            {"p50_us", Percentile(s.us, 0.5)},
            {"p90_us", Percentile(s.us, 0.9)},
            {"p99_us", Percentile(s.us, 0.99)}};
  if (!s.kernel_ms.empty()) j["kernel_ms_p50"] = Percentile(s.kernel_ms, 0.5);
  return j;
}

// Runs `sides` in alternating batches: `rounds` rounds of `batch` calls of
// each side, after `warmup` untimed calls of each.
void Alternate(std::vector<std::pair<std::function<absl::StatusOr<double>()>, Samples*>> sides,
               int rounds, int batch, int warmup) {
  for (auto& [call, s] : sides) {
    for (int i = 0; i < warmup && s->error.empty(); ++i) {
      auto r = call();
      if (!r.ok()) s->error = r.status().ToString();
    }
  }
  for (int round = 0; round < rounds; ++round) {
    for (auto& [call, s] : sides) {
      if (!s->error.empty()) continue;
      for (int i = 0; i < batch; ++i) {
        const auto t0 = Clock::now();
        auto r = call();
        const double us = UsSince(t0);
        if (!r.ok()) {
          s->error = r.status().ToString();
          break;
        }
        s->us.push_back(us);
        if (*r >= 0) s->kernel_ms.push_back(*r);
      }
    }
  }
}

// CPU per second of wall time while `run` runs.
struct CpuUse {
  double daemon = 0, executors = 0, client = 0;
};

CpuUse MeasureCpu(pid_t daemon, const std::function<void()>& run) {
  const double d0 = CpuSeconds(daemon), e0 = opjit::bench::ExecutorCpuSeconds(daemon), c0 = SelfCpuSeconds();
  const auto t0 = Clock::now();
  run();
  const double s = UsSince(t0) * 1e-6;
  return {(CpuSeconds(daemon) - d0) / s, (opjit::bench::ExecutorCpuSeconds(daemon) - e0) / s,
          (SelfCpuSeconds() - c0) / s};
}

json CpuJson(const CpuUse& u) {
  return {{"daemon", u.daemon}, {"executors", u.executors}, {"client", u.client}};
}

// `callers` each call in their own thread for `seconds`; returns calls/s
// (0 and an error when a call fails).
double Throughput(std::vector<std::unique_ptr<Caller>>& callers, double seconds, bool raw,
                  std::string* error) {
  std::atomic<long> calls{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  std::mutex mu;
  for (auto& c : callers) {
    threads.emplace_back([&, c = c.get()] {
      while (!stop.load(std::memory_order_relaxed)) {
        auto r = raw ? c->Raw() : c->Forward();
        if (!r.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          *error = r.status().ToString();
          return;
        }
        calls.fetch_add(1, std::memory_order_relaxed);
      }
    });
  }
  const auto t0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (auto& t : threads) t.join();
  return calls.load() / (UsSince(t0) * 1e-6);
}

std::string Num(double v, int prec = 1) {
  if (std::isnan(v)) return "n/a";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", prec, v);
  return buf;
}

int Main(int argc, char** argv) {
  const std::string out_path = argc > 1 ? argv[1] : "";
  const std::string opjitd =
      argc > 2 ? argv[2] : (fs::read_symlink("/proc/self/exe").parent_path() / "opjitd").string();
  signal(SIGPIPE, SIG_IGN);

  // The floors' children are forked before this process starts gRPC threads.
  SocketFloor socket_floor;
  ShmFloor shm_floor;
  if (!socket_floor.Start() || !shm_floor.Start()) {
    std::perror("fork");
    return 1;
  }

  std::string tmpl = (fs::temp_directory_path() / "opjit-fastbench-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::string dir = tmpl;
  json result;
  result["machine"] = {{"cores", std::thread::hardware_concurrency()}};
  const char* quota_env = std::getenv("FAST_BENCH_QUOTA");
  result["quota_calls_per_second"] = quota_env != nullptr ? quota_env : "10000000";
  Daemon daemon, compare;
  const char* compare_binary = std::getenv("FAST_BENCH_COMPARE");
  auto finish = [&](int rc) {
    daemon.Stop();
    compare.Stop();
    if (!out_path.empty()) std::ofstream(out_path) << result.dump(2) << "\n";
    std::error_code ec;
    fs::remove_all(dir, ec);
    return rc;
  };
  if (auto err = daemon.Start(opjitd, dir)) {
    result["error"] = *err;
    std::fprintf(stderr, "fast_bench: %s\n", err->c_str());
    return finish(1);
  }
  auto register_op = [](const std::string& address) -> absl::Status {
    auto admin = Client::Connect({.address = address, .fast = "off"});
    if (!admin.ok()) return admin.status();
    auto spec = opjit::client::LoadOpSpec(std::string(OPJIT_SOURCE_DIR) +
                                          "/kernels/examples/leaky_relu.json");
    return spec.ok() ? (*admin)->Register(*spec).status() : spec.status();
  };
  if (absl::Status s = register_op(daemon.address()); !s.ok()) {
    result["error"] = "register leaky_relu: " + s.ToString();
    std::fprintf(stderr, "fast_bench: %s\n", s.ToString().c_str());
    return finish(1);
  }
  if (compare_binary != nullptr) {
    fs::create_directories(dir + "/compare");
    std::optional<std::string> err = compare.Start(compare_binary, dir + "/compare");
    absl::Status s = err ? absl::UnavailableError(*err) : register_op(compare.address());
    if (!s.ok()) {
      result["error"] = "the FAST_BENCH_COMPARE daemon: " + s.ToString();
      std::fprintf(stderr, "fast_bench: %s\n", result["error"].get<std::string>().c_str());
      return finish(1);
    }
  }

  // --- Tiny calls, side by side.
  auto fast = Caller::Make(daemon.address(), "on", "tiny_f", kTinyFloats);
  auto grpc = Caller::Make(daemon.address(), "off", "tiny_g", kTinyFloats);
  if (!fast.ok() || !grpc.ok()) {
    result["error"] = "clients: " + (fast.ok() ? grpc.status() : fast.status()).ToString();
    std::fprintf(stderr, "fast_bench: %s\n", result["error"].get<std::string>().c_str());
    return finish(1);
  }
  Samples s_fast, s_raw, s_grpc, s_sock, s_shm, s_cfast, s_craw;
  if (absl::Status st = (*fast)->PrepareRaw(); !st.ok()) s_raw.error = st.ToString();
  std::vector<std::pair<std::function<absl::StatusOr<double>()>, Samples*>> tiny_sides = {
      {[&] { return (*fast)->Forward(); }, &s_fast},
      {[&] { return (*fast)->Raw(); }, &s_raw},
      {[&] { return (*grpc)->Forward(); }, &s_grpc},
      {[&]() -> absl::StatusOr<double> {
         if (!socket_floor.Call()) return absl::InternalError("socketpair floor failed");
         return -1.0;
       },
       &s_sock},
      {[&]() -> absl::StatusOr<double> {
         shm_floor.Call();
         return -1.0;
       },
       &s_shm}};
  absl::StatusOr<std::unique_ptr<Caller>> cfast = absl::UnavailableError("no FAST_BENCH_COMPARE");
  if (compare_binary != nullptr) {
    cfast = Caller::Make(compare.address(), "on", "tiny_cf", kTinyFloats);
    if (!cfast.ok()) {
      s_cfast.error = s_craw.error = cfast.status().ToString();
    } else {
      if (absl::Status st = (*cfast)->PrepareRaw(); !st.ok()) s_craw.error = st.ToString();
      tiny_sides.push_back({[&] { return (*cfast)->Forward(); }, &s_cfast});
      tiny_sides.push_back({[&] { return (*cfast)->Raw(); }, &s_craw});
    }
  }
  Alternate(tiny_sides, /*rounds=*/200, /*batch=*/50, /*warmup=*/500);
  if (s_fast.error.empty() && !(*fast)->OutputRight(kTinyFloats)) s_fast.error = "wrong output";
  result["tiny"] = {{"fast", SamplesJson(s_fast)},           {"fast_raw", SamplesJson(s_raw)},
                    {"grpc", SamplesJson(s_grpc)},           {"socketpair_floor", SamplesJson(s_sock)},
                    {"shm_spin_floor", SamplesJson(s_shm)}};
  if (compare_binary != nullptr) {
    result["tiny"]["compare"] = {{"opjitd", compare_binary},
                                 {"fast", SamplesJson(s_cfast)},
                                 {"fast_raw", SamplesJson(s_craw)}};
  }

  // --- 1 MiB and 64 MiB through shm.
  // Batches of several calls: a loop of calls is what this measures; the
  // first call of each batch also pays the executor's wake-up (it slept
  // while the other side ran).
  struct Big {
    const char* name;
    int64_t floats;
    int rounds;
    int batch;
  };
  // Sides: Client::Forward on the fast channel, CallPrepared (raw) with the
  // output zero-filled as by default, CallPrepared keeping the output's bytes
  // (keep_output_bytes: no memset of the output before the kernel), gRPC.
  struct BigSides {
    Samples fast, raw, keep, grpc;
  };
  std::map<std::string, BigSides> big;
  for (const Big b : {Big{"1MiB", 1 << 18, 20, 10}, Big{"64MiB", 1 << 24, 5, 4}}) {
    auto bf = Caller::Make(daemon.address(), "on", std::string("big_f_") + b.name, b.floats);
    auto bg = Caller::Make(daemon.address(), "off", std::string("big_g_") + b.name, b.floats);
    BigSides& s = big[b.name];
    absl::Status ready = !bf.ok() ? bf.status() : !bg.ok() ? bg.status() : (*bf)->PrepareRaw();
    if (!ready.ok()) {
      s.fast.error = s.raw.error = s.keep.error = s.grpc.error = ready.ToString();
      continue;
    }
    Alternate({{[&] { return (*bf)->Forward(); }, &s.fast},
               {[&] { return (*bf)->Raw(); }, &s.raw},
               {[&] { return (*bf)->Raw(/*keep_output_bytes=*/true); }, &s.keep},
               {[&] { return (*bg)->Forward(); }, &s.grpc}},
              b.rounds, b.batch, 2);
    if (s.fast.error.empty() && !(*bf)->OutputRight(b.floats)) s.fast.error = "wrong output";
    result["big"][b.name] = {{"fast", SamplesJson(s.fast)}, {"fast_raw", SamplesJson(s.raw)},
                             {"fast_raw_keep", SamplesJson(s.keep)},
                             {"grpc", SamplesJson(s.grpc)}};
  }

  // --- CPU idle: every channel open, no calls.
  const CpuUse idle = MeasureCpu(daemon.pid(), [] { std::this_thread::sleep_for(std::chrono::seconds(2)); });
  result["cpu"]["idle"] = CpuJson(idle);

  // --- 1 and 8 clients: calls/s and CPU, fast against gRPC, alternating.
  std::vector<std::unique_ptr<Caller>> fast8, grpc8;
  std::string error8;
  for (int i = 0; i < 8 && error8.empty(); ++i) {
    auto f = Caller::Make(daemon.address(), "on", "c8_f" + std::to_string(i), kTinyFloats);
    auto g = Caller::Make(daemon.address(), "off", "c8_g" + std::to_string(i), kTinyFloats);
    if (!f.ok() || !g.ok()) {
      error8 = (f.ok() ? g.status() : f.status()).ToString();
      break;
    }
    fast8.push_back(*std::move(f));
    grpc8.push_back(*std::move(g));
  }
  struct Load {
    std::vector<double> rate;
    CpuUse cpu;  // summed over phases, averaged at the end
    std::string error;
  };
  std::map<std::string, Load> loads;  // "fast1", "grpc1", "fast8", "grpc8"
  if (error8.empty()) {
    std::vector<std::unique_ptr<Caller>> one_fast, one_grpc;
    one_fast.push_back(std::move(fast8[0]));
    one_grpc.push_back(std::move(grpc8[0]));
    constexpr int kPhases = 3;
    constexpr double kPhaseS = 1.0;
    for (int phase = 0; phase < kPhases; ++phase) {
      for (const std::string name : {"fast1", "grpc1", "fast8", "grpc8"}) {
        Load& l = loads[name];
        if (!l.error.empty()) continue;
        const bool eight = name.back() == '8';
        const bool is_fast = name[0] == 'f';
        auto& group = is_fast ? one_fast : one_grpc;
        if (eight) {  // the 8-client group: the single caller and 7 more
          if (is_fast) {
            for (int i = 1; i < 8; ++i) group.push_back(std::move(fast8[i]));
          } else {
            for (int i = 1; i < 8; ++i) group.push_back(std::move(grpc8[i]));
          }
        }
        double rate = 0;
        const CpuUse u = MeasureCpu(daemon.pid(), [&] { rate = Throughput(group, kPhaseS, false, &l.error); });
        if (eight) {  // give the 7 back
          auto& store = is_fast ? fast8 : grpc8;
          for (int i = 1; i < 8; ++i) store[i] = std::move(group[i]);
          group.resize(1);
        }
        l.rate.push_back(rate);
        l.cpu.daemon += u.daemon / kPhases;
        l.cpu.executors += u.executors / kPhases;
        l.cpu.client += u.client / kPhases;
      }
    }
    for (auto& [name, l] : loads) {
      result["load"][name] = l.error.empty() ? json{{"calls_per_s", Percentile(l.rate, 0.5)},
                                                    {"cpu", CpuJson(l.cpu)}}
                                             : json{{"error", l.error}};
    }
  } else {
    result["load"] = {{"error", error8}};
  }

  // --- The table.
  auto p50 = [](const Samples& s) { return s.error.empty() ? Percentile(s.us, 0.5) : NAN; };
  auto p99 = [](const Samples& s) { return s.error.empty() ? Percentile(s.us, 0.99) : NAN; };
  const double sock = p50(s_sock);
  std::printf("### Fast path (C++ client), %u cores, [quota] calls_per_second = %s\n\n",
              std::thread::hardware_concurrency(),
              result["quota_calls_per_second"].get<std::string>().c_str());
  std::printf("| tiny call, 16 float32 in shm | p50 µs | p99 µs | vs socketpair floor | vs gRPC |\n");
  std::printf("| --- | --- | --- | --- | --- |\n");
  const double g50 = p50(s_grpc);
  std::vector<std::pair<const char*, const Samples*>> tiny_rows = {
      {"fast path (Client::Forward)", &s_fast},
      {"fast path, raw (CallPrepared)", &s_raw},
      {"gRPC path (unix socket)", &s_grpc},
      {"floor: socketpair ping-pong", &s_sock},
      {"floor: shm slot, spin 20 µs then futex", &s_shm}};
  if (compare_binary != nullptr) {
    tiny_rows.insert(tiny_rows.begin() + 2, {"FAST_BENCH_COMPARE: fast path (Client::Forward)", &s_cfast});
    tiny_rows.insert(tiny_rows.begin() + 3, {"FAST_BENCH_COMPARE: fast path, raw", &s_craw});
  }
  for (const auto& [label, s] : tiny_rows) {
    if (!s->error.empty()) {
      std::printf("| %s | failed: %s | | | |\n", label, s->error.c_str());
      continue;
    }
    std::printf("| %s | %s | %s | %s× | %s× |\n", label, Num(p50(*s)).c_str(), Num(p99(*s)).c_str(),
                Num(p50(*s) / sock, 2).c_str(), Num(p50(*s) / g50, 2).c_str());
  }
  // Each side against its own kernel_ms (which holds the output's zero-fill
  // where there is one: it is part of the executor's Run).
  std::printf("\n| shm call | kernel_ms (zero-filled; kept) | fast p50 ms (Forward) | raw p50 ms "
              "(CallPrepared) | raw, keep_output_bytes | gRPC p50 ms | fast / kernel | "
              "raw / kernel | raw keep / kernel | gRPC / kernel |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (const auto& [name, s] : big) {
    const Samples* sides[] = {&s.fast, &s.raw, &s.keep, &s.grpc};
    std::string error;
    for (const Samples* x : sides) {
      if (error.empty() && !x->error.empty()) error = x->error;
    }
    if (!error.empty()) {
      std::printf("| %s | failed: %s | | | | | | | | |\n", name.c_str(), error.c_str());
      continue;
    }
    std::printf("| %s | %s; %s", name.c_str(), Num(Percentile(s.raw.kernel_ms, 0.5), 3).c_str(),
                Num(Percentile(s.keep.kernel_ms, 0.5), 3).c_str());
    for (const Samples* x : sides) std::printf(" | %s", Num(p50(*x) / 1000, 3).c_str());
    for (const Samples* x : sides) {
      std::printf(" | %s×", Num(p50(*x) / 1000 / Percentile(x->kernel_ms, 0.5), 2).c_str());
    }
    std::printf(" |\n");
  }
  std::printf("\n| load | calls/s | daemon CPU | executors CPU | client CPU |\n");
  std::printf("| --- | --- | --- | --- | --- |\n");
  std::printf("| idle, 2 s, channels open | 0 | %s | %s | %s |\n", Num(idle.daemon, 3).c_str(),
              Num(idle.executors, 3).c_str(), Num(idle.client, 3).c_str());
  for (const auto& [name, label] : std::vector<std::pair<std::string, const char*>>{
           {"fast1", "1 client, fast"}, {"grpc1", "1 client, gRPC"},
           {"fast8", "8 clients, fast"}, {"grpc8", "8 clients, gRPC"}}) {
    auto it = loads.find(name);
    if (it == loads.end() || !it->second.error.empty()) {
      std::printf("| %s | failed: %s | | | |\n", label,
                  it == loads.end() ? error8.c_str() : it->second.error.c_str());
      continue;
    }
    const Load& l = it->second;
    std::printf("| %s | %s | %s | %s | %s |\n", label, Num(Percentile(l.rate, 0.5), 0).c_str(),
                Num(l.cpu.daemon, 2).c_str(), Num(l.cpu.executors, 2).c_str(),
                Num(l.cpu.client, 2).c_str());
  }
  if (loads.count("fast8") && loads.count("grpc8") && loads["fast8"].error.empty() &&
      loads["grpc8"].error.empty()) {
    std::printf("\n8 clients: fast / gRPC = %s× calls/s. CPU is cores busy (CPU seconds per "
                "second).\n",
                Num(Percentile(loads["fast8"].rate, 0.5) / Percentile(loads["grpc8"].rate, 0.5), 2)
                    .c_str());
  }
  return finish(0);
}

}  // namespace

int main(int argc, char** argv) { return Main(argc, argv); }
