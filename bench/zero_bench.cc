// What zero-filling outputs costs (issue 27, item 5): calls whose output is
// in shared memory, against three opjitd processes started here (one per
// side, so each side's executor and region see only its own calls),
// measured side by side in one run:
//
//   as is    OPJIT_BENCH_NO_ZERO_FILL=1 in its environment: outputs are left
//            as the kernel finds them (the behaviour before zero-fill)
//   zeroed   the default: every output is zeroed before its kernel runs
//   keep_output_bytes
//            a default daemon, with ForwardRequest.keep_output_bytes set:
//            an output in the caller's own region keeps its bytes (the
//            per-call opt-out; workspaces and inline outputs stay zeroed)
//
// Two kernels over N float32s: `square` (y = x * x: reads N, writes N) and
// `fill` (y = 1: writes N, the case where the zeroing is the largest share),
// at 1 MiB and 256 MiB, each over gRPC (fast channel off) and over the fast
// channel. The input and the output sit in one daemon-created region (the
// output at offset 0, the input after it), so every call reuses the same
// warm pages, as a client's pool does. The region belongs to the fast
// client (a fast call names only its own client's regions; the gRPC client,
// a local admin, names it too). The sides take turns call by call (the
// order rotates each round); medians, p90 and the ratios to as is.
//
// The floor, in this process: zeroing 256 MiB of a warm memfd mapping with
// memset, or by giving the pages back (MADV_REMOVE, what a punched hole
// does) so that the kernel's writes fault in fresh zero pages; then the
// `fill` loop. It shows why the executor uses memset.
//
//   zero_bench OUT.json [OPJITD]     (ZERO_BENCH_ROUNDS, default 15)
//
// Prints a markdown table. A side that fails is recorded as {"error": ...};
// no number is made up.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_daemon.h"
#include "client/cpp/opjit_client.h"

namespace {

namespace fs = std::filesystem;
namespace v1 = opjit::v1;
using json = nlohmann::json;
using opjit::bench::Clock;
using opjit::bench::DaemonProcess;
using opjit::bench::Median;
using opjit::bench::OnFatalSignal;
using opjit::bench::Percentile;
using opjit::bench::UsSince;
using opjit::client::Client;

constexpr char kNamespace[] = "bench";
constexpr char kRegion[] = "zero_bench";
constexpr uint64_t kMaxBytes = uint64_t{256} << 20;
constexpr uint64_t kSizes[] = {uint64_t{1} << 20, kMaxBytes};
constexpr char kNoZeroFillEnv[] = "OPJIT_BENCH_NO_ZERO_FILL";

constexpr char kKernels[] = R"(#include <cstdint>
static int64_t Count(int* nd, int64_t** s) {
  int64_t n = 1;
  for (int i = 0; i < nd[0]; ++i) n *= s[0][i];
  return n;
}
extern "C" int Square(int, void** p, int* nd, int64_t** s, const char**, void*, void*) {
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  for (int64_t i = 0, n = Count(nd, s); i < n; ++i) y[i] = x[i] * x[i];
  return 0;
}
extern "C" int Fill(int, void** p, int* nd, int64_t** s, const char**, void*, void*) {
  float* y = static_cast<float*>(p[1]);
  for (int64_t i = 0, n = Count(nd, s); i < n; ++i) y[i] = 1.0f;
  return 0;
}
)";

v1::OpDef Op(const std::string& name, const std::string& entry) {
  v1::OpDef op;
  op.set_namespace_(kNamespace);
  op.set_name(name);
  op.add_inputs()->set_name("x");
  op.add_outputs()->set_name("y");
  auto* df = op.add_dtype_formats();
  df->add_dtypes("float32");
  df->add_dtypes("float32");
  auto* impl = op.add_implementations();
  impl->set_target("CPU");
  impl->set_entry(entry);
  impl->set_source(kKernels);
  return op;
}

// One daemon of the comparison, with its region mapped here.
struct Daemon {
  std::string name;
  std::unique_ptr<DaemonProcess> process;
  std::unique_ptr<Client> grpc, fast;
  float* region = nullptr;
};

struct Series {
  std::string side, op, path;
  bool keep = false;  // ForwardRequest.keep_output_bytes
  uint64_t bytes = 0;
  Daemon* daemon = nullptr;
  Client* client = nullptr;
  std::vector<double> us;
  std::string error;
};

v1::ForwardRequest Call(const std::string& op, uint64_t bytes, bool keep) {
  const int64_t n = static_cast<int64_t>(bytes / sizeof(float));
  v1::ForwardRequest req;
  req.set_namespace_(kNamespace);
  req.set_op(op);
  req.set_keep_output_bytes(keep);
  *req.add_inputs()->add_tensors() = opjit::client::ShmTensor("float32", {n}, kRegion, kMaxBytes);
  auto* out = req.add_outputs()->mutable_shm();
  out->set_region(kRegion);
  out->set_offset(0);
  return req;
}

