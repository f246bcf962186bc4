// Call-path benchmarks of a running opjitd, measured side by side in one run:
//   - call overhead of a cached tiny op (leaky_relu on 16 float32, inline in
//     and out) against a bare gRPC echo of the same payload size, served by a
//     callback-API generic service from a forked child of this program (like
//     opjitd, its own process; CALL_BENCH_ECHO=inprocess serves it from this
//     one), and against a no-op RPC of opjitd (ListRegions); 1 and 8
//     concurrent clients, over a unix socket and over TCP 127.0.0.1. The
//     sides alternate in batches so all see the same machine state;
//   - the server's own view of that call (ForwardResponse.server_ms), the
//     floor without RPC;
//   - the data path for 1/64/256 MiB float32 inputs: shared memory (call time
//     against the kernel's own time), inline bytes, and an in-process memcpy
//     of the same size as the physical floor.
//
//   call_bench OUT.json [OPJITD]
//
// CALL_BENCH_PIN=1 pins the servers to CPU 1 and the client to CPU 0.
//
// Starts its own opjitd (OPJITD, default: next to this binary) in a temp
// state dir, writes the results to OUT.json and a summary to stdout. A row
// that fails is recorded as {"error": "..."}; no number is ever made up.
// bench/report.py turns the JSON into bench/results.md.
#include <fcntl.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_daemon.h"
#include "bench/proc_cpu.h"
#include "client/cpp/opjit_client.h"
#include "client/cpp/shm_region.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
namespace v1 = opjit::v1;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
using opjit::client::Client;
using opjit::bench::DaemonProcess;
using opjit::bench::Median;
using opjit::bench::OnFatalSignal;
using opjit::bench::Percentile;
using opjit::bench::ReadFile;
using opjit::bench::Tail;
using opjit::bench::UsSince;

constexpr int kTinyFloats = 16;
constexpr char kEchoMethod[] = "/opjit.bench.Echo/Echo";
// The daemon's (and the inline client's) message limit, so 64 MiB inline fits.
constexpr int kBigMessageMb = 600;

// Pins the calling thread (and what it spawns or forks from now on) to `cpu`.
bool PinTo(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return sched_setaffinity(0, sizeof set, &set) == 0;
}

// ---------------------------------------------------------------------------
// The peer: a bare gRPC echo, callback API, generic (ByteBuffer in, same out).

class EchoReactor : public grpc::ServerGenericBidiReactor {
 public:
  EchoReactor() { StartRead(&buffer_); }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request message"));
      return;
    }
    StartWriteAndFinish(&buffer_, grpc::WriteOptions(), grpc::Status::OK);
  }
  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer buffer_;
};

class EchoService : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new EchoReactor();
  }
};

struct EchoServer {
  EchoService service;
  std::unique_ptr<grpc::Server> server;
  std::string unix_address, tcp_address;
};

std::optional<std::string> StartEcho(const std::string& dir, EchoServer* echo) {
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(kBigMessageMb << 20);
  builder.SetMaxSendMessageSize(kBigMessageMb << 20);
  echo->unix_address = "unix:" + dir + "/echo.sock";
  int unix_port = 0, tcp_port = 0;
  builder.AddListeningPort(echo->unix_address, grpc::InsecureServerCredentials(), &unix_port);
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &tcp_port);
  builder.RegisterCallbackGenericService(&echo->service);
  echo->server = builder.BuildAndStart();
  if (echo->server == nullptr || unix_port == 0 || tcp_port == 0) {
    return "could not start the in-process echo server";
  }
  echo->tcp_address = "127.0.0.1:" + std::to_string(tcp_port);
  return std::nullopt;
}

// The echo server in a child process forked before the parent touches gRPC,
// so, like opjitd, it shares no gRPC threads or CPU time slices of the
// client's process. The child serves until the parent closes the pipe (or
// dies).
class ForkedEcho {
 public:
  ~ForkedEcho() { Stop(); }

  std::optional<std::string> Start(const std::string& dir) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) return std::string("pipe: ") + std::strerror(errno);
    const std::string port_file = dir + "/echo.port";
    pid_ = fork();
    if (pid_ < 0) return std::string("fork: ") + std::strerror(errno);
    if (pid_ == 0) {
      close(p[1]);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      EchoServer echo;
      auto err = StartEcho(dir, &echo);
      std::ofstream(port_file + ".tmp") << (err ? "error: " + *err : echo.tcp_address) << "\n";
      std::rename((port_file + ".tmp").c_str(), port_file.c_str());
      if (err) _exit(1);
      for (char c;;) {  // until the parent closes its end (EOF)
        const ssize_t r = read(p[0], &c, 1);
        if (r == 0 || (r < 0 && errno != EINTR)) break;
      }
      echo.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      _exit(0);
    }
    close(p[0]);
    pipe_w_ = p[1];
    unix_address = "unix:" + dir + "/echo.sock";
    const auto give_up = Clock::now() + std::chrono::seconds(20);
    while (Clock::now() < give_up) {
      std::string line = ReadFile(port_file);
      if (!line.empty()) {
        while (!line.empty() && line.back() == '\n') line.pop_back();
        if (line.rfind("error: ", 0) == 0) return line.substr(7);
        tcp_address = line;
        return std::nullopt;
      }
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return "the echo server process exited during startup";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return "the echo server process did not start within 20 s";
  }

  void Stop() {
    if (pipe_w_ >= 0) close(pipe_w_);
    pipe_w_ = -1;
    if (pid_ <= 0) return;
    opjit::bench::WaitOrKill(pid_, std::chrono::seconds(10));
    pid_ = -1;
  }

  std::string unix_address, tcp_address;

 private:
  pid_t pid_ = -1;
  int pipe_w_ = -1;
};

