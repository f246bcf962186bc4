// What identity costs per call: a cached tiny op (16 float32 inline in and
// out, gRPC only, no fast channel) against two opjitd processes started here,
// measured side by side in one run:
//
//   open   unix    the embedded default: no principals, the socket's owner
//   open   tcp     the same daemon over TCP 127.0.0.1, plaintext
//   shared unix    a daemon with principals: the caller known by SO_PEERCRED
//   shared token   the same daemon, unix socket, "authorization: Bearer"
//   shared tls     the same daemon over TCP 127.0.0.1 with TLS and the token
//
// The sides take turns in batches (the order rotates each round) so that all
// see the same machine state; medians, p90 and the ratio to "open unix".
// Channels are opened once, so the TLS handshake is not in the per-call
// numbers (it is measured on its own: connect + first call, fresh channel).
//
//   auth_bench OUT.json [OPJITD]     (AUTH_BENCH_ROUNDS, default 60)
//
// Needs openssl for the test CA. A side that fails is recorded as
// {"error": ...}; no number is made up.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
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
using opjit::client::ClientOptions;

constexpr int kTinyFloats = 16;
constexpr int kBatch = 50;
constexpr char kNamespace[] = "bench";
// A fixed token (this is a benchmark's throwaway daemon) and its sha256.
constexpr char kToken[] = "opjit-auth-bench-token-0123456789abcdef";

constexpr char kKernel[] = R"(#include <cstdint>
extern "C" int Twice(int, void** p, int* nd, int64_t** s, const char**, void*, void*) {
  int64_t n = 1;
  for (int i = 0; i < nd[0]; ++i) n *= s[0][i];
  for (int64_t i = 0; i < n; ++i) static_cast<float*>(p[1])[i] = 2.0f * static_cast<float*>(p[0])[i];
  return 0;
}
)";

int Sh(const std::string& cmd) { return std::system(cmd.c_str()); }

// A CA and a server certificate for 127.0.0.1, made by openssl in `dir`.
bool MakeCertificates(const std::string& dir) {
  const std::string q = " >/dev/null 2>&1";
  return Sh("cd " + dir + " && openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=bench-ca" +
            " -keyout ca.key -out ca.pem" + q) == 0 &&
         Sh("cd " + dir + " && printf 'subjectAltName=IP:127.0.0.1\\n' > san.ext && openssl req" +
            " -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout server.key -out server.csr" + q) ==
             0 &&
         Sh("cd " + dir + " && openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key" +
            " -CAcreateserial -days 2 -extfile san.ext -out server.pem" + q) == 0;
}

