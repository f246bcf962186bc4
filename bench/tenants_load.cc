// The load of bench/tenants_bench.py: one client per namespace, each a
// thread of this process with a Client of its own (its own fast channel,
// region and prepared handles), calling a cached tiny op (16 float32) at a
// fixed rate, open loop (client k of n makes call i at start + (i + k/n) /
// rate: spread over the period; a late call goes at once and its latency
// counts from when it was sent).
//
//   tenants_load ADDRESS OPS RATE SECONDS START_UNIX_S NS...
//
// Each client warms its namespace's ops op0..op<OPS-1> (3 calls each), waits
// for START_UNIX_S, then calls them in turn. Prints {"samples_us": [...],
// "errors": [...]} on stdout. A C++ load generator, so that what the clients
// burn per call (a few µs) does not crowd out the daemon on a small machine.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "client/cpp/opjit_client.h"
#include "client/cpp/shm_region.h"

namespace {

using opjit::client::Client;
using Clock = std::chrono::steady_clock;
namespace v1 = opjit::v1;

struct Load {
  std::string address;
  int ops = 0;
  double rate = 0, seconds = 0, start_unix_s = 0;
};

struct Output {
  std::mutex mu;
  std::vector<double> samples_us;
  std::vector<std::string> errors;
};

// `phase` in [0, 1): where in each period this client's calls fall, so the
// clients are spread over the period as independent tenants would be (all
// at the same instant they would queue behind each other by construction).
absl::Status RunClient(const Load& load, const std::string& ns, int index, double phase,
                       Output* out) {
  auto c = Client::Connect({.address = load.address, .fast = "on"});
  if (!c.ok()) return c.status();
  Client& client = **c;
  const std::string region = "load" + std::to_string(index);
  auto info = client.CreateRegion(ns, region, 8192);
  if (!info.ok()) return info.status();
  auto map = opjit::client::ShmMapping::Open(info->shm_key(), info->byte_size());
  if (!map.ok()) return map.status();
  float* x = reinterpret_cast<float*>((*map)->data());
  for (int i = 0; i < 16; ++i) x[i] = static_cast<float>(i);
  auto id = client.RegionId(ns, region);
  if (!id.ok()) return id.status();
  const std::vector<opjit::client::FastTensorRef> refs = {{*id, 0}, {*id, 4096}};
  std::vector<opjit::client::PreparedCall> handles;
  for (int k = 0; k < load.ops; ++k) {
    v1::PrepareRequest p;
    p.set_namespace_(ns);
    p.set_op("op" + std::to_string(k));
    auto* t = p.add_inputs()->add_tensors();
    t->set_dtype("float32");
    t->add_shape(16);
    auto h = client.PrepareHandle(p);
    if (!h.ok()) return h.status();
    for (int w = 0; w < 3; ++w) {
      if (auto r = client.CallPrepared(*h, refs); !r.ok()) return r.status();
    }
    handles.push_back(*std::move(h));
  }
  const auto start = std::chrono::system_clock::time_point(
      std::chrono::duration_cast<std::chrono::system_clock::duration>(
          std::chrono::duration<double>(load.start_unix_s)));
  std::this_thread::sleep_until(start);
  const auto t0 = Clock::now();
  const int n = static_cast<int>(load.rate * load.seconds);
  std::vector<double> samples;
  samples.reserve(n);
  for (int i = 0; i < n; ++i) {
    std::this_thread::sleep_until(t0 + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>((i + phase) / load.rate)));
    const auto t = Clock::now();
    auto r = client.CallPrepared(handles[i % handles.size()], refs);
    samples.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t).count());
    if (!r.ok()) return r.status();
  }
  const float* y = x + 1024;
  if (y[1] != 2.0f) return absl::InternalError("wrong output");
  std::lock_guard<std::mutex> lock(out->mu);
  out->samples_us.insert(out->samples_us.end(), samples.begin(), samples.end());
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s ADDRESS OPS RATE SECONDS START_UNIX_S NS...\n", argv[0]);
    return 2;
  }
  const Load load{argv[1], std::atoi(argv[2]), std::atof(argv[3]), std::atof(argv[4]),
                  std::atof(argv[5])};
  Output out;
  std::vector<std::thread> threads;
  const int clients = argc - 6;
  for (int i = 6; i < argc; ++i) {
    threads.emplace_back([&, i] {
      const double phase = static_cast<double>(i - 6) / clients;
      if (absl::Status s = RunClient(load, argv[i], i, phase, &out); !s.ok()) {
        std::lock_guard<std::mutex> lock(out.mu);
        out.errors.push_back(std::string(argv[i]) + ": " + s.ToString());
      }
    });
  }
  for (auto& t : threads) t.join();
  std::printf("%s\n", nlohmann::json{{"samples_us", out.samples_us}, {"errors", out.errors}}.dump().c_str());
  return out.errors.empty() ? 0 : 1;
}
