// A client for fast_it_test's leak test, to be SIGKILLed mid-call:
//
//   fast_it_child ADDRESS LEASE_MS
//
// Creates a region with a short lease, makes one fast call of op "sleep"
// (which opens the channel and prepares a handle), prints
//   client <client id>
//   key <shm key>          (one line per region of its own: data and channel)
//   calling
// and then calls "sleep" for 10 s, expecting to be killed during it. Exits 1
// (with the reason on stderr) if anything before that fails.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "client/cpp/opjit_client.h"
#include "client/cpp/shm_region.h"

namespace {

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "fast_it_child: %s: %s\n", what.c_str(), s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace opjit;
  if (argc != 3) {
    std::fprintf(stderr, "usage: fast_it_child ADDRESS LEASE_MS\n");
    return 2;
  }
  const int64_t lease_ms = std::atoll(argv[2]);
  auto c = client::Client::Connect({.address = argv[1], .fast = "on"});
  if (!c.ok()) return Fail("connect", c.status());
  auto info = (*c)->CreateRegion("", "child", 1 << 16, lease_ms);
  if (!info.ok()) return Fail("CreateRegion", info.status());
  auto map = client::ShmMapping::Open(info->shm_key(), info->byte_size());
  if (!map.ok()) return Fail("map", map.status());
  float* x = reinterpret_cast<float*>((*map)->data());
  x[0] = 1.0f;  // the kernel sleeps x[0] ms

  v1::ForwardRequest req;
  req.set_op("sleep");
  *req.add_inputs()->add_tensors() = client::ShmTensor("float32", {16}, "child", 0);
  req.add_outputs()->mutable_shm()->set_region("child");
  req.mutable_outputs(0)->mutable_shm()->set_offset(4096);
  auto first = (*c)->Forward(req);
  if (!first.ok()) return Fail("first call", first.status());
  // The channel was opened with the default lease; bring the client's lease
  // (all its regions, handles and the channel) back to the short one.
  auto renewed = (*c)->RenewLease("", lease_ms);
  if (!renewed.ok()) return Fail("RenewLease", renewed.status());
  auto regions = (*c)->ListRegions("");
  if (!regions.ok()) return Fail("ListRegions", regions.status());
  std::printf("client %s\n", (*c)->client_id().c_str());
  for (const auto& r : *regions) {
    if (r.client_id() == (*c)->client_id()) std::printf("key %s\n", r.shm_key().c_str());
  }
  x[0] = 10000.0f;
  std::printf("calling\n");
  std::fflush(stdout);
  auto slow = (*c)->Forward(req);
  std::fprintf(stderr, "fast_it_child: the call returned (%s); it should have been killed\n",
               slow.status().ToString().c_str());
  return 3;
}
