// What guarding workspaces costs per call (issue 40, item 5), measured side
// by side in one run. Each side is what AotKernelInstance::Run does per call
// for one workspace of the size given, around a kernel that writes it whole
// (a memset of its size stands in for the kernel):
//
//   heap      before guard pages: std::aligned_alloc(64), memset to zero,
//             the kernel, free
//   guarded   now: a guarded buffer kept from the call before
//             (GuardedMapping::Anonymous, made once), zeroed, the kernel,
//             the slack check after it (SlackIntact), plus SetRunning twice
//   fresh     a guarded buffer mapped and unmapped per call (what a call
//             pays when the process's budget for kept workspaces is spent)
//
// The sides take turns round by round (the order rotates); each round times
// a batch of calls per side. Prints medians (ns per call) and the ratio of
// each side to heap, and writes them as JSON.
//
//   guard_bench [OUT.json]        (GUARD_BENCH_ROUNDS, default 21)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/runner/guard_pages.h"

namespace {

using opjit::runner::guard::GuardedMapping;
using Clock = std::chrono::steady_clock;

// The kernel: writes its workspace whole (kept from being optimised away).
void Kernel(void* p, size_t n) {
  std::memset(p, 1, n);
  asm volatile("" : : "r"(p) : "memory");
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = std::getenv("GUARD_BENCH_ROUNDS") ? std::atoi(std::getenv("GUARD_BENCH_ROUNDS"))
                                                       : 21;
  const std::vector<size_t> sizes = {16, 4096, 64 << 10, 1 << 20};
  nlohmann::json out = nlohmann::json::object();
  std::printf("| workspace | heap (ns/call) | guarded | fresh | guarded/heap | fresh/heap |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (size_t size : sizes) {
    const int batch = size <= 4096 ? 20000 : size <= (64 << 10) ? 2000 : 200;
    auto kept = GuardedMapping::Anonymous(size, 64);
    if (!kept.ok()) {
      std::fprintf(stderr, "cannot map: %s\n", std::string(kept.status().message()).c_str());
      return 1;
    }
    (*kept)->Describe(opjit::runner::guard::Kind::kWorkspace, 0, 0, "Bench");
    std::map<std::string, std::function<void()>> sides = {
        {"heap",
         [&] {
           const size_t rounded = (std::max<size_t>(size, 1) + 63) / 64 * 64;
           void* p = std::aligned_alloc(64, rounded);
           std::memset(p, 0, rounded);
           Kernel(p, size);
           std::free(p);
         }},
        {"guarded",
         [&] {
           (*kept)->Zero();
           opjit::runner::guard::SetRunning("Bench");
           Kernel((*kept)->data(), size);
           opjit::runner::guard::SetRunning(nullptr);
           if (!(*kept)->SlackIntact()) std::abort();
         }},
        {"fresh",
         [&] {
           auto m = GuardedMapping::Anonymous(size, 64);
           if (!m.ok()) std::abort();
           (*m)->Describe(opjit::runner::guard::Kind::kWorkspace, 0, 0, "Bench");
           Kernel((*m)->data(), size);
           if (!(*m)->SlackIntact()) std::abort();
         }},
    };
    std::vector<std::string> order = {"heap", "guarded", "fresh"};
    std::map<std::string, std::vector<double>> ns;
    for (int r = 0; r < rounds + 1; ++r) {
      std::rotate(order.begin(), order.begin() + 1, order.end());
      for (const std::string& side : order) {
        const auto t0 = Clock::now();
        for (int i = 0; i < batch; ++i) sides[side]();
        const double per = std::chrono::duration<double, std::nano>(Clock::now() - t0).count() /
                           batch;
        if (r > 0) ns[side].push_back(per);  // round 0 warms up
      }
    }
    const double heap = Median(ns["heap"]), guarded = Median(ns["guarded"]),
                 fresh = Median(ns["fresh"]);
    std::printf("| %zu B | %.0f | %.0f | %.0f | %.2f | %.2f |\n", size, heap, guarded, fresh,
                guarded / heap, fresh / heap);
    out[std::to_string(size)] = {{"heap_ns", heap},
                                 {"guarded_ns", guarded},
                                 {"fresh_ns", fresh},
                                 {"guarded_over_heap", guarded / heap},
                                 {"fresh_over_heap", fresh / heap},
                                 {"rounds", rounds},
                                 {"batch", batch}};
  }
  if (argc > 1) std::ofstream(argv[1]) << out.dump(2) << "\n";
  return 0;
}
