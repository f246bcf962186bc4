// What the executors' namespaces cost (issue 27, item 1): two opjitd
// processes started here and measured side by side in one run:
//
//   off   [exec] namespaces = false: executors and compile workers in the
//         daemon's PID, mount, IPC, network and UTS namespaces (the
//         behaviour before issue 27)
//   on    the default: each executor is process 1 of a PID namespace of its
//         own, with new mount, IPC, network and UTS namespaces and a private
//         tmpfs over its /tmp
//
// The namespaces are made when an executor starts, so the rows are:
//   1. executor start: the first call of a tiny op (leaky_relu, 16 float32
//      inline) in a namespace that has never run anything. The op is
//      registered there first (a row of its own; its object is already in the compile
//      cache, which holds the same bytes for every namespace), so the call
//      times the daemon's new executor pool: spawn, sandbox, load, Init, run.
//      Then a fast-path client in that namespace times its first call, which
//      opens a channel (a dedicated executor of its own).
//   2. crash -> next good call: a kernel segfaults its executor (ABORTED),
//      the next good call of the same op starts a fresh executor (as
//      call_bench's crash recovery).
//   3. tiny call over gRPC (fast path off), warm executor.
//   4. tiny call on the fast channel (leaky_relu, 16 float32 in shm).
//   5. compile worker start: registering a kernel never compiled before (a
//      salted copy) in a new namespace; compile workers serve one namespace
//      each, so this starts one and compiles (the compile is most of it).
// The sides take turns: call by call for rows 1-3 and 5 (the order flips each
// round), in batches of 100 calls for row 4 (a channel's executor spins
// 50 us after each call, so alternating single calls would keep both sides'
// executors spinning on this 2-core machine at once). Medians, p90 and the
// on/off ratio. A check reads /proc: the "on" side's executors must be in
// PID and network namespaces other than this process's, the "off" side's in
// the same.
//
//   isolation_bench OUT.json [OPJITD]
//     ISOLATION_BENCH_STARTS (default 20): new namespaces per side
//     ISOLATION_BENCH_CALLS (default 2000): tiny gRPC calls per side
//
// Needs root (the daemon makes namespaces only as root); otherwise it
// records {"skipped": ...}, prints "skipped: <reason>" (bench/report.py
// shows the section as skipped) and measures nothing. Prints a markdown
// table. A row that fails is recorded with its error; no number is made up.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_daemon.h"
#include "client/cpp/opjit_client.h"
#include "client/cpp/shm_region.h"

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

constexpr char kBenchNs[] = "bench";
constexpr int kTinyFloats = 16;
constexpr int kFastRounds = 40;
constexpr int kFastBatch = 100;
constexpr int kCrashSamples = 15;

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

// A copy kernel whose source carries `salt`: a new object for the cache
// every time, so registering it compiles.
v1::OpDef SaltedCopy(const std::string& ns, const std::string& salt) {
  v1::OpDef op;
  op.set_namespace_(ns);
  op.set_name("copy");
  op.add_inputs()->set_name("x");
  op.add_outputs()->set_name("y");
  auto* df = op.add_dtype_formats();
  df->add_dtypes("float32");
  df->add_dtypes("float32");
  auto* impl = op.add_implementations();
  impl->set_target("CPU");
  impl->set_entry("Copy");
  impl->set_source("// " + salt +
                   "\n#include <cstdint>\n"
                   "extern \"C\" int Copy(int, void** p, int*, int64_t** s, const char**, void*, "
                   "void*) {\n"
                   "  for (int64_t i = 0; i < s[0][0]; ++i)\n"
                   "    static_cast<float*>(p[1])[i] = static_cast<const float*>(p[0])[i];\n"
                   "  return 0;\n}\n");
  return op;
}

float Input(int i) { return static_cast<float>(i % 97) * 0.1f - 4.0f; }
float Expected(float x) { return x > 0.0f ? x : 0.01f * x; }

v1::ForwardRequest TinyInline(const std::string& ns, const std::string& op) {
  std::vector<float> x(kTinyFloats);
  for (int i = 0; i < kTinyFloats; ++i) x[i] = Input(i);
  v1::ForwardRequest req;
  req.set_namespace_(ns);
  req.set_op(op);
  *req.add_inputs()->add_tensors() = opjit::client::InlineTensor(
      "float32", {kTinyFloats},
      std::string_view(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(float)));
  return req;
}