// One echo client: its own channel (args as opjit's Client sets them), a
// GenericStub and a completion queue it waits on, like a synchronous stub.
class EchoClient {
 public:
  EchoClient(const std::string& address, int max_message_bytes) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(max_message_bytes);
    args.SetMaxSendMessageSize(max_message_bytes);
    channel_ = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
    stub_ = std::make_unique<grpc::GenericStub>(channel_);
  }
  ~EchoClient() {
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  // One unary call; returns the reply's size, or the error.
  absl::StatusOr<size_t> Call(const grpc::ByteBuffer& request) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    grpc::ByteBuffer reply;
    grpc::Status status;
    auto call = stub_->PrepareUnaryCall(&ctx, kEchoMethod, request, &cq_);
    call->StartCall();
    call->Finish(&reply, &status, this);
    void* tag = nullptr;
    bool ok = false;
    if (!cq_.Next(&tag, &ok) || tag != this || !ok)
      return absl::InternalError("echo: queue failed");
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          status.error_message());
    }
    return reply.Length();
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::GenericStub> stub_;
  grpc::CompletionQueue cq_;
};

// ---------------------------------------------------------------------------
// Call overhead: opjit and echo alternate in batches; with several clients,
// every client runs the same side at once, between barriers.

struct SideSamples {
  std::vector<double> us;         // client-observed latency of each call
  std::vector<double> server_ms;  // opjit only
  std::vector<double> kernel_ms;  // opjit only
  double wall_s = 0;              // summed wall time of this side's phases
  std::string error;
};

json SideJson(SideSamples& s) {
  if (!s.error.empty()) return {{"error", s.error}};
  if (s.us.empty()) return {{"error", "no calls completed"}};
  json j;
  j["calls"] = s.us.size();
  j["p50_us"] = Percentile(s.us, 0.50);
  j["p90_us"] = Percentile(s.us, 0.90);
  j["p99_us"] = Percentile(s.us, 0.99);
  j["mean_us"] = std::accumulate(s.us.begin(), s.us.end(), 0.0) / s.us.size();
  j["calls_per_s"] = s.wall_s > 0 ? s.us.size() / s.wall_s : 0.0;
  if (!s.server_ms.empty()) {
    j["server_ms_p50"] = Percentile(s.server_ms, 0.50);
    j["server_ms_p99"] = Percentile(s.server_ms, 0.99);
    j["kernel_ms_p50"] = Percentile(s.kernel_ms, 0.50);
  }
  return j;
}

// Log-spaced latency histogram (µs) for report.py's optional PNG.
json Histogram(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.empty() || b.empty()) return nullptr;
  double lo =
      std::min(*std::min_element(a.begin(), a.end()), *std::min_element(b.begin(), b.end()));
  double hi =
      std::max(*std::max_element(a.begin(), a.end()), *std::max_element(b.begin(), b.end()));
  lo = std::max(1.0, std::floor(lo));
  hi = std::max(lo * 1.01, hi);
  constexpr int kBins = 60;
  std::vector<double> edges(kBins + 1);
  for (int i = 0; i <= kBins; ++i)
    edges[i] = lo * std::pow(hi / lo, static_cast<double>(i) / kBins);
  auto count = [&](const std::vector<double>& v) {
    std::vector<int> c(kBins, 0);
    for (double x : v) {
      int i = static_cast<int>(std::upper_bound(edges.begin(), edges.end(), x) - edges.begin()) - 1;
      ++c[std::clamp(i, 0, kBins - 1)];
    }
    return c;
  };
  return {{"edges_us", edges}, {"opjit", count(a)}, {"echo", count(b)}};
}

struct OverheadConfig {
  std::string transport;  // "unix" | "tcp"
  // opjit with kernels in executor processes (the default), opjit with
  // kernels inside the daemon, and the echo peer.
  std::string opjit_address, in_daemon_address, echo_address;
  int clients = 1;
  int rounds = 250;  // one batch of each side per round
  int batch = 20;    // calls per client per batch: short, so the sides see the same machine state
  int warmup = 300;  // calls per client per side, untimed
};