// One call, checked at both ends of the output (x[i] = 3 everywhere).
absl::Status CallOnce(Series& s) {
  const v1::ForwardRequest req = Call(s.op, s.bytes, s.keep);
  auto r = s.client->Forward(req);
  if (!r.ok()) return r.status();
  const float want = s.op == "square" ? 9.0f : 1.0f;
  const size_t n = s.bytes / sizeof(float);
  if (s.daemon->region[0] != want || s.daemon->region[n - 1] != want) {
    return absl::InternalError("wrong result");
  }
  return absl::OkStatus();
}

// The in-process floor (see the file comment): median ms of `rounds` runs each.
json Floor(int rounds) {
  const size_t n = kMaxBytes / sizeof(float);
  const int fd = ::memfd_create("zero-bench", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(kMaxBytes)) != 0) return {{"error", "memfd"}};
  void* map = ::mmap(nullptr, kMaxBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    ::close(fd);
    return {{"error", "mmap"}};
  }
  auto* y = static_cast<volatile float*>(map);
  auto fill = [&] {
    for (size_t i = 0; i < n; ++i) y[i] = 1.0f;
  };
  fill();  // warm pages, as a client's pool
  json out;
  const char* names[] = {"fill", "memset, then fill", "MADV_REMOVE, then fill"};
  for (int mode = 0; mode < 3; ++mode) {
    std::vector<double> ms;
    for (int r = 0; r < rounds; ++r) {
      const auto t0 = Clock::now();
      if (mode == 1) std::memset(map, 0, kMaxBytes);
      if (mode == 2) ::madvise(map, kMaxBytes, MADV_REMOVE);
      fill();
      ms.push_back(UsSince(t0) / 1000.0);
    }
    out[names[mode]] = Median(ms);
  }
  ::munmap(map, kMaxBytes);
  ::close(fd);
  return out;
}

