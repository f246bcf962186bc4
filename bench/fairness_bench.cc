// A small compile's latency while two template bombs compile, with the long
// lane (the default) and without it (long_after_ms = 0: how every compiler
// before the lane behaved), measured side by side in one run, alternating.
//
//   fairness_bench OUT.json [rounds]
//
// Each round starts two bombs (constant evaluation that would run for
// minutes; the compile limit stops them at kTimeoutMs), then compiles small
// distinct kernels one after another until both bombs are done, and records
// each small compile's latency. An idle baseline (no bombs) runs too.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/compiler/kernel_compiler.h"

namespace {

namespace fs = std::filesystem;
using opjit::compiler::CompileJob;
using opjit::compiler::KernelCompiler;
using Clock = std::chrono::steady_clock;

constexpr int kTimeoutMs = 8000;

std::string Bomb(int id) {
  return "#include <utility>\n"
         "constexpr long Spin(long n) { long s = 0; for (long i = 0; i < n; ++i) "
         "s = (s * 31 + i) % 1000003; return s; }\n"
         "template <int I> struct Slow { static constexpr long v = Spin(100000 + I + " +
         std::to_string(id) +
         "); };\n"
         "template <int... I> long Sum(std::integer_sequence<int, I...>) {\n"
         "  static constexpr long v[] = {Slow<I>::v...}; long s = 0; for (long x : v) s += x; "
         "return s; }\n"
         "long total = Sum(std::make_integer_sequence<int, 5000>{});\n";
}

std::string Small(int id) {
  return "#include <cmath>\nextern \"C\" int K(int n, void** p, int* nd, long** sh, const char** "
         "dt, void* s, void* e) { (void)n; (void)nd; (void)sh; (void)dt; (void)s; (void)e; "
         "float* x = static_cast<float*>(p[0]); x[0] = std::tanh(x[0]) + " +
         std::to_string(id) + "; return 0; }\n";
}

CompileJob Job(std::string source) {
  CompileJob j;
  j.source = std::move(source);
  j.language = "c++";
  return j;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Mode {
  std::string name;
  int long_after_ms;
  int pool_threads;
  std::vector<double> small_ms;
  std::vector<double> wait_ms;  // the longest small compile of each round
};

std::unique_ptr<KernelCompiler> MakeCompiler(const std::string& dir, const Mode& m) {
  opjit::compiler::KernelCompilerOptions o;
  o.cache_dir = dir;
  o.workers = 2;
  o.timeout_ms = kTimeoutMs;
  o.kernel_include_dir = OPJIT_KERNEL_INCLUDE_DIR;
  o.long_after_ms = m.long_after_ms;
  o.pool_threads = m.pool_threads;
  o.header_recheck_ms = 0;
  auto c = KernelCompiler::Create(o);
  if (!c.ok()) {
    std::fprintf(stderr, "compiler: %s\n", c.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(c);
}

double CompileMs(KernelCompiler* c, std::string source) {
  auto t0 = Clock::now();
  auto r = c->Compile(Job(std::move(source)));
  if (!r.ok()) {
    std::fprintf(stderr, "small compile failed: %s\n", r.status().ToString().c_str());
    std::exit(1);
  }
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s OUT.json [rounds]\n", argv[0]);
    return 2;
  }
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 2;
  std::string root = (fs::temp_directory_path() / "opjit-fairness-XXXXXX").string();
  if (::mkdtemp(root.data()) == nullptr) return 1;
  // "before": no lane, and the compile pool of two threads it had.
  std::vector<Mode> modes = {{"long lane (default)", 1000, 0, {}, {}},
                             {"no long lane (before)", 0, 2, {}, {}}};
  int id = 0;
  std::vector<double> idle;
  for (int round = 0; round < rounds; ++round) {
    for (Mode& m : modes) {
      const std::string dir = root + "/" + std::to_string(id++);
      auto c = MakeCompiler(dir, m);
      for (int i = 0; i < 3; ++i) idle.push_back(CompileMs(c.get(), Small(++id)));
      std::vector<std::future<void>> bombs;
      std::atomic<int> left{2};
      for (int b = 0; b < 2; ++b) {
        c->CompileAsync(Job(Bomb(++id)), [&left](auto) { left.fetch_sub(1); });
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // both bombs are long now
      double worst = 0;
      while (left.load() > 0) {
        double ms = CompileMs(c.get(), Small(++id));
        m.small_ms.push_back(ms);
        worst = std::max(worst, ms);
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
      m.wait_ms.push_back(worst);
      std::fprintf(stderr, "round %d, %s: %zu small compiles, median %.0f ms, worst %.0f ms\n",
                   round, m.name.c_str(), m.small_ms.size(), Median(m.small_ms), worst);
    }
  }
  nlohmann::json out;
  out["timeout_ms"] = kTimeoutMs;
  out["idle_median_ms"] = Median(idle);
  for (const Mode& m : modes) {
    out["modes"].push_back({{"name", m.name},
                            {"samples", m.small_ms.size()},
                            {"median_ms", Median(m.small_ms)},
                            {"worst_ms", *std::max_element(m.wait_ms.begin(), m.wait_ms.end())}});
  }
  std::ofstream(argv[1]) << out.dump(2) << "\n";
  std::error_code ec;
  fs::remove_all(root, ec);
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