// The sides measured against each other, in the order they alternate.
enum Side { kForward = 0, kInDaemon = 1, kNoop = 2, kEcho = 3, kSides = 4 };
constexpr const char* kSideNames[kSides] = {"opjit", "opjit_in_daemon", "opjit_noop", "echo"};

json RunOverhead(const OverheadConfig& cfg, const v1::ForwardRequest& req,
                 const grpc::ByteBuffer& echo_payload, json* histogram) {
  const int n = cfg.clients;
  std::vector<std::array<SideSamples, kSides>> per(n);
  std::barrier sync(n + 1);
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      // A distinct message limit per client gives each its own connection:
      // gRPC shares a subchannel between channels with identical arguments.
      const int limit = (64 << 20) + t;
      std::unique_ptr<Client> client, in_daemon;
      auto c = Client::Connect({.address = cfg.opjit_address, .max_message_bytes = limit});
      if (c.ok()) {
        client = *std::move(c);
      } else {
        per[t][kForward].error = per[t][kNoop].error = c.status().ToString();
      }
      auto d = Client::Connect({.address = cfg.in_daemon_address, .max_message_bytes = limit});
      if (d.ok()) {
        in_daemon = *std::move(d);
      } else {
        per[t][kInDaemon].error = d.status().ToString();
      }
      EchoClient echo(cfg.echo_address, limit);
      auto call = [&](Side side, bool record) {
        SideSamples& s = per[t][side];
        if (!s.error.empty()) return;
        const auto t0 = Clock::now();
        absl::Status status;
        absl::StatusOr<v1::ForwardResponse> fwd;
        switch (side) {
          case kForward:
            fwd = client->Forward(req);
            status = fwd.status();
            break;
          case kInDaemon:
            fwd = in_daemon->Forward(req);
            status = fwd.status();
            break;
          case kNoop:
            // An RPC of the same daemon that does next to nothing: a
            // namespace without regions.
            status = client->ListRegions("call-bench-empty").status();
            break;
          default: {
            auto r = echo.Call(echo_payload);
            status = r.status();
            if (r.ok() && *r != echo_payload.Length()) {
              status = absl::InternalError("echo returned " + std::to_string(*r) + " bytes");
            }
          }
        }
        const double us = UsSince(t0);
        if (!status.ok()) {
          s.error = status.ToString();
          return;
        }
        if ((side == kForward || side == kInDaemon) &&
            (fwd->outputs_size() != 1 || fwd->outputs(0).inline_data().size() != kTinyFloats * 4)) {
          s.error = "Forward returned an unexpected output";
          return;
        }
        if (!record) return;
        s.us.push_back(us);
        if (side == kForward || side == kInDaemon) {
          s.server_ms.push_back(fwd->server_ms());
          s.kernel_ms.push_back(fwd->kernel_ms());
        }
      };
      for (int i = 0; i < cfg.warmup; ++i) {
        for (int side = 0; side < kSides; ++side) call(static_cast<Side>(side), false);
      }
      for (int r = 0; r < cfg.rounds; ++r) {
        for (int side = 0; side < kSides; ++side) {
          sync.arrive_and_wait();
          for (int i = 0; i < cfg.batch; ++i) call(static_cast<Side>(side), true);
          sync.arrive_and_wait();
        }
      }
    });
  }
  std::array<double, kSides> wall{};
  for (int r = 0; r < cfg.rounds; ++r) {
    for (int side = 0; side < kSides; ++side) {
      sync.arrive_and_wait();
      const auto t0 = Clock::now();
      sync.arrive_and_wait();
      wall[side] += UsSince(t0) * 1e-6;
    }
  }
  for (auto& th : threads) th.join();

  std::array<SideSamples, kSides> all;
  for (int side = 0; side < kSides; ++side) {
    SideSamples& a = all[side];
    for (auto& p : per) {
      SideSamples& s = p[side];
      if (!s.error.empty() && a.error.empty()) a.error = s.error;
      a.us.insert(a.us.end(), s.us.begin(), s.us.end());
      a.server_ms.insert(a.server_ms.end(), s.server_ms.begin(), s.server_ms.end());
      a.kernel_ms.insert(a.kernel_ms.end(), s.kernel_ms.begin(), s.kernel_ms.end());
    }
    a.wall_s = wall[side];
  }
  if (histogram != nullptr && all[kForward].error.empty() && all[kEcho].error.empty()) {
    *histogram = Histogram(all[kForward].us, all[kEcho].us);
  }
  json row;
  row["transport"] = cfg.transport;
  row["clients"] = n;
  row["batch"] = cfg.batch;
  row["rounds"] = cfg.rounds;
  for (int side = 0; side < kSides; ++side) row[kSideNames[side]] = SideJson(all[side]);
  if (row["opjit"].contains("p50_us") && row["echo"].contains("p50_us")) {
    row["ratio_p50"] = row["opjit"]["p50_us"].get<double>() / row["echo"]["p50_us"].get<double>();
    row["ratio_p99"] = row["opjit"]["p99_us"].get<double>() / row["echo"]["p99_us"].get<double>();
  }
  if (row["opjit"].contains("p50_us") && row["opjit_in_daemon"].contains("p50_us")) {
    row["process_over_in_daemon_p50"] =
        row["opjit"]["p50_us"].get<double>() / row["opjit_in_daemon"]["p50_us"].get<double>();
  }
  if (row["opjit_in_daemon"].contains("p50_us") && row["echo"].contains("p50_us")) {
    row["in_daemon_over_echo_p50"] =
        row["opjit_in_daemon"]["p50_us"].get<double>() / row["echo"]["p50_us"].get<double>();
  }
  return row;
}