// A tiny inline call, its output checked.
absl::Status CallInline(Client& c, const v1::ForwardRequest& req) {
  auto r = c.Forward(req);
  if (!r.ok()) return r.status();
  if (r->outputs_size() != 1 || r->outputs(0).inline_data().size() != kTinyFloats * 4) {
    return absl::InternalError("unexpected output");
  }
  const auto* y = reinterpret_cast<const float*>(r->outputs(0).inline_data().data());
  for (int i = 0; i < kTinyFloats; ++i) {
    if (y[i] != Expected(Input(i))) return absl::InternalError("wrong result");
  }
  return absl::OkStatus();
}

// A fast-path client ("on": a call that qualifies fails rather than falling
// back to gRPC) with its own region in `ns`: 16 floats in at 0, out at 4096.
struct FastCaller {
  std::unique_ptr<Client> client;
  std::unique_ptr<opjit::client::ShmMapping> map;
  v1::ForwardRequest req;

  static absl::StatusOr<std::unique_ptr<FastCaller>> Make(const std::string& address,
                                                          const std::string& ns) {
    auto out = std::make_unique<FastCaller>();
    auto c = Client::Connect({.address = address, .fast = "on"});
    if (!c.ok()) return c.status();
    out->client = *std::move(c);
    const std::string region = "tiny";
    auto info = out->client->CreateRegion(ns, region, 8192);
    if (!info.ok()) return info.status();
    auto map = opjit::client::ShmMapping::Open(info->shm_key(), info->byte_size());
    if (!map.ok()) return map.status();
    out->map = *std::move(map);
    auto* x = reinterpret_cast<float*>(out->map->data());
    for (int i = 0; i < kTinyFloats; ++i) x[i] = Input(i);
    out->req.set_namespace_(ns);
    out->req.set_op("leaky_relu");
    *out->req.add_inputs()->add_tensors() =
        opjit::client::ShmTensor("float32", {kTinyFloats}, region, 0);
    auto* place = out->req.add_outputs()->mutable_shm();
    place->set_region(region);
    place->set_offset(4096);
    return out;
  }

  absl::Status Call() {
    auto r = client->Forward(req);
    if (!r.ok()) return r.status();
    const auto* y = reinterpret_cast<const float*>(map->data() + 4096);
    if (y[0] != Expected(Input(0)) || y[kTinyFloats - 1] != Expected(Input(kTinyFloats - 1))) {
      return absl::InternalError("wrong result");
    }
    return absl::OkStatus();
  }
};

// One daemon of the comparison.
struct Side {
  std::string name;
  std::unique_ptr<DaemonProcess> process;
  std::unique_ptr<Client> grpc;  // fast path off
  std::unique_ptr<FastCaller> fast;
  v1::OpDef leaky_relu;
  json ns_check;
};

// One row's samples for both sides.
struct Row {
  Row(std::string k, std::string w, std::string u)
      : key(std::move(k)), what(std::move(w)), unit(std::move(u)) {}
  std::string key, what, unit;  // unit: "ms" or "us"
  std::vector<double> us[2];
  std::string error;
};

// /proc/<pid>/ns/<kind>, e.g. "pid:[4026531836]"; "" if unreadable.
std::string NsLink(const std::string& pid, const char* kind) {
  std::error_code ec;
  auto target = fs::read_symlink("/proc/" + pid + "/ns/" + kind, ec);
  return ec ? "" : target.string();
}

// The executors (opjit-exec-worker, children of `daemon`) and how many of
// them are in PID, network and mount namespaces other than this process's.
json CheckNamespaces(pid_t daemon) {
  int executors = 0, own_pid = 0, own_net = 0, own_mnt = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = opjit::bench::ReadFile((e.path() / "stat").string());
    const auto open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    if (stat.substr(open + 1, close - open - 1) != "opjit-exec-work") continue;
    std::istringstream rest(stat.substr(close + 2));
    std::string state;
    long ppid = 0;
    rest >> state >> ppid;
    if (ppid != daemon) continue;
    ++executors;
    own_pid += NsLink(name, "pid") != NsLink("self", "pid");
    own_net += NsLink(name, "net") != NsLink("self", "net");
    own_mnt += NsLink(name, "mnt") != NsLink("self", "mnt");
  }
  return {{"executors", executors},
          {"in_own_pid_ns", own_pid},
          {"in_own_net_ns", own_net},
          {"in_own_mnt_ns", own_mnt}};
}

std::string Fmt(double v, const std::string& unit) {
  char buf[64];
  if (unit == "ms") {
    std::snprintf(buf, sizeof buf, "%.1f ms", v / 1000.0);
  } else {
    std::snprintf(buf, sizeof buf, v < 10 ? "%.2f µs" : "%.1f µs", v);
  }
  return buf;
}