int Main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s OUT.json [OPJITD]\n", argv[0]);
    return 2;
  }
  const std::string out_path = argv[1];
  const std::string opjitd = opjit::bench::OpjitdPath(argc, argv);
  const int rounds =
      std::getenv("ZERO_BENCH_ROUNDS") ? std::atoi(std::getenv("ZERO_BENCH_ROUNDS")) : 15;
  const auto started = Clock::now();
  signal(SIGPIPE, SIG_IGN);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGSEGV, SIGBUS, SIGABRT}) signal(sig, OnFatalSignal);
  ::unsetenv(kNoZeroFillEnv);

  std::string tmpl = (fs::temp_directory_path() / "opjit-zerobench-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    perror("mkdtemp");
    return 1;
  }
  const std::string dir = tmpl;
  json result;
  result["config"] = {{"sizes", kSizes}, {"rounds", rounds},
                      {"cores", std::thread::hardware_concurrency()}};
  std::vector<Daemon> daemons(3);
  daemons[0].name = "as is";
  daemons[1].name = "zeroed";
  daemons[2].name = "keep_output_bytes";
  auto finish = [&](int rc) {
    for (auto& d : daemons) {
      if (d.region != nullptr) ::munmap(d.region, 2 * kMaxBytes);
      d.grpc.reset();
      d.fast.reset();
      if (d.process) result[d.name + " exit"] = d.process->Stop();
    }
    result["total_s"] = UsSince(started) * 1e-6;
    std::ofstream(out_path) << result.dump(1) << "\n";
    std::error_code ec;
    fs::remove_all(dir, ec);
    return rc;
  };
  auto fail = [&](const std::string& what) {
    result["error"] = what;
    fprintf(stderr, "zero_bench: %s\n", what.c_str());
    return finish(1);
  };

  for (size_t k = 0; k < daemons.size(); ++k) {
    Daemon& d = daemons[k];
    const std::string sub = dir + "/side" + std::to_string(k);
    fs::create_directories(sub);
    // One executor per namespace: every call of a side runs in the same one.
    std::ofstream(sub + "/c.toml") << "[exec]\nworkers = 1\n";
    d.process = std::make_unique<DaemonProcess>(opjitd, sub);
    // The switch reaches the daemon (and its executors) through the
    // environment it is started with.
    if (k == 0) ::setenv(kNoZeroFillEnv, "1", 1);
    auto err = d.process->Start(/*with_config=*/true);
    ::unsetenv(kNoZeroFillEnv);
    if (err) return fail("opjitd did not start: " + *err);
    auto g = Client::Connect({.address = d.process->unix_address(), .fast = "off"});
    auto f = Client::Connect({.address = d.process->unix_address(), .fast = "on"});
    if (!g.ok() || !f.ok()) return fail("connect failed");
    d.grpc = *std::move(g);
    d.fast = *std::move(f);
    for (const auto& [name, entry] : {std::pair{"square", "Square"}, std::pair{"fill", "Fill"}}) {
      if (auto r = d.grpc->Register(Op(name, entry)); !r.ok()) {
        return fail("register: " + r.status().ToString());
      }
    }
    // Output at 0, input at kMaxBytes, created by the daemon and leased to
    // the fast client: a fast call names only its own client's regions
    // (else it would quietly go over gRPC). The gRPC client is a local admin
    // of the same daemon and names it too.
    auto info = d.fast->CreateRegion(kNamespace, kRegion, 2 * kMaxBytes);
    if (!info.ok()) return fail("CreateRegion: " + info.status().ToString());
    if (auto id = d.fast->RegionId(kNamespace, kRegion); !id.ok()) {
      return fail("the fast client does not own the region: " + id.status().ToString());
    }
    const int fd = ::open(("/dev/shm" + info->shm_key()).c_str(), O_RDWR | O_CLOEXEC);
    void* map = fd < 0 ? MAP_FAILED
                       : ::mmap(nullptr, 2 * kMaxBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0) ::close(fd);
    if (map == MAP_FAILED) return fail("cannot map the region");
    d.region = static_cast<float*>(map);
    float* x = d.region + kMaxBytes / sizeof(float);
    for (size_t i = 0; i < kMaxBytes / sizeof(float); ++i) x[i] = 3.0f;
    std::memset(d.region, 0, kMaxBytes);
  }

  // Per row, one series per side: as is, zeroed, keep_output_bytes (a
  // default daemon's calls with the opt-out).
  constexpr size_t kSides = 3;
  std::vector<Series> series;
  for (uint64_t bytes : kSizes) {
    for (const char* op : {"square", "fill"}) {
      for (const char* path : {"grpc", "fast"}) {
        for (size_t k = 0; k < kSides; ++k) {
          Daemon& d = daemons[k];
          Series s;
          s.side = d.name;
          s.keep = k == 2;
          s.op = op;
          s.path = path;
          s.bytes = bytes;
          s.daemon = &d;
          s.client = std::string(path) == "fast" ? d.fast.get() : d.grpc.get();
          series.push_back(std::move(s));
        }
      }
    }
  }
  for (auto& s : series) {
    absl::Status st;
    for (int i = 0; st.ok() && i < 3; ++i) st = CallOnce(s);  // warm up
    if (!st.ok()) s.error = st.ToString();
  }
  for (int r = 0; r < rounds; ++r) {
    // The sides of one row run back to back, each first in turn.
    for (size_t k = 0; k < series.size(); k += kSides) {
      for (size_t j = 0; j < kSides; ++j) {
        Series& s = series[k + ((j + r) % kSides)];
        if (!s.error.empty()) continue;
        const auto t0 = Clock::now();
        absl::Status st = CallOnce(s);
        if (!st.ok()) {
          s.error = st.ToString();
          continue;
        }
        s.us.push_back(UsSince(t0));
      }
    }
  }

  json rows = json::array();
  bool failed = false;
  printf("| op | output | path | as is: median ms | zeroed: median ms | zeroed p90 ms "
         "| zeroed / as is | keep_output_bytes: median ms | keep p90 ms | keep / as is |\n"
         "|---|---|---|---|---|---|---|---|---|---|\n");
  for (size_t k = 0; k < series.size(); k += kSides) {
    Series& a = series[k];
    Series& z = series[k + 1];
    Series& kb = series[k + 2];
    const std::string size = a.bytes >= (1u << 20) ? std::to_string(a.bytes >> 20) + " MiB"
                                                   : std::to_string(a.bytes) + " B";
    if (!a.error.empty() || !z.error.empty() || !kb.error.empty()) {
      failed = true;
      const std::string e = !a.error.empty() ? a.error : !z.error.empty() ? z.error : kb.error;
      rows.push_back({{"op", a.op}, {"bytes", a.bytes}, {"path", a.path}, {"error", e}});
      printf("| %s | %s | %s | failed: %s | | | | | | |\n", a.op.c_str(), size.c_str(),
             a.path.c_str(), e.c_str());
      continue;
    }
    const double ma = Median(a.us) / 1000.0, mz = Median(z.us) / 1000.0;
    const double mk = Median(kb.us) / 1000.0;
    const double pz = Percentile(z.us, 0.9) / 1000.0, pk = Percentile(kb.us, 0.9) / 1000.0;
    rows.push_back({{"op", a.op}, {"bytes", a.bytes}, {"path", a.path}, {"calls", a.us.size()},
                    {"as_is_median_ms", ma}, {"zeroed_median_ms", mz}, {"zeroed_p90_ms", pz},
                    {"ratio", mz / ma}, {"keep_median_ms", mk}, {"keep_p90_ms", pk},
                    {"keep_ratio", mk / ma}});
    printf("| %s | %s | %s | %.2f | %.2f | %.2f | %.3fx | %.2f | %.2f | %.3fx |\n", a.op.c_str(),
           size.c_str(), a.path.c_str(), ma, mz, pz, mz / ma, mk, pk, mk / ma);
  }
  result["rows"] = rows;
  json floor = Floor(rounds);
  result["floor_256mib_ms"] = floor;
  printf("\nFloor, in one process, 256 MiB of a warm memfd mapping (median ms):");
  for (auto& [k, v] : floor.items()) printf(" %s %s;", k.c_str(), v.dump().c_str());
  printf("\n");
  return finish(failed ? 1 : 0);
}

}  // namespace

int main(int argc, char** argv) { return Main(argc, argv); }