// ---------------------------------------------------------------------------
// Process isolation: what the executor processes cost in CPU, and how long a
// crashed kernel's op takes to answer again.

using opjit::bench::CpuSeconds;

constexpr char kCrashySpec[] = R"({
  "name": "crashy",
  "inputs": [{"name": "x"}],
  "outputs": [{"name": "y"}],
  "attrs": [{"name": "crash", "param_type": "optional", "value_type": "bool",
             "default_value": "false"}],
  "dtype_formats": [{"dtypes": ["float32", "float32"]}],
  "implementations": [{"target": "CPU", "entry": "Crashy", "source":
    "#include <cstdint>\n#include \"custom_aot_extra.h\"\nextern \"C\" int Crashy(int, void** p, int*, int64_t** s, const char**, void*, void* e) {\n  if (static_cast<AotExtra*>(e)->Attr<bool>(\"crash\")) *static_cast<volatile int*>(nullptr) = 1;\n  for (int64_t i = 0; i < s[0][0]; ++i) static_cast<float*>(p[1])[i] = static_cast<float*>(p[0])[i];\n  return 0;\n}\n"}]
})";

// From a crash's answer to the next successful call of the same op (a new
// executor process: start, sandbox, load the kernel, Init).
json RunCrashRecovery(Client& c, const v1::ForwardRequest& tiny) {
  auto spec = opjit::client::ParseOpSpec(kCrashySpec, OPJIT_SOURCE_DIR);
  if (!spec.ok()) return {{"error", spec.status().ToString()}};
  if (auto r = c.Register(*spec); !r.ok()) return {{"error", r.status().ToString()}};
  v1::ForwardRequest good = tiny, bad = tiny;
  good.set_op("crashy");
  bad.set_op("crashy");
  (*bad.mutable_attrs())["crash"].set_b(true);
  if (auto r = c.Forward(good); !r.ok()) return {{"error", r.status().ToString()}};
  std::vector<double> ms;
  for (int i = 0; i < 7; ++i) {
    auto crashed = c.Forward(bad);
    if (crashed.ok() || crashed.status().code() != absl::StatusCode::kAborted) {
      return {{"error", "the crashing call answered " + crashed.status().ToString()}};
    }
    const auto t0 = Clock::now();
    auto again = c.Forward(good);
    if (!again.ok()) return {{"error", again.status().ToString()}};
    ms.push_back(UsSince(t0) * 1e-3);
  }
  return {{"samples", ms.size()}, {"median_ms", Median(ms)},
          {"max_ms", *std::max_element(ms.begin(), ms.end())}};
}

// ---------------------------------------------------------------------------
// Data path.

constexpr int kDataReps = 7;

float Input(uint64_t i) { return static_cast<float>(i % 97) * 0.1f - 4.0f; }
float Expected(float x) { return x > 0.0f ? x : 0.01f * x; }

void FillInput(float* x, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) x[i] = Input(i);
}

// Spot-checks a leaky_relu output (default alpha 0.01).
bool OutputLooksRight(const float* y, uint64_t n) {
  for (uint64_t i : {uint64_t{0}, uint64_t{1}, uint64_t{40}, n / 2, n - 1}) {
    if (std::fabs(y[i] - Expected(Input(i))) > 1e-6f) return false;
  }
  return true;
}

struct CallTimes {
  std::vector<double> call_ms, kernel_ms, server_ms;
};

json TimesJson(const CallTimes& t, uint64_t bytes) {
  json j;
  j["reps"] = t.call_ms.size();
  j["call_ms"] = Median(t.call_ms);
  j["kernel_ms"] = Median(t.kernel_ms);
  j["server_ms"] = Median(t.server_ms);
  j["call_over_kernel"] = j["call_ms"].get<double>() / j["kernel_ms"].get<double>();
  // Input bytes per second (leaky_relu reads and writes that many each).
  j["gb_per_s"] = bytes / (j["call_ms"].get<double>() * 1e-3) / 1e9;
  j["call_ms_all"] = t.call_ms;
  return j;
}