int Main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s OUT.json [OPJITD]\n", argv[0]);
    return 2;
  }
  const std::string out_path = argv[1];
  const std::string opjitd = opjit::bench::OpjitdPath(argc, argv);
  auto env_int = [](const char* name, int fallback) {
    const char* v = std::getenv(name);
    return v != nullptr && std::atoi(v) > 0 ? std::atoi(v) : fallback;
  };
  const int starts = env_int("ISOLATION_BENCH_STARTS", 20);
  const int calls = env_int("ISOLATION_BENCH_CALLS", 2000);
  const auto started = Clock::now();
  json result;
  result["config"] = {{"starts", starts},
                      {"grpc_calls", calls},
                      {"fast_calls", kFastRounds * kFastBatch},
                      {"fast_batch", kFastBatch},
                      {"crash_samples", kCrashSamples},
                      {"tiny_floats", kTinyFloats},
                      {"cores", std::thread::hardware_concurrency()}};
  if (::geteuid() != 0) {
    // Skipped on purpose: bench/report.py shows "skipped: <reason>" as such.
    result["skipped"] =
        "needs root: opjitd makes the executors' namespaces only when started as root";
    std::ofstream(out_path) << result.dump(1) << "\n";
    fprintf(stderr, "isolation_bench: %s\n", result["skipped"].get<std::string>().c_str());
    printf("skipped: %s.\n", result["skipped"].get<std::string>().c_str());
    return 0;
  }
  signal(SIGPIPE, SIG_IGN);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGSEGV, SIGBUS, SIGABRT}) signal(sig, OnFatalSignal);

  std::string tmpl = (fs::temp_directory_path() / "opjit-isolationbench-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    perror("mkdtemp");
    return 1;
  }
  const std::string dir = tmpl;
  std::vector<Side> sides(2);
  sides[0].name = "off";
  sides[1].name = "on";
  auto finish = [&](int rc) {
    for (auto& s : sides) {
      s.fast.reset();
      s.grpc.reset();
      if (s.process) result["exit_" + s.name] = s.process->Stop();
    }
    result["total_s"] = UsSince(started) * 1e-6;
    std::ofstream(out_path) << result.dump(1) << "\n";
    std::error_code ec;
    fs::remove_all(dir, ec);
    return rc;
  };
  auto fail = [&](const std::string& what) {
    result["error"] = what;
    fprintf(stderr, "isolation_bench: %s\n", what.c_str());
    return finish(1);
  };

  auto leaky = opjit::client::LoadOpSpec(std::string(OPJIT_SOURCE_DIR) +
                                         "/kernels/examples/leaky_relu.json");
  auto crashy = opjit::client::ParseOpSpec(kCrashySpec, OPJIT_SOURCE_DIR);
  if (!leaky.ok() || !crashy.ok()) return fail("cannot read the op specs");

  for (size_t k = 0; k < sides.size(); ++k) {
    Side& s = sides[k];
    const std::string sub = dir + "/" + s.name;
    fs::create_directories(sub);
    // One executor per namespace: a crash leaves none warm, and every call
    // of a side runs in the same one. Enough namespaces for every start;
    // call credit never the bound (as fast_bench); crashes never quarantine.
    std::ofstream(sub + "/c.toml")
        << "[exec]\nworkers = 1\nquarantine_after = 1000\n"
        << (k == 0 ? "namespaces = false\n" : "") << "[quota]\nnamespaces = " << 2 * starts + 16
        << "\ncalls_per_second = 10000000\n";
    s.process = std::make_unique<DaemonProcess>(opjitd, sub);
    if (auto err = s.process->Start(/*with_config=*/true)) {
      return fail("opjitd (" + s.name + ") did not start: " + *err);
    }
    auto g = Client::Connect({.address = s.process->unix_address(), .fast = "off"});
    if (!g.ok()) return fail("connect: " + g.status().ToString());
    s.grpc = *std::move(g);
    s.leaky_relu = *leaky;
    s.leaky_relu.set_namespace_(kBenchNs);
    v1::OpDef crash_op = *crashy;
    crash_op.set_namespace_(kBenchNs);
    // The first registration compiles; every later one hits the cache.
    for (const v1::OpDef* op : {&s.leaky_relu, &crash_op}) {
      if (auto r = s.grpc->Register(*op); !r.ok()) {
        return fail("register (" + s.name + "): " + r.status().ToString());
      }
    }
    auto f = FastCaller::Make(s.process->unix_address(), kBenchNs);
    if (!f.ok()) return fail("fast client (" + s.name + "): " + f.status().ToString());
    s.fast = *std::move(f);
    const v1::ForwardRequest tiny = TinyInline(kBenchNs, "leaky_relu");
    for (int i = 0; i < 20; ++i) {
      absl::Status st = CallInline(*s.grpc, tiny);
      if (st.ok()) st = s.fast->Call();
      if (!st.ok()) return fail("warm-up (" + s.name + "): " + st.ToString());
    }
    s.ns_check = CheckNamespaces(s.process->pid());
  }

  // Runs `one(side)` for both sides `rounds` times, `batch` calls a turn,
  // the first side flipping each round; keeps the microseconds it returns.
  auto alternate = [&](Row& row, int rounds, int batch,
                       const std::function<absl::StatusOr<double>(Side&, int)>& one) {
    for (int r = 0; r < rounds && row.error.empty(); ++r) {
      for (int j = 0; j < 2 && row.error.empty(); ++j) {
        const int k = (j + r) % 2;
        for (int b = 0; b < batch; ++b) {
          auto us = one(sides[k], r);
          if (!us.ok()) {
            row.error = sides[k].name + ": " + us.status().ToString();
            break;
          }
          row.us[k].push_back(*us);
        }
      }
    }
  };
  auto timed = [](const std::function<absl::Status()>& call) -> absl::StatusOr<double> {
    const auto t0 = Clock::now();
    absl::Status st = call();
    const double us = UsSince(t0);
    if (!st.ok()) return st;
    return us;
  };

  std::vector<Row> rows = {
      Row("executor_start", "executor start: first call in a new namespace", "ms"),
      Row("channel_start", "fast channel start: first fast call in a new namespace", "ms"),
      Row("crash_recovery", "crash -> next good call (fresh executor)", "ms"),
      Row("register_new_ns", "register in a new namespace (cache hit; no executor)", "ms"),
      Row("compile_new_ns",
          "register a new kernel in a new namespace (compile worker start + cold compile)", "ms"),
      Row("tiny_grpc", "tiny call, gRPC (fast path off), warm", "us"),
      Row("tiny_fast", "tiny call, fast channel, warm", "us")};
  Row& start_pool = rows[0];
  Row& start_channel = rows[1];
  Row& crash = rows[2];
  Row& register_row = rows[3];
  Row& compile_row = rows[4];
  Row& grpc_row = rows[5];
  Row& fast_row = rows[6];

  // 3 and 4 first, on a machine with nothing but the warm executors.
  const v1::ForwardRequest tiny = TinyInline(kBenchNs, "leaky_relu");
  alternate(grpc_row, calls, 1,
            [&](Side& s, int) { return timed([&] { return CallInline(*s.grpc, tiny); }); });
  alternate(fast_row, kFastRounds, kFastBatch,
            [&](Side& s, int) { return timed([&] { return s.fast->Call(); }); });

  // 1: new namespaces.
  alternate(start_pool, starts, 1, [&](Side& s, int r) -> absl::StatusOr<double> {
    const std::string ns = "start-" + std::to_string(r);
    v1::OpDef op = s.leaky_relu;
    op.set_namespace_(ns);
    auto reg = timed([&] { return s.grpc->Register(op).status(); });
    if (!reg.ok()) return reg.status();
    register_row.us[&s - sides.data()].push_back(*reg);
    return timed([&] { return CallInline(*s.grpc, TinyInline(ns, "leaky_relu")); });
  });
  for (auto& s : sides) s.ns_check["after_starts"] = CheckNamespaces(s.process->pid());
  alternate(start_channel, starts, 1, [&](Side& s, int r) -> absl::StatusOr<double> {
    auto f = FastCaller::Make(s.process->unix_address(), "start-" + std::to_string(r));
    if (!f.ok()) return f.status();
    auto us = timed([&] { return (*f)->Call(); });
    if (us.ok()) {
      // A second call, untimed, proves the first did not leave the path.
      if (absl::Status st = (*f)->Call(); !st.ok()) return st;
    }
    return us;  // the client goes: its channel and executor with it
  });

  // Compile workers serve one namespace each: a new namespace's compile
  // starts one (ending another namespace's when the pool is full).
  alternate(compile_row, starts, 1, [&](Side& s, int r) -> absl::StatusOr<double> {
    const std::string salt = s.name + "-" + std::to_string(r) + "-" + std::to_string(::getpid());
    const v1::OpDef op = SaltedCopy("compile-" + std::to_string(r), salt);
    return timed([&] { return s.grpc->Register(op).status(); });
  });

  // 2: crash, then time the next good call.
  const v1::ForwardRequest good = TinyInline(kBenchNs, "crashy");
  v1::ForwardRequest bad = good;
  (*bad.mutable_attrs())["crash"].set_b(true);
  alternate(crash, kCrashSamples, 1, [&](Side& s, int) -> absl::StatusOr<double> {
    auto crashed = s.grpc->Forward(bad);
    if (crashed.ok() || crashed.status().code() != absl::StatusCode::kAborted) {
      return absl::InternalError("the crashing call answered " + crashed.status().ToString());
    }
    return timed([&] { return s.grpc->Forward(good).status(); });
  });

  // Report.
  json out_rows = json::array();
  bool failed = false;
  printf(
      "| what | off: median | off: p90 | on: median | on: p90 | on / off (medians) |\n"
      "|---|---|---|---|---|---|\n");
  for (Row& row : rows) {
    if (!row.error.empty()) {
      failed = true;
      out_rows.push_back({{"key", row.key}, {"what", row.what}, {"error", row.error}});
      printf("| %s | failed: %s | | | | |\n", row.what.c_str(), row.error.c_str());
      continue;
    }
    const double ma = Median(row.us[0]), mb = Median(row.us[1]);
    const double pa = Percentile(row.us[0], 0.9), pb = Percentile(row.us[1], 0.9);
    out_rows.push_back({{"key", row.key},
                        {"what", row.what},
                        {"samples", row.us[0].size()},
                        {"off_median_us", ma},
                        {"off_p90_us", pa},
                        {"on_median_us", mb},
                        {"on_p90_us", pb},
                        {"ratio", mb / ma},
                        {"off_us_sorted", row.us[0]},
                        {"on_us_sorted", row.us[1]}});
    printf("| %s | %s | %s | %s | %s | %.2fx |\n", row.what.c_str(), Fmt(ma, row.unit).c_str(),
           Fmt(pa, row.unit).c_str(), Fmt(mb, row.unit).c_str(), Fmt(pb, row.unit).c_str(),
           mb / ma);
  }
  result["rows"] = out_rows;
  printf(
      "\nSamples a side: %d new namespaces, %d crashes, %d gRPC calls (alternating call by "
      "call), %d fast calls (alternating in batches of %d).\n",
      starts, kCrashSamples, calls, kFastRounds * kFastBatch, kFastBatch);
  // A fast call is either ~2 us or, when the executor waits for the CPU the
  // client spins on, the client's 50 us spin and a futex wake: the share of
  // the slow kind says which a median reflects.
  if (fast_row.error.empty()) {
    auto slow = [](const std::vector<double>& v) {
      return 100.0 *
             static_cast<double>(
                 std::count_if(v.begin(), v.end(), [](double us) { return us > 20; })) /
             static_cast<double>(v.size());
    };
    result["fast_over_20us_pct"] = {{"off", slow(fast_row.us[0])}, {"on", slow(fast_row.us[1])}};
    printf("Fast calls over 20 µs: off %.1f%%, on %.1f%%.\n", slow(fast_row.us[0]),
           slow(fast_row.us[1]));
  }
  for (auto& s : sides) {
    result["namespaces_check"][s.name] = s.ns_check;
    const json& c = s.ns_check["after_starts"];
    printf(
        "%s: %d executors, %d in a PID namespace of their own, %d in a network namespace of "
        "their own.\n",
        s.name.c_str(), c["executors"].get<int>(), c["in_own_pid_ns"].get<int>(),
        c["in_own_net_ns"].get<int>());
  }
  // The check itself: "on" must isolate every executor, "off" none.
  const json& on = sides[1].ns_check["after_starts"];
  const json& off = sides[0].ns_check["after_starts"];
  if (on["executors"].get<int>() == 0 || on["in_own_pid_ns"] != on["executors"] ||
      on["in_own_net_ns"] != on["executors"] || off["in_own_pid_ns"].get<int>() != 0) {
    result["error"] = "the namespaces are not what the sides' configs say";
    fprintf(stderr, "isolation_bench: %s\n", result["error"].get<std::string>().c_str());
    failed = true;
  }
  return finish(failed ? 1 : 0);
}

}  // namespace

int main(int argc, char** argv) { return Main(argc, argv); }