std::string TokenSha256(const std::string& dir) {
  const std::string out = dir + "/token.sha";
  if (Sh("printf '%s' '" + std::string(kToken) + "' | sha256sum | cut -c1-64 > " + out) != 0) return "";
  std::string s = opjit::bench::ReadFile(out);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

v1::OpDef TwiceOp() {
  v1::OpDef op;
  op.set_namespace_(kNamespace);
  op.set_name("twice");
  op.add_inputs()->set_name("x");
  op.add_outputs()->set_name("y");
  auto* df = op.add_dtype_formats();
  df->add_dtypes("float32");
  df->add_dtypes("float32");
  auto* impl = op.add_implementations();
  impl->set_target("CPU");
  impl->set_entry("Twice");
  impl->set_source(kKernel);
  return op;
}

v1::ForwardRequest TinyCall() {
  std::vector<float> x(kTinyFloats);
  for (int i = 0; i < kTinyFloats; ++i) x[i] = static_cast<float>(i) - 4.0f;
  v1::ForwardRequest req;
  req.set_namespace_(kNamespace);
  req.set_op("twice");
  *req.add_inputs()->add_tensors() = opjit::client::InlineTensor(
      "float32", {kTinyFloats},
      std::string(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(float)));
  return req;
}

struct Side {
  std::string name, what;
  ClientOptions options;
  std::unique_ptr<Client> client;
  std::vector<double> us;
  std::string error;
};

// One call, checked: y == 2x.
absl::Status CallOnce(Client& c, const v1::ForwardRequest& req) {
  auto r = c.Forward(req);
  if (!r.ok()) return r.status();
  if (r->outputs_size() != 1 || r->outputs(0).inline_data().size() != kTinyFloats * sizeof(float)) {
    return absl::InternalError("wrong output shape");
  }
  const auto* y = reinterpret_cast<const float*>(r->outputs(0).inline_data().data());
  for (int i = 0; i < kTinyFloats; ++i) {
    if (y[i] != 2.0f * (static_cast<float>(i) - 4.0f)) return absl::InternalError("wrong result");
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s OUT.json [OPJITD]\n", argv[0]);
    return 2;
  }
  const std::string out_path = argv[1];
  const std::string opjitd = opjit::bench::OpjitdPath(argc, argv);
  const int rounds = std::getenv("AUTH_BENCH_ROUNDS") ? std::atoi(std::getenv("AUTH_BENCH_ROUNDS")) : 60;
  const auto started = Clock::now();
  signal(SIGPIPE, SIG_IGN);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGSEGV, SIGBUS, SIGABRT}) signal(sig, OnFatalSignal);

  std::string tmpl = (fs::temp_directory_path() / "opjit-authbench-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    perror("mkdtemp");
    return 1;
  }
  const std::string dir = tmpl;
  json result;
  result["config"] = {{"tiny_floats", kTinyFloats}, {"batch", kBatch}, {"rounds", rounds},
                      {"cores", std::thread::hardware_concurrency()}};
  std::unique_ptr<DaemonProcess> open, shared;
  auto finish = [&](int rc) {
    if (shared) result["shared_exit"] = shared->Stop();
    if (open) result["open_exit"] = open->Stop();
    result["total_s"] = UsSince(started) * 1e-6;
    std::ofstream(out_path) << result.dump(1) << "\n";
    std::error_code ec;
    fs::remove_all(dir, ec);
    return rc;
  };

  const std::string sha = TokenSha256(dir);
  if (!MakeCertificates(dir) || sha.size() != 64) {
    result["error"] = "openssl or sha256sum failed: cannot make the test CA";
    fprintf(stderr, "auth_bench: %s\n", result["error"].get<std::string>().c_str());
    return finish(1);
  }
  fs::create_directories(dir + "/open");
  fs::create_directories(dir + "/shared");
  std::ofstream(dir + "/open/c.toml") << "[fast]\nenabled = false\n";
  std::ofstream(dir + "/shared/c.toml")
      << "[fast]\nenabled = false\n"
      << "[tls]\ncert = \"" << dir << "/server.pem\"\nkey = \"" << dir << "/server.key\"\n"
      << "[[principal]]\nname = \"bench\"\nrole = \"user\"\nnamespaces = [\"" << kNamespace
      << "\"]\ntoken_sha256 = [\"" << sha << "\"]\n";
  open = std::make_unique<DaemonProcess>(opjitd, dir + "/open");
  shared = std::make_unique<DaemonProcess>(opjitd, dir + "/shared");
  for (auto* d : {open.get(), shared.get()}) {
    if (auto err = d->Start(/*with_config=*/true)) {
      result["error"] = "opjitd did not start: " + *err;
      fprintf(stderr, "auth_bench: %s\n", result["error"].get<std::string>().c_str());
      return finish(1);
    }
  }

  // Register the op on both daemons as their admin (the unix socket's owner).
  for (auto* d : {open.get(), shared.get()}) {
    auto admin = Client::Connect({.address = d->unix_address(), .fast = "off"});
    absl::Status s = admin.ok() ? (*admin)->Register(TwiceOp()).status() : admin.status();
    if (!s.ok()) {
      result["error"] = "register: " + s.ToString();
      return finish(1);
    }
  }

  std::vector<Side> sides(5);
  sides[0] = {"open unix", "no principals, unix socket", {.address = open->unix_address(), .fast = "off"}};
  sides[1] = {"open tcp", "no principals, TCP plaintext", {.address = open->tcp_address(), .fast = "off"}};
  sides[2] = {"shared unix", "principals, unix socket, SO_PEERCRED",
              {.address = shared->unix_address(), .fast = "off"}};
  sides[3] = {"shared token", "principals, unix socket, bearer token",
              {.address = shared->unix_address(), .token = kToken, .fast = "off"}};
  sides[4] = {"shared tls", "principals, TCP + TLS, bearer token",
              {.address = shared->tcp_address(), .token = kToken, .tls_ca_file = dir + "/ca.pem",
               .fast = "off"}};
  const v1::ForwardRequest req = TinyCall();

  // A fresh channel's connect + first call, TLS handshake included (median of 10).
  json connect;
  for (int s : {1, 4}) {
    std::vector<double> us;
    for (int i = 0; i < 10; ++i) {
      const auto t0 = Clock::now();
      auto c = Client::Connect(sides[s].options);
      if (!c.ok() || !CallOnce(**c, req).ok()) break;
      us.push_back(UsSince(t0));
    }
    connect[sides[s].name] = us.size() == 10 ? json(Median(us)) : json({{"error", "a connect failed"}});
  }
  result["connect_first_call_us"] = connect;

  for (auto& side : sides) {
    auto c = Client::Connect(side.options);
    absl::Status s = c.ok() ? CallOnce(**c, req) : c.status();
    for (int i = 0; s.ok() && i < 200; ++i) s = CallOnce(**c, req);  // warm up
    if (!s.ok()) {
      side.error = s.ToString();
      continue;
    }
    side.client = *std::move(c);
  }
  for (int r = 0; r < rounds; ++r) {
    for (size_t k = 0; k < sides.size(); ++k) {
      Side& side = sides[(k + r) % sides.size()];
      if (!side.client) continue;
      for (int i = 0; i < kBatch; ++i) {
        const auto t0 = Clock::now();
        absl::Status s = CallOnce(*side.client, req);
        if (!s.ok()) {
          side.error = s.ToString();
          side.client.reset();
          break;
        }
        side.us.push_back(UsSince(t0));
      }
    }
  }

  const double base = sides[0].us.empty() ? NAN : Median(sides[0].us);
  json rows = json::array();
  printf("| side | what | calls | median µs | p90 µs | vs open unix |\n|---|---|---|---|---|---|\n");
  for (auto& side : sides) {
    if (!side.error.empty()) {
      rows.push_back({{"side", side.name}, {"what", side.what}, {"error", side.error}});
      printf("| %s | %s | failed: %s | | | |\n", side.name.c_str(), side.what.c_str(), side.error.c_str());
      continue;
    }
    const double med = Median(side.us);
    const double p90 = Percentile(side.us, 0.9);
    rows.push_back({{"side", side.name}, {"what", side.what}, {"calls", side.us.size()},
                    {"median_us", med}, {"p90_us", p90}, {"ratio", med / base}});
    printf("| %s | %s | %zu | %.1f | %.1f | %.2fx |\n", side.name.c_str(), side.what.c_str(),
           side.us.size(), med, p90, med / base);
  }
  result["sides"] = rows;
  printf("\nconnect + first call (fresh channel): open tcp %s µs, shared tls %s µs\n",
         connect["open tcp"].dump().c_str(), connect["shared tls"].dump().c_str());
  bool failed = false;
  for (auto& side : sides) failed |= !side.error.empty();
  return finish(failed ? 1 : 0);
}

}  // namespace

int main(int argc, char** argv) { return Main(argc, argv); }