json RunShm(Client& c, uint64_t bytes) {
  const uint64_t n = bytes / 4;
  const std::string name = "call-bench-" + std::to_string(bytes >> 20) + "m";
  auto info = c.CreateRegion("", name, 2 * bytes);
  if (!info.ok()) return {{"error", "CreateRegion: " + info.status().ToString()}};
  json out;
  {
    auto map = opjit::client::ShmMapping::Open(info->shm_key(), info->byte_size());
    if (!map.ok()) {
      out = {{"error", "ShmMapping::Open: " + map.status().ToString()}};
    } else {
      FillInput(reinterpret_cast<float*>((*map)->data()), n);
      v1::ForwardRequest req;
      req.set_op("leaky_relu");
      *req.add_inputs()->add_tensors() =
          opjit::client::ShmTensor("float32", {static_cast<int64_t>(n)}, name, 0);
      auto* place = req.add_outputs()->mutable_shm();
      place->set_region(name);
      place->set_offset(bytes);
      CallTimes t;
      std::string error;
      // One untimed call first: the daemon's first touch of the pages.
      for (int rep = -1; rep < kDataReps && error.empty(); ++rep) {
        const auto t0 = Clock::now();
        auto r = c.Forward(req);
        const double ms = UsSince(t0) * 1e-3;
        if (!r.ok()) {
          error = "Forward: " + r.status().ToString();
        } else if (!OutputLooksRight(reinterpret_cast<const float*>((*map)->data() + bytes), n)) {
          error = "the output in shm is wrong";
        } else if (rep >= 0) {
          t.call_ms.push_back(ms);
          t.kernel_ms.push_back(r->kernel_ms());
          t.server_ms.push_back(r->server_ms());
        }
      }
      out = error.empty() ? TimesJson(t, bytes) : json{{"error", error}};
    }
  }
  if (auto s = c.UnregisterRegion("", name); !s.ok() && !out.contains("error")) {
    out["unregister_error"] = s.ToString();
  }
  return out;
}

// Inline bytes both ways, alternating with a bare gRPC echo of a message of
// the same size (the request's), so the cost of moving the bytes through gRPC
// can be told from opjit's.
json RunInline(Client& c, EchoClient& echo, uint64_t bytes, int reps) {
  const uint64_t n = bytes / 4;
  std::string data(bytes, '\0');
  FillInput(reinterpret_cast<float*>(data.data()), n);
  v1::ForwardRequest req;
  req.set_op("leaky_relu");
  *req.add_inputs()->add_tensors() =
      opjit::client::InlineTensor("float32", {static_cast<int64_t>(n)}, data);
  data.assign(req.ByteSizeLong(), 'x');
  grpc::Slice slice(data);
  const grpc::ByteBuffer echo_payload(&slice, 1);
  data.clear();
  data.shrink_to_fit();
  CallTimes t;
  std::vector<double> echo_ms;
  std::string echo_error;
  for (int rep = -1; rep < reps; ++rep) {
    auto t0 = Clock::now();
    auto r = c.Forward(req);
    const double ms = UsSince(t0) * 1e-3;
    if (!r.ok()) return {{"error", "Forward: " + r.status().ToString()}};
    if (r->outputs_size() != 1 || r->outputs(0).inline_data().size() != bytes ||
        !OutputLooksRight(reinterpret_cast<const float*>(r->outputs(0).inline_data().data()), n)) {
      return {{"error", "the inline output is wrong"}};
    }
    if (rep >= 0) {
      t.call_ms.push_back(ms);
      t.kernel_ms.push_back(r->kernel_ms());
      t.server_ms.push_back(r->server_ms());
    }
    if (!echo_error.empty()) continue;
    t0 = Clock::now();
    auto e = echo.Call(echo_payload);
    const double ems = UsSince(t0) * 1e-3;
    if (!e.ok()) {
      echo_error = e.status().ToString();
    } else if (rep >= 0) {
      echo_ms.push_back(ems);
    }
  }
  json j = TimesJson(t, bytes);
  if (!echo_error.empty()) {
    j["echo"] = {{"error", echo_error}};
  } else {
    const double med = Median(echo_ms);
    j["echo"] = {{"payload_bytes", echo_payload.Length()},
                 {"call_ms", med},
                 {"gb_per_s", bytes / (med * 1e-3) / 1e9},
                 {"call_ms_all", echo_ms}};
  }
  return j;
}

json RunMemcpy(uint64_t bytes) {
  std::unique_ptr<uint8_t[]> src(new uint8_t[bytes]), dst(new uint8_t[bytes]);
  std::memset(src.get(), 1, bytes);
  std::memset(dst.get(), 2, bytes);  // fault the pages in before timing
  std::vector<double> ms;
  for (int rep = 0; rep < 9; ++rep) {
    const auto t0 = Clock::now();
    std::memcpy(dst.get(), src.get(), bytes);
    asm volatile("" : : "r"(dst.get()) : "memory");
    ms.push_back(UsSince(t0) * 1e-3);
  }
  const double med = Median(ms);
  return {{"reps", ms.size()}, {"ms", med}, {"gb_per_s", bytes / (med * 1e-3) / 1e9}};
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "unknown CPU";
}

// The 1-minute load average: other work on the machine skews every number.
double LoadAvg() {
  double l = -1;
  std::ifstream("/proc/loadavg") >> l;
  return l;
}

// ---------------------------------------------------------------------------

std::string Fmt(const json& j, const char* key, const char* unit, int prec = 1) {
  if (!j.is_object() || !j.contains(key)) return "failed";
  char buf[64];
  snprintf(buf, sizeof(buf), "%.*f%s", prec, j[key].get<double>(), unit);
  return buf;
}

int Main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s OUT.json [OPJITD]\n", argv[0]);
    return 2;
  }
  const std::string out_path = argv[1];
  const std::string opjitd = opjit::bench::OpjitdPath(argc, argv);
  const auto started = Clock::now();
  // A closed stdout must not kill the run before it stops opjitd; an
  // interrupt or a crash stops opjitd on the way out (the temp dir stays).
  signal(SIGPIPE, SIG_IGN);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGSEGV, SIGBUS, SIGABRT}) signal(sig, OnFatalSignal);

  std::string tmpl = (fs::temp_directory_path() / "opjit-callbench-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    perror("mkdtemp");
    return 1;
  }
  const std::string dir = tmpl;
  {
    // CALL_BENCH_EXEC="key = value; ..." adds [exec] settings (to compare
    // spin budgets, say).
    std::ofstream toml(dir + "/c.toml");
    toml << "max_message_mb = " << kBigMessageMb << "\n";
    if (const char* exec = std::getenv("CALL_BENCH_EXEC")) {
      std::string lines = exec;
      std::replace(lines.begin(), lines.end(), ';', '\n');
      toml << "[exec]\n" << lines << "\n";
    }
  }
  // CALL_BENCH_QUICK=1: only the 1-client unix-socket overhead row.
  const bool quick = std::getenv("CALL_BENCH_QUICK") != nullptr;

  // The echo peer, by default in its own process (forked now, before this
  // process touches gRPC); CALL_BENCH_ECHO=inprocess serves it from here.
  const char* echo_mode_env = std::getenv("CALL_BENCH_ECHO");
  const bool echo_in_process =
      echo_mode_env != nullptr && std::string(echo_mode_env) == "inprocess";
  ForkedEcho forked_echo;
  std::optional<std::string> echo_error;
  // CALL_BENCH_PIN=1: the servers (opjitd and the echo) on CPU 1, the client
  // on CPU 0, so both servers see the same placement; lower variance than the
  // default (the scheduler's choice), for comparing builds.
  const bool pin = std::getenv("CALL_BENCH_PIN") != nullptr && PinTo(1);
  if (!echo_in_process) echo_error = forked_echo.Start(dir);

  json result;
  result["machine"] = {{"cores", std::thread::hardware_concurrency()},
                       {"cpu", CpuModel()},
                       {"loadavg_start", LoadAvg()}};
  result["config"] = {
      {"max_message_mb", kBigMessageMb}, {"tiny_floats", kTinyFloats}, {"pinned", pin}};

  std::unique_ptr<DaemonProcess> daemon, in_daemon;
  // Stops the servers, writes the JSON and removes the temp dir.
  auto write_and_exit = [&](int rc) {
    if (in_daemon) result["opjitd_in_daemon_exit"] = in_daemon->Stop();
    if (daemon) result["opjitd_exit"] = daemon->Stop();
    forked_echo.Stop();
    result["total_s"] = UsSince(started) * 1e-6;
    result["machine"]["loadavg_end"] = LoadAvg();
    std::ofstream out(out_path);
    out << result.dump(1) << "\n";
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (!out) {
      fprintf(stderr, "call_bench: cannot write %s\n", out_path.c_str());
      return 1;
    }
    return rc;
  };

  daemon = std::make_unique<DaemonProcess>(opjitd, dir);
  bool config_ok = true;
  if (auto err = daemon->Start(/*with_config=*/true)) {
    // Record why, then try without the config: everything but the big inline
    // calls can still be measured.
    result["config_error"] = *err;
    config_ok = false;
    daemon->Stop();
    daemon = std::make_unique<DaemonProcess>(opjitd, dir);
    if (auto err2 = daemon->Start(/*with_config=*/false)) {
      result["error"] = "opjitd did not start: " + *err2;
      fprintf(stderr, "call_bench: %s\n", result["error"].get<std::string>().c_str());
      return write_and_exit(1);
    }
  }
  result["config"]["max_message_mb_applied"] = config_ok;
  // The same daemon with kernels inside it ([exec] isolation = "in-daemon").
  fs::create_directories(dir + "/in-daemon");
  in_daemon = std::make_unique<DaemonProcess>(opjitd, dir + "/in-daemon",
                                              std::vector<std::string>{"--isolation", "in-daemon"},
                                              dir + "/c.toml");
  if (auto err = in_daemon->Start(/*with_config=*/config_ok)) {
    result["error"] = "in-daemon opjitd did not start: " + *err;
    return write_and_exit(1);
  }
  if (pin) PinTo(0);  // the client's threads, created from here on

  EchoServer in_process_echo;
  if (echo_in_process) echo_error = StartEcho(dir, &in_process_echo);
  if (echo_error) {
    result["error"] = "echo server: " + *echo_error;
    return write_and_exit(1);
  }
  struct {
    std::string unix_address, tcp_address;
  } echo;
  echo.unix_address = echo_in_process ? in_process_echo.unix_address : forked_echo.unix_address;
  echo.tcp_address = echo_in_process ? in_process_echo.tcp_address : forked_echo.tcp_address;
  result["config"]["echo_server"] = echo_in_process ? "in-process" : "a forked child process";

  // Register the tiny op (a cold compile; later calls hit the cache).
  auto admin = Client::Connect(
      {.address = daemon->unix_address(), .max_message_bytes = kBigMessageMb << 20});
  if (!admin.ok()) {
    result["error"] = admin.status().ToString();
    return write_and_exit(1);
  }
  auto spec = opjit::client::LoadOpSpec(std::string(OPJIT_SOURCE_DIR) +
                                        "/kernels/examples/leaky_relu.json");
  if (!spec.ok()) {
    result["error"] = "LoadOpSpec: " + spec.status().ToString();
    return write_and_exit(1);
  }
  if (auto reg = (*admin)->Register(*spec); !reg.ok()) {
    result["error"] = "Register: " + reg.status().ToString();
    return write_and_exit(1);
  }
  auto admin_in_daemon = Client::Connect(
      {.address = in_daemon->unix_address(), .max_message_bytes = kBigMessageMb << 20});
  if (!admin_in_daemon.ok() || !(*admin_in_daemon)->Register(*spec).ok()) {
    result["error"] = "Register on the in-daemon opjitd failed";
    return write_and_exit(1);
  }

  // 1 + 2: call overhead.
  v1::ForwardRequest tiny;
  tiny.set_op("leaky_relu");
  {
    std::vector<float> x(kTinyFloats);
    for (int i = 0; i < kTinyFloats; ++i) x[i] = Input(i);
    *tiny.add_inputs()->add_tensors() = opjit::client::InlineTensor(
        "float32", {kTinyFloats},
        std::string_view(reinterpret_cast<const char*>(x.data()), x.size() * 4));
  }
  const std::string payload(tiny.ByteSizeLong(), 'x');
  grpc::Slice slice(payload);
  grpc::ByteBuffer echo_payload(&slice, 1);
  result["config"]["request_bytes"] = tiny.ByteSizeLong();
  if (auto r = (*admin)->Forward(tiny); r.ok()) {
    result["config"]["response_bytes"] = r->ByteSizeLong();
  }
  result["config"]["echo_payload_bytes"] = payload.size();

  json overhead = json::array();
  json histogram = nullptr;
  for (const std::string transport : {"unix", "tcp"}) {
    for (int clients : {1, 8}) {
      if (quick && (transport != "unix" || clients != 1)) continue;
      OverheadConfig cfg;
      cfg.transport = transport;
      cfg.opjit_address = transport == "unix" ? daemon->unix_address() : daemon->tcp_address();
      cfg.in_daemon_address =
          transport == "unix" ? in_daemon->unix_address() : in_daemon->tcp_address();
      cfg.echo_address = transport == "unix" ? echo.unix_address : echo.tcp_address;
      cfg.clients = clients;
      if (clients > 1) {
        cfg.rounds = 80;
        cfg.batch = 25;
        cfg.warmup = 100;
      }
      const bool hist = transport == "unix" && clients == 1;
      // CPU of both daemons and of the executors over the run: what the
      // spinning of the process runner costs.
      const double cpu0 = CpuSeconds(daemon->pid()), wcpu0 = opjit::bench::ExecutorCpuSeconds(daemon->pid());
      const double icpu0 = CpuSeconds(in_daemon->pid());
      const auto w0 = Clock::now();
      json row = RunOverhead(cfg, tiny, echo_payload, hist ? &histogram : nullptr);
      const double wall = UsSince(w0) * 1e-6;
      row["cpu"] = {{"wall_s", wall},
                    {"process_daemon_s", CpuSeconds(daemon->pid()) - cpu0},
                    {"process_workers_s", opjit::bench::ExecutorCpuSeconds(daemon->pid()) - wcpu0},
                    {"in_daemon_s", CpuSeconds(in_daemon->pid()) - icpu0}};
      printf(
          "%-4s %d client%s  opjit p50 %s p99 %s %s | in-daemon p50 %s (process/in-daemon %s) | "
          "no-op RPC p50 %s | echo p50 %s p99 %s %s | ratio %s",
          transport.c_str(), clients, clients > 1 ? "s" : " ",
          Fmt(row["opjit"], "p50_us", " us").c_str(), Fmt(row["opjit"], "p99_us", " us").c_str(),
          Fmt(row["opjit"], "calls_per_s", "/s", 0).c_str(),
          Fmt(row["opjit_in_daemon"], "p50_us", " us").c_str(),
          Fmt(row, "process_over_in_daemon_p50", "x", 2).c_str(),
          Fmt(row["opjit_noop"], "p50_us", " us").c_str(),
          Fmt(row["echo"], "p50_us", " us").c_str(), Fmt(row["echo"], "p99_us", " us").c_str(),
          Fmt(row["echo"], "calls_per_s", "/s", 0).c_str(), Fmt(row, "ratio_p50", "x", 2).c_str());
      if (row["opjit"].contains("server_ms_p50")) {
        printf(" | server_ms p50 %.1f us", row["opjit"]["server_ms_p50"].get<double>() * 1e3);
      }
      printf("\n");
      const json& cpu = row["cpu"];
      printf("     CPU over %.1f s: process daemon %.2f s + executors %.2f s; in-daemon %.2f s\n",
             cpu["wall_s"].get<double>(), cpu["process_daemon_s"].get<double>(),
             cpu["process_workers_s"].get<double>(), cpu["in_daemon_s"].get<double>());
      fflush(stdout);
      overhead.push_back(std::move(row));
    }
  }
  result["call_overhead"] = overhead;
  result["histogram_unix_1"] = histogram;

  // 3: data path.
  EchoClient big_echo(echo.unix_address, kBigMessageMb << 20);
  json data = json::array();
  for (uint64_t mib : {1, 64, 256}) {
    if (quick) break;
    const uint64_t bytes = mib << 20;
    json row;
    row["size_mib"] = mib;
    row["bytes"] = bytes;
    row["shm"] = RunShm(**admin, bytes);
    // 256 MiB inline takes seconds a call (both sides copy through
    // protobuf): fewer repetitions.
    row["inline"] = config_ok || mib == 1
                        ? RunInline(**admin, big_echo, bytes, mib >= 256 ? 3 : kDataReps)
                        : json{{"error", "opjitd did not start with max_message_mb = " +
                                             std::to_string(kBigMessageMb) + " (see config_error)"}};
    // The same inline call with the kernel inside the daemon, for the cost
    // of the executor hop (two copies through its arena).
    if (config_ok && mib <= 64) {
      row["inline_in_daemon"] = RunInline(**admin_in_daemon, big_echo, bytes, kDataReps);
    }
    row["memcpy"] = RunMemcpy(bytes);
    if (row.contains("inline_in_daemon")) {
      printf("         inline in-daemon %s\n", Fmt(row["inline_in_daemon"], "call_ms", " ms", 2).c_str());
    }
    printf("%3llu MiB  shm call %s kernel %s (%s, %s) | inline %s (%s), echo %s | memcpy %s (%s)\n",
           static_cast<unsigned long long>(mib), Fmt(row["shm"], "call_ms", " ms", 2).c_str(),
           Fmt(row["shm"], "kernel_ms", " ms", 2).c_str(),
           Fmt(row["shm"], "call_over_kernel", "x", 3).c_str(),
           Fmt(row["shm"], "gb_per_s", " GB/s", 2).c_str(),
           row.contains("inline") ? Fmt(row["inline"], "call_ms", " ms", 2).c_str() : "-",
           row.contains("inline") ? Fmt(row["inline"], "gb_per_s", " GB/s", 2).c_str() : "-",
           row.contains("inline") && row["inline"].contains("echo")
               ? Fmt(row["inline"]["echo"], "call_ms", " ms", 2).c_str()
               : "-",
           Fmt(row["memcpy"], "ms", " ms", 2).c_str(),
           Fmt(row["memcpy"], "gb_per_s", " GB/s", 2).c_str());
    for (const char* k : {"shm", "inline"}) {
      if (row.contains(k) && row[k].contains("error")) {
        printf("    %s: %s\n", k, row[k]["error"].get<std::string>().c_str());
      }
    }
    fflush(stdout);
    data.push_back(std::move(row));
  }
  result["data_path"] = data;

  // 4: a crashed executor, to the next good call.
  result["crash_recovery"] = RunCrashRecovery(**admin, tiny);
  printf("crash -> next good call: %s median, %s max\n",
         Fmt(result["crash_recovery"], "median_ms", " ms", 1).c_str(),
         Fmt(result["crash_recovery"], "max_ms", " ms", 1).c_str());

  admin->reset();
  admin_in_daemon->reset();
  if (in_process_echo.server) {
    in_process_echo.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
  printf("total %.1f s; JSON in %s\n", UsSince(started) * 1e-6, out_path.c_str());
  return write_and_exit(0);
}

}  // namespace

int main(int argc, char** argv) { return Main(argc, argv); }
