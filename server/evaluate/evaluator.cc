#include "server/evaluate/evaluator.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <cmath>
#include <cstring>
#include <future>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/shell_word.h"
#include "server/common/random.h"
#include "server/common/status_macros.h"
#include "server/common/mutex.h"
#include "server/compiler/compile_options.h"
#include "server/tensor/elements.h"
#include "server/registry/attr_value.h"
#include "server/registry/registry.h"
#include "server/tensor/region_manager.h"

namespace opjit::evaluate {
namespace {

using Clock = std::chrono::steady_clock;
using runner::TensorDesc;
using tensor::DefaultTolerance;
using tensor::Dtype;
using tensor::DtypeOf;
using tensor::ReadElement;
using tensor::RoundTo;
using tensor::SpecialValues;
using tensor::ToleranceValues;
using tensor::UlpDistance;
using tensor::WriteElement;

constexpr uint8_t kPoisonA = 0xFF;  // NaN in every float width, -1 in integers
constexpr uint8_t kPoisonB = 0xA5;
constexpr uint64_t kAlign = 64;

uint64_t AlignUp(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// splitmix64: the case generator (seeded, reproducible; not for secrets).
uint64_t Mix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
double Uniform(uint64_t& s) { return static_cast<double>(Mix(s) >> 11) * 0x1.0p-53; }

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint64_t Bytes(const TensorDesc& d) {
  return static_cast<uint64_t>(Elements(d.shape)) * DtypeOf(d.dtype).size;
}

std::string Describe(const std::vector<TensorDesc>& descs) {
  std::vector<std::string> parts;
  for (const TensorDesc& d : descs) parts.push_back(runner::DescString(d));
  return absl::StrJoin(parts, ", ");
}

// A shape as the CLI's --shape reads it: "4,5", "[]" for a scalar.
std::string ShapeText(const std::vector<int64_t>& shape) {
  return shape.empty() ? "[]" : absl::StrJoin(shape, ",");
}

// " --attr k=v" for each attr, as the caller gave it.
std::string AttrFlags(const std::map<std::string, exec::AttrArg>& attrs) {
  std::string out;
  for (const auto& [name, a] : attrs) {
    const std::string value = a.is_text ? a.text : registry::FormatAttrValue(a.value);
    absl::StrAppend(&out, " --attr ", ShellWord(name + "=" + value));
  }
  return out;
}

bool PastDeadline(Clock::time_point deadline) { return Clock::now() >= deadline; }

absl::Status DeadlineError(const char* what, size_t done, size_t total) {
  return absl::DeadlineExceededError(
      absl::StrCat(what, " ran past its deadline after ", done, " of ", total,
                   " case(s): give it a longer deadline, or fewer shapes, dtypes or seeds"));
}

// One region of the caller's namespace for one side (candidate or
// reference) of a verify, removed with the object; cases reuse it with new
// values, and a bigger case replaces it. Its bytes count against the
// namespace's quota.
class CaseRegion {
 public:
  static absl::StatusOr<std::unique_ptr<CaseRegion>> Create(tensor::RegionManager* regions,
                                                            const std::string& ns,
                                                            const std::string& principal,
                                                            uint64_t bytes, int64_t lease_ms) {
    OPJIT_ASSIGN_OR_RETURN(std::string id, RandomHex128());
    auto r = std::unique_ptr<CaseRegion>(new CaseRegion(regions, ns));
    r->name_ = "opjit-evaluate-" + id.substr(0, 16);
    const std::string owner = principal.empty() ? "opjit-evaluate" : principal + "/opjit-evaluate";
    OPJIT_RETURN_IF_ERROR(
        regions->CreateRegion(ns, owner, r->name_, std::max<uint64_t>(bytes, kAlign), lease_ms)
            .status());
    r->created_ = true;
    r->bytes_ = bytes;
    OPJIT_ASSIGN_OR_RETURN(r->region_, regions->Acquire(ns, r->name_));
    return r;
  }
  uint64_t bytes() const { return bytes_; }
  ~CaseRegion() {
    if (created_) regions_->Unregister(ns_, name_).IgnoreError();
  }
  const std::string& name() const { return name_; }
  uint8_t* at(uint64_t offset) const { return region_->data() + offset; }

 private:
  CaseRegion(tensor::RegionManager* regions, std::string ns)
      : regions_(regions), ns_(std::move(ns)) {}
  tensor::RegionManager* const regions_;
  const std::string ns_;
  std::string name_;
  bool created_ = false;
  uint64_t bytes_ = 0;
  std::shared_ptr<const tensor::Region> region_;
};

// Where a side's tensors sit in its region: inputs, then `runs` output sets.
struct Layout {
  std::vector<uint64_t> inputs;
  std::vector<std::vector<uint64_t>> outputs;  // per run, per output
  uint64_t total = 0;
};

Layout LayOut(const std::vector<TensorDesc>& in, const std::vector<TensorDesc>& out, int runs) {
  Layout l;
  uint64_t at = 0;
  for (const TensorDesc& d : in) {
    l.inputs.push_back(at);
    at = AlignUp(at + Bytes(d));
  }
  for (int r = 0; r < runs; ++r) {
    l.outputs.emplace_back();
    for (const TensorDesc& d : out) {
      l.outputs.back().push_back(at);
      at = AlignUp(at + Bytes(d));
    }
  }
  l.total = at;
  return l;
}

// What an op is called with in one case.
struct Side {
  std::shared_ptr<const registry::OpRecord> record;
  registry::Target target = registry::Target::kCpu;
};

registry::Target TargetOf(const registry::OpDef& def) {
  for (const auto& impl : def.implementations) {
    if (impl.target == registry::Target::kCpu) return registry::Target::kCpu;
  }
  return def.implementations.empty() ? registry::Target::kCpu : def.implementations[0].target;
}

exec::ForwardCall BaseCall(const std::string& ns, const std::string& principal,
                           const runner::Caller& quarantine_caller, const Side& side,
                           const std::map<std::string, exec::AttrArg>& attrs,
                           Clock::time_point deadline) {
  exec::ForwardCall c;
  c.ns = ns;
  c.principal = principal;
  c.quarantine_caller = quarantine_caller;
  c.op = side.record->def.name;
  c.version = side.record->version;
  c.target = side.target;
  c.attrs = attrs;
  c.deadline = deadline;
  return c;
}

// The call of `side` on the tensors of `region`, outputs in run `run`.
exec::ForwardCall PlacedCall(exec::ForwardCall c, const std::vector<TensorDesc>& in,
                             const Layout& l, const CaseRegion& region, int run) {
  c.inputs.clear();
  for (size_t i = 0; i < in.size(); ++i) {
    c.inputs.push_back({exec::TensorArg::Shm(in[i], region.name(), l.inputs[i])});
  }
  c.outputs.clear();
  for (uint64_t off : l.outputs[run]) {
    c.outputs.push_back({exec::OutputPlacement::Kind::kShm, region.name(), off});
  }
  c.keep_output_bytes = true;  // the poison stays where nothing is written
  return c;
}

// Prepare's tensors have no data; the executor checks dtypes and shapes
// only. A null tensor would read as "absent", so give them inline views of
// nothing instead.
absl::StatusOr<exec::PreparedCall> Prepare(exec::Executor* executor, exec::ForwardCall c,
                                           const std::vector<TensorDesc>& in) {
  c.inputs.clear();
  for (const TensorDesc& d : in) c.inputs.push_back({exec::TensorArg::Inline(d, {})});
  std::promise<absl::StatusOr<exec::PreparedCall>> p;
  auto f = p.get_future();
  executor->PrepareAsync(std::move(c), [&p](absl::StatusOr<exec::PreparedCall> r) {
    p.set_value(std::move(r));
  });
  return f.get();
}

// The errors that are the request's, not a case's: stop the whole run.
bool IsRequestError(const absl::Status& s) {
  return s.code() == absl::StatusCode::kNotFound || s.code() == absl::StatusCode::kDeadlineExceeded ||
         s.code() == absl::StatusCode::kPermissionDenied ||
         s.code() == absl::StatusCode::kUnauthenticated;
}

// Input values of one case, per input, in `descs`' dtypes.
std::vector<std::string> Generate(const std::vector<TensorDesc>& descs, uint64_t seed, double low,
                                  double high, bool specials) {
  std::vector<std::string> out;
  for (const TensorDesc& d : descs) {
    const Dtype dt = DtypeOf(d.dtype);
    const int64_t n = Elements(d.shape);
    std::string bytes(static_cast<size_t>(n) * dt.size, '\0');
    double lo = low, hi = high;
    if (lo == 0 && hi == 0) {
      lo = dt.is_float() ? -2 : dt.kind == Dtype::Kind::kUnsigned ? 0 : -100;
      hi = dt.is_float() ? 2 : 100;
    }
    for (int64_t i = 0; i < n; ++i) {
      const double u = Uniform(seed);
      double v = dt.kind == Dtype::Kind::kBool ? (u < 0.5 ? 0 : 1)
                 : dt.is_float()               ? lo + (hi - lo) * u
                                               : std::floor(lo + (hi - lo + 1) * u);
      WriteElement(dt, bytes.data(), static_cast<size_t>(i), v);
    }
    if (specials && n > 0) {
      const std::vector<double> sv = SpecialValues(dt);
      // Spread over the tensor, at positions a kernel cannot guess.
      const uint64_t start = Mix(seed) % static_cast<uint64_t>(n);
      for (size_t j = 0; j < sv.size() && j < static_cast<size_t>(n); ++j) {
        const uint64_t at = (start + j * (static_cast<uint64_t>(n) / sv.size() + 1)) % n;
        WriteElement(dt, bytes.data(), at, sv[j]);
      }
    }
    out.push_back(std::move(bytes));
  }
  return out;
}

// `bytes` (in `from`) as `to`: the widening for a float64 reference.
std::string Convert(const std::string& bytes, const std::string& from, const std::string& to) {
  if (from == to) return bytes;
  const Dtype f = DtypeOf(from), t = DtypeOf(to);
  const size_t n = bytes.size() / f.size;
  std::string out(n * t.size, '\0');
  for (size_t i = 0; i < n; ++i) WriteElement(t, out.data(), i, ReadElement(f, bytes.data(), i));
  return out;
}

bool SameElement(const Dtype& d, const uint8_t* a, const uint8_t* b, size_t i) {
  if (std::memcmp(a + i * d.size, b + i * d.size, d.size) == 0) return true;
  return d.is_float() && std::isnan(ReadElement(d, a, i)) && std::isnan(ReadElement(d, b, i));
}

struct OutputBytes {
  TensorDesc desc;
  std::string bytes;
};

// How one output compares with the reference's; the worst element wins.
struct Comparison {
  bool passed = true;
  double max_abs = 0, max_rel = 0, max_ulp = 0;
  int64_t worst = -1;
  double worst_score = -1;
  double cand = 0, ref = 0;
};

Comparison Compare(const OutputBytes& cand, const OutputBytes& ref, const ToleranceValues& tol) {
  Comparison c;
  const Dtype cd = DtypeOf(cand.desc.dtype), rd = DtypeOf(ref.desc.dtype);
  const int64_t n = Elements(cand.desc.shape);
  const bool exact = !cd.is_float() && tol.atol == 0 && tol.rtol == 0 && tol.ulps == 0;
  for (int64_t i = 0; i < n; ++i) {
    const size_t k = static_cast<size_t>(i);
    const double a = ReadElement(cd, cand.bytes.data(), k);
    const double b = ReadElement(rd, ref.bytes.data(), k);
    bool ok;
    double abs_err = 0, rel_err = 0, ulp = 0;
    if (exact) {
      // Integers: the bits (64-bit values do not fit a double).
      ok = cd.size == rd.size && cd.kind == rd.kind
               ? std::memcmp(cand.bytes.data() + k * cd.size, ref.bytes.data() + k * rd.size,
                             cd.size) == 0
               : a == b;
      abs_err = std::fabs(a - b);
      rel_err = b != 0 ? abs_err / std::fabs(b) : abs_err;
      ulp = abs_err;
    } else if (std::isnan(b) || std::isnan(a)) {
      ok = std::isnan(a) && std::isnan(b);
      abs_err = rel_err = ulp = ok ? 0 : INFINITY;
    } else if (std::isinf(b) || std::isinf(a)) {
      // A wider reference's finite value may overflow the candidate's dtype:
      // compare what the candidate's dtype holds.
      ok = a == RoundTo(cd, b);
      abs_err = rel_err = ulp = ok ? 0 : INFINITY;
    } else {
      abs_err = std::fabs(a - b);
      rel_err = b != 0 ? abs_err / std::fabs(b) : (abs_err == 0 ? 0 : INFINITY);
      ulp = UlpDistance(cd, a, RoundTo(cd, b));
      ok = abs_err <= tol.atol + tol.rtol * std::fabs(b) || ulp <= static_cast<double>(tol.ulps);
    }
    c.max_abs = std::max(c.max_abs, abs_err);
    c.max_rel = std::max(c.max_rel, rel_err);
    c.max_ulp = std::max(c.max_ulp, ulp);
    // A failing element outranks every passing one; among equals, the larger
    // error.
    const double score = (ok ? 0 : 1e300) + (std::isfinite(abs_err) ? abs_err : 1e299);
    if (!ok) c.passed = false;
    if (score > c.worst_score) {
      c.worst_score = score;
      c.worst = i;
      c.cand = a;
      c.ref = b;
    }
  }
  return c;
}

// The caller's tolerance for `dtype`, defaults where it gave none.
ToleranceValues ToleranceFor(const VerifyCall& c, const std::string& dtype) {
  ToleranceValues tol = DefaultTolerance(dtype);
  if (c.tolerance.atol) tol.atol = *c.tolerance.atol;
  if (c.tolerance.rtol) tol.rtol = *c.tolerance.rtol;
  if (c.tolerance.ulps) tol.ulps = *c.tolerance.ulps;
  return tol;
}

// Enough digits to tell neighbouring values of the dtype apart.
std::string FormatValue(const Dtype& d, double v) {
  return d.size == 8 ? absl::StrFormat("%.17g", v) : absl::StrFormat("%.9g", v);
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

// The inputs of one case of a verify (and, for a given case, its outputs).
// Planned up front; the bytes are filled just before the case runs
// (FillCase) and freed after (ClearCase), so one case's tensors are in the
// heap at a time.
struct CaseInput {
  std::string kind;
  uint64_t seed = 0;
  bool specials = false;
  const GivenCase* given = nullptr;  // kind "given"
  std::vector<TensorDesc> cand_in, ref_in;
  std::vector<std::string> cand_bytes, ref_bytes;
  std::vector<OutputBytes> given_outputs;  // kind "given"
};

uint64_t InputBytes(const CaseInput& ci) {
  uint64_t n = 0;
  for (const TensorDesc& d : ci.cand_in) n += Bytes(d);
  if (ci.given == nullptr) {
    for (const TensorDesc& d : ci.ref_in) n += Bytes(d);
  }
  return n;
}

void FillCase(const VerifyCall& c, CaseInput* ci) {
  if (ci->given != nullptr) {
    for (const exec::TensorArg& t : ci->given->inputs) {
      ci->cand_bytes.emplace_back(t.inline_bytes()->bytes);
    }
    for (const exec::TensorArg& t : ci->given->outputs) {
      ci->given_outputs.push_back({t.desc, std::string(t.inline_bytes()->bytes)});
    }
    return;
  }
  ci->cand_bytes = Generate(ci->cand_in, ci->seed, c.low, c.high, ci->specials);
  // The reference's inputs: the same bytes (no copy) unless it runs widened.
  bool same = true;
  for (size_t i = 0; i < ci->cand_in.size(); ++i) {
    same &= ci->cand_in[i].dtype == ci->ref_in[i].dtype;
  }
  if (same) return;
  for (size_t i = 0; i < ci->cand_bytes.size(); ++i) {
    ci->ref_bytes.push_back(
        Convert(ci->cand_bytes[i], ci->cand_in[i].dtype, ci->ref_in[i].dtype));
  }
}

void ClearCase(CaseInput* ci) {
  std::vector<std::string>().swap(ci->cand_bytes);
  std::vector<std::string>().swap(ci->ref_bytes);
  std::vector<OutputBytes>().swap(ci->given_outputs);
}

// A queued evaluation: `run` does it and answers, `refuse` answers without.
struct Job {
  std::string ns;
  std::function<bool()> cancelled;
  std::function<void()> run;
  std::function<void(absl::Status)> refuse;
};

}  // namespace

struct Evaluator::Impl {
  EvaluatorOptions options;
  registry::Registry* registry;
  exec::Executor* executor;
  tensor::RegionManager* regions;

  // The fair queue: one per namespace, served round-robin (`turn`: the
  // namespaces with work waiting, in serving order).
  Mutex mu;
  CondVar cv;
  std::map<std::string, std::deque<Job>> queues ABSL_GUARDED_BY(mu);
  std::deque<std::string> turn ABSL_GUARDED_BY(mu);
  size_t queued ABSL_GUARDED_BY(mu) = 0;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  std::atomic<bool> stop{false};  // running evaluations: stop at the next run
  std::vector<std::thread> workers;

  Impl(const EvaluatorOptions& o, registry::Registry* r, exec::Executor* e,
       tensor::RegionManager* m)
      : options(o), registry(r), executor(e), regions(m) {
    for (int i = 0; i < std::max(1, o.threads); ++i) {
      workers.emplace_back([this] { Loop(); });
      pthread_setname_np(workers.back().native_handle(), "evaluate");
    }
  }
  ~Impl() {
    Stop();
    for (std::thread& t : workers) t.join();
  }
  void Submit(Job job);
  void Loop();
  void Stop();
  // Between runs: UNAVAILABLE after Stop, CANCELLED when the caller is gone,
  // DEADLINE_EXCEEDED past `deadline`.
  absl::Status Interrupted(const std::function<bool()>& cancelled, Clock::time_point deadline,
                           const char* what) const;
  Clock::time_point Capped(Clock::time_point deadline) const {
    return std::min(deadline, Clock::now() + std::chrono::milliseconds(options.max_evaluation_ms));
  }

  absl::StatusOr<VerifyResult> Verify(const VerifyCall& c);
  // The generated cases of a verify against `ref` (dtype rows the reference
  // accepts x shapes x seeds and a special case); notes on rows in `notes`.
  absl::StatusOr<std::vector<CaseInput>> GeneratedCases(const VerifyCall& c,
                                                        const registry::OpDef& cdef,
                                                        const Side& ref, uint64_t seed,
                                                        std::vector<std::string>* notes);
  absl::StatusOr<BenchmarkResult> Benchmark(const BenchmarkCall& c);

  // One case of a verify; an error only for what stops the whole run.
  // The two sides' regions of one verify (never shared between them).
  struct Regions {
    std::unique_ptr<CaseRegion> candidate, reference;
  };
  absl::Status RunCase(const VerifyCall& c, const Side& cand, const Side* ref,
                       const CaseInput& in, Regions* regions, CaseReport* report);
  // Runs `side` once per entry of `poisons` (outputs placed apart per run),
  // writing what each run returned into `runs`; checks the inputs after each
  // and the outputs again after `settle`. A non-empty *failure is the case's.
  absl::Status RunSide(const VerifyCall& c, const Side& side, std::unique_ptr<CaseRegion>* slot,
                       bool settle, const std::vector<TensorDesc>& in,
                       const std::vector<std::string>& in_bytes,
                       const std::vector<TensorDesc>& out, const std::vector<uint8_t>& poisons,
                       std::vector<std::vector<OutputBytes>>* runs, std::string* failure,
                       double* kernel_ms, std::pair<int, int64_t>* worst = nullptr);
};

absl::Status Evaluator::Impl::RunSide(const VerifyCall& c, const Side& side,
                                      std::unique_ptr<CaseRegion>* slot, bool settle,
                                      const std::vector<TensorDesc>& in,
                                      const std::vector<std::string>& in_bytes,
                                      const std::vector<TensorDesc>& out,
                                      const std::vector<uint8_t>& poisons,
                                      std::vector<std::vector<OutputBytes>>* runs,
                                      std::string* failure, double* kernel_ms,
                                      std::pair<int, int64_t>* worst) {
  const int n_runs = static_cast<int>(poisons.size());
  const Layout l = LayOut(in, out, n_runs);
  if (*slot == nullptr || (*slot)->bytes() < l.total) {
    slot->reset();  // the old one leaves the quota first
    OPJIT_ASSIGN_OR_RETURN(*slot, CaseRegion::Create(regions, c.ns, c.principal, l.total,
                                                     options.region_lease_ms));
  }
  const CaseRegion* region = slot->get();
  for (size_t i = 0; i < in.size(); ++i) {
    std::memcpy(region->at(l.inputs[i]), in_bytes[i].data(), in_bytes[i].size());
  }
  for (int r = 0; r < n_runs; ++r) {
    for (size_t k = 0; k < out.size(); ++k) {
      std::memset(region->at(l.outputs[r][k]), poisons[r], Bytes(out[k]));
    }
  }
  const exec::ForwardCall base = BaseCall(c.ns, c.principal, c.quarantine_caller, side, c.attrs, c.deadline);
  for (int r = 0; r < n_runs; ++r) {
    OPJIT_RETURN_IF_ERROR(Interrupted(c.cancelled, c.deadline, "verify"));
    absl::StatusOr<exec::ForwardResult> res =
        executor->Forward(PlacedCall(base, in, l, *region, r));
    if (!res.ok()) {
      if (IsRequestError(res.status())) return res.status();
      *failure = absl::StrCat("the call failed: ", res.status().message());
      return absl::OkStatus();
    }
    if (kernel_ms != nullptr && r == 0) *kernel_ms = res->kernel_ms;
    runs->emplace_back();
    for (size_t k = 0; k < out.size(); ++k) {
      runs->back().push_back(
          {out[k], std::string(reinterpret_cast<const char*>(region->at(l.outputs[r][k])),
                               Bytes(out[k]))});
    }
    for (size_t i = 0; i < in.size(); ++i) {
      const uint8_t* now = region->at(l.inputs[i]);
      if (std::memcmp(now, in_bytes[i].data(), in_bytes[i].size()) == 0) continue;
      const std::string& name = side.record->def.inputs[std::min(i, side.record->def.inputs.size() - 1)].name;
      if (std::find(c.inplace_inputs.begin(), c.inplace_inputs.end(), name) !=
          c.inplace_inputs.end()) {
        std::memcpy(region->at(l.inputs[i]), in_bytes[i].data(), in_bytes[i].size());
        continue;
      }
      const Dtype d = DtypeOf(in[i].dtype);
      size_t at = 0;
      while (at + 1 < in_bytes[i].size() / d.size &&
             SameElement(d, now, reinterpret_cast<const uint8_t*>(in_bytes[i].data()), at)) {
        ++at;
      }
      *failure = absl::StrCat("the kernel changed input '", name, "' (element ", at, ": ",
                              FormatValue(d, ReadElement(d, in_bytes[i].data(), at)), " became ",
                              FormatValue(d, ReadElement(d, now, at)),
                              "); declare it in inplace_inputs if the op works in place");
      return absl::OkStatus();
    }
  }
  if (!settle) return absl::OkStatus();
  if (c.settle_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(c.settle_ms));
  for (int r = 0; r < n_runs; ++r) {
    for (size_t k = 0; k < out.size(); ++k) {
      const std::string& seen = (*runs)[r][k].bytes;
      const uint8_t* now = region->at(l.outputs[r][k]);
      if (std::memcmp(now, seen.data(), seen.size()) == 0) continue;
      const Dtype d = DtypeOf(out[k].dtype);
      size_t at = 0;
      while (at < seen.size() / d.size && std::memcmp(now + at * d.size, seen.data() + at * d.size, d.size) == 0) ++at;
      // The element is the case's worst: say where.
      if (worst != nullptr) *worst = {static_cast<int>(k), static_cast<int64_t>(at)};
      *failure = absl::StrCat("output ", k, " changed after the kernel returned (element ", at,
                              ", within ", c.settle_ms,
                              " ms): work after return is not a result");
      return absl::OkStatus();
    }
  }
  return absl::OkStatus();
}

namespace {

// "" when the candidate wrote every element of its outputs in both runs;
// else what it left unwritten, in words, and where (`*output`, `*first`).
std::string Unwritten(const registry::OpDef& def, const std::vector<TensorDesc>& cand_out,
                      const std::vector<std::vector<OutputBytes>>& runs, int* output,
                      int64_t* first_index) {
  for (size_t k = 0; k < cand_out.size(); ++k) {
    const Dtype d = DtypeOf(cand_out[k].dtype);
    const std::string a(d.size, static_cast<char>(kPoisonA)), b(d.size, static_cast<char>(kPoisonB));
    const size_t n = runs[0][k].bytes.size() / std::max<size_t>(d.size, 1);
    size_t unwritten = 0, first = 0;
    for (size_t i = 0; i < n; ++i) {
      if (runs[0][k].bytes.compare(i * d.size, d.size, a) == 0 &&
          runs[1][k].bytes.compare(i * d.size, d.size, b) == 0) {
        if (unwritten++ == 0) first = i;
      }
    }
    if (unwritten == 0) continue;
    *output = static_cast<int>(k);
    *first_index = static_cast<int64_t>(first);
    const std::string name = def.outputs.size() == cand_out.size() && !def.outputs[k].name.empty()
                                 ? def.outputs[k].name
                                 : absl::StrCat(k);
    if (unwritten == n) {
      return absl::StrCat("output ", name, " was never written: it still holds the poison "
                          "pattern it starts with");
    }
    return absl::StrCat("output ", name, ": ", unwritten, " of ", n,
                        " element(s) were never written (first: element ", first,
                        "): they still hold the poison pattern outputs start with");
  }
  return "";
}

}  // namespace

absl::Status Evaluator::Impl::RunCase(const VerifyCall& c, const Side& cand, const Side* ref,
                                      const CaseInput& in, Regions* regions,
                                      CaseReport* report) {
  report->kind = in.kind;
  report->seed = in.seed;
  report->dtype = in.cand_in.empty() ? "" : in.cand_in[0].dtype;
  report->shapes = Describe(in.cand_in);
  const exec::ForwardCall cand_base = BaseCall(c.ns, c.principal, c.quarantine_caller, cand, c.attrs, c.deadline);

  // The reference first: a refusal there skips the case.
  std::vector<OutputBytes> expected = in.given_outputs;
  std::vector<TensorDesc> ref_out;
  if (ref != nullptr) {
    auto prepared = Prepare(executor, BaseCall(c.ns, c.principal, c.quarantine_caller, *ref, c.attrs, c.deadline),
                            in.ref_in);
    if (!prepared.ok()) {
      if (IsRequestError(prepared.status())) return prepared.status();
      report->skipped = true;
      report->message = absl::StrCat("the reference refused these inputs: ",
                                     prepared.status().message());
      return absl::OkStatus();
    }
    ref_out = prepared->outputs;
    std::vector<std::vector<OutputBytes>> runs;
    std::string failure;
    OPJIT_RETURN_IF_ERROR(RunSide(c, *ref, &regions->reference, /*settle=*/false, in.ref_in,
                                  in.ref_bytes.empty() ? in.cand_bytes : in.ref_bytes, ref_out,
                                  {kPoisonA}, &runs, &failure, nullptr));
    if (!failure.empty()) {
      report->skipped = true;
      report->message = absl::StrCat("the reference: ", failure);
      return absl::OkStatus();
    }
    expected = std::move(runs[0]);
  }

  auto prepared = Prepare(executor, cand_base, in.cand_in);
  if (!prepared.ok()) {
    if (IsRequestError(prepared.status())) return prepared.status();
    report->message = absl::StrCat("the candidate refused inputs the reference accepts: ",
                                   prepared.status().message());
    return absl::OkStatus();
  }
  const std::vector<TensorDesc>& cand_out = prepared->outputs;
  uint64_t case_bytes = InputBytes(in);
  for (const TensorDesc& d : cand_out) case_bytes += 3 * Bytes(d);  // two runs and the reference's
  if (case_bytes > kMaxCaseBytes) {
    return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                          "case ", report->index, " (", report->shapes, ") needs ", case_bytes,
                          " bytes of inputs and outputs; at most ", kMaxCaseBytes,
                          " per verify case: give smaller shapes")),
                      reason::kQuotaExceeded, {{"limit", "verify case bytes"}});
  }
  if (cand_out.size() != expected.size()) {
    report->message = absl::StrCat("the candidate gives ", cand_out.size(),
                                   " output(s); the reference ", expected.size());
    return absl::OkStatus();
  }
  for (size_t k = 0; k < cand_out.size(); ++k) {
    if (cand_out[k].shape != expected[k].desc.shape) {
      report->message = absl::StrCat("output ", k, " is ", runner::DescString(cand_out[k]),
                                     "; the reference's is ",
                                     runner::DescString(expected[k].desc));
      return absl::OkStatus();
    }
  }

  std::vector<std::vector<OutputBytes>> runs;
  std::string failure;
  std::pair<int, int64_t> where{-1, -1};
  OPJIT_RETURN_IF_ERROR(RunSide(c, cand, &regions->candidate, /*settle=*/true, in.cand_in,
                                in.cand_bytes, cand_out,
                                {kPoisonA, kPoisonB}, &runs, &failure,
                                &report->candidate_kernel_ms, &where));
  if (!failure.empty()) {
    report->worst_output = where.first;
    report->worst_index = where.second;
    report->message = absl::StrCat("the candidate: ", failure);
    return absl::OkStatus();
  }

  // Written? An element that holds poison A after run 1 and poison B after
  // run 2 was not. Said in words: no value was compared (they stay 0).
  report->message = Unwritten(cand.record->def, cand_out, runs, &report->worst_output,
                              &report->worst_index);
  if (!report->message.empty()) return absl::OkStatus();

  // The same bits twice?
  for (size_t k = 0; k < cand_out.size(); ++k) {
    const Dtype d = DtypeOf(cand_out[k].dtype);
    const auto* x = reinterpret_cast<const uint8_t*>(runs[0][k].bytes.data());
    const auto* y = reinterpret_cast<const uint8_t*>(runs[1][k].bytes.data());
    for (size_t i = 0; i < runs[0][k].bytes.size() / d.size; ++i) {
      if (!SameElement(d, x, y, i)) {
        report->deterministic = false;
        break;
      }
    }
  }

  // Within tolerance, in both runs; the worst element of all.
  report->passed = true;
  double worst_score = -1;
  for (const auto& run : runs) {
    for (size_t k = 0; k < run.size(); ++k) {
      const Comparison cmp = Compare(run[k], expected[k], ToleranceFor(c, run[k].desc.dtype));
      report->max_abs_error = std::max(report->max_abs_error, cmp.max_abs);
      report->max_rel_error = std::max(report->max_rel_error, cmp.max_rel);
      report->max_ulp_error = std::max(report->max_ulp_error, cmp.max_ulp);
      if (!cmp.passed) report->passed = false;
      if (cmp.worst >= 0 && cmp.worst_score > worst_score) {
        worst_score = cmp.worst_score;
        report->worst_output = static_cast<int>(k);
        report->worst_index = cmp.worst;
        report->candidate_value = cmp.cand;
        report->reference_value = cmp.ref;
      }
    }
  }
  if (!report->passed) {
    const Dtype d = DtypeOf(cand_out[report->worst_output].dtype);
    report->message = absl::StrCat("output ", report->worst_output, " element ",
                                   report->worst_index, ": candidate ",
                                   FormatValue(d, report->candidate_value), ", reference ",
                                   FormatValue(d, report->reference_value),
                                   " (outside the tolerance)");
  }
  return absl::OkStatus();
}

namespace {

// The dtype rows to verify: the candidate's, by input dtypes, once each.
std::vector<std::vector<std::string>> InputRows(const registry::OpDef& def) {
  std::vector<std::vector<std::string>> rows;
  for (const registry::DtypeFormat& f : def.dtype_formats) {
    std::vector<std::string> row;
    for (size_t i = 0; i < def.inputs.size() && i < f.io.size(); ++i) {
      row.push_back(DtypeOf(f.io[i].first).kind == Dtype::Kind::kUnknown ? "float32"
                                                                        : f.io[i].first);
    }
    if (std::find(rows.begin(), rows.end(), row) == rows.end()) rows.push_back(row);
  }
  if (rows.empty()) rows.push_back(std::vector<std::string>(def.inputs.size(), "float32"));
  return rows;
}

std::vector<TensorDesc> Descs(const std::vector<std::string>& dtypes, const ShapeSet& shapes) {
  std::vector<TensorDesc> out;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    out.push_back({dtypes[i], shapes.size() == 1 ? shapes[0] : shapes[i]});
  }
  return out;
}

std::vector<std::string> Widened(const std::vector<std::string>& row) {
  std::vector<std::string> out = row;
  for (std::string& d : out) {
    if (DtypeOf(d).is_float()) d = "float64";
  }
  return out;
}

std::string OpName(const std::string& ns, const std::string& op, int64_t version) {
  return absl::StrCat(ns, "/", op, version > 0 ? absl::StrCat("@", version) : "");
}

std::string ToleranceText(const std::string& dtype, const ToleranceValues& t) {
  return absl::StrCat(dtype, ": atol=", t.atol, " rtol=", t.rtol, " ulps=", t.ulps);
}

// How `def`'s kernel for `target` was compiled for floating point, reported
// beside the tolerances (an exact comparison hangs on it): "candidate fma
// (cpu): -O3 -march=native, fp-contract=on, no fast-math".
std::string FpModeText(const char* who, const registry::OpDef& def, registry::Target target) {
  for (const registry::Implementation& impl : def.implementations) {
    if (impl.target != target) continue;
    if (target == registry::Target::kCpu) {
      return absl::StrCat(who, " ", def.name, " (cpu): -O3 -march=native, ",
                          compiler::CpuFpMode(impl.compile_options));
    }
    return absl::StrCat(who, " ", def.name, " (cuda): ",
                        compiler::CudaFpMode(impl.compile_options));
  }
  return "";
}

}  // namespace

namespace {

absl::Status TooMany(const std::string& what, const char* limit) {
  return WithReason(absl::ResourceExhaustedError(what), reason::kQuotaExceeded,
                    {{"limit", limit}});
}

// The request's own checks, before anything runs.
absl::Status CheckVerifyCall(const VerifyCall& c, const registry::OpDef& cdef) {
  if (c.reference.empty() == c.given.empty()) {
    return absl::InvalidArgumentError(
        c.given.empty()
            ? "nothing to compare with: give a reference op or given cases (inputs and outputs)"
            : "give a reference op or given cases, not both");
  }
  if (c.settle_ms > kMaxSettleMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("settle_ms is ", c.settle_ms, "; at most ", kMaxSettleMs));
  }
  if (c.low > c.high) {
    return absl::InvalidArgumentError(
        absl::StrCat("low (", c.low, ") is above high (", c.high, ")"));
  }
  for (const std::string& name : c.inplace_inputs) {
    if (std::none_of(cdef.inputs.begin(), cdef.inputs.end(),
                     [&](const registry::TensorParam& p) { return p.name == name; })) {
      return absl::InvalidArgumentError(absl::StrCat(
          "inplace_inputs names '", name, "', which is not an input of '", c.candidate, "'"));
    }
  }
  return absl::OkStatus();
}

// A given tensor's bytes, checked against its dtype and shape.
absl::StatusOr<std::string_view> GivenBytes(const exec::TensorArg& t, size_t g, const char* what) {
  const exec::InlineBytes* b = t.inline_bytes();
  if (b == nullptr || b->bytes.size() != Bytes(t.desc) ||
      DtypeOf(t.desc.dtype).kind == Dtype::Kind::kUnknown) {
    return absl::InvalidArgumentError(absl::StrCat(
        "given case ", g, ": every ", what, " needs a known dtype and inline bytes of its size"));
  }
  return b->bytes;
}

absl::StatusOr<std::vector<CaseInput>> GivenCases(const VerifyCall& c,
                                                  const registry::OpDef& cdef) {
  if (c.given.size() > kMaxCases) {
    return TooMany(absl::StrCat(c.given.size(), " given cases; at most ", kMaxCases,
                                " per verify"),
                   "verify cases");
  }
  std::vector<CaseInput> cases;
  for (size_t g = 0; g < c.given.size(); ++g) {
    const GivenCase& gc = c.given[g];
    if (gc.inputs.size() != cdef.inputs.size()) {
      return absl::InvalidArgumentError(absl::StrCat("given case ", g, " has ", gc.inputs.size(),
                                                     " input(s); '", c.candidate, "' takes ",
                                                     cdef.inputs.size()));
    }
    CaseInput ci;
    ci.kind = "given";
    ci.given = &gc;
    for (const exec::TensorArg& t : gc.inputs) {
      OPJIT_RETURN_IF_ERROR(GivenBytes(t, g, "input").status());
      ci.cand_in.push_back(t.desc);
    }
    for (const exec::TensorArg& t : gc.outputs) {
      OPJIT_RETURN_IF_ERROR(GivenBytes(t, g, "output").status());
    }
    cases.push_back(std::move(ci));
  }
  return cases;
}

// The request's input bytes, before any case is generated.
absl::Status CheckVerifyBytes(const std::vector<CaseInput>& cases) {
  uint64_t total = 0;
  for (const CaseInput& ci : cases) {
    const uint64_t n = InputBytes(ci);
    if (n > kMaxCaseBytes) {
      return TooMany(absl::StrCat("a case of this verify (", Describe(ci.cand_in), ") needs ", n,
                                  " bytes of inputs; at most ", kMaxCaseBytes,
                                  " per case: give smaller shapes"),
                     "verify case bytes");
    }
    total += n;
  }
  if (total > kMaxVerifyBytes) {
    return TooMany(absl::StrCat("this verify would generate ", total, " bytes of inputs; at most ",
                                kMaxVerifyBytes,
                                " per verify: give fewer or smaller shapes, dtypes or seeds"),
                   "verify bytes");
  }
  return absl::OkStatus();
}

// The caller's shape sets (else the edge cases), checked.
absl::StatusOr<std::vector<ShapeSet>> CheckedShapes(const VerifyCall& c,
                                                    const registry::OpDef& cdef) {
  std::vector<ShapeSet> shapes = c.shapes;
  if (shapes.empty()) {
    for (int64_t n : {0, 1, 7, 13, 127, 1031, 65537}) shapes.push_back({{n}});
  }
  for (size_t s = 0; s < shapes.size(); ++s) {
    if (shapes[s].size() != 1 && shapes[s].size() != cdef.inputs.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape set ", s, " has ", shapes[s].size(), " shape(s); give one per input (",
          cdef.inputs.size(), ") or one for all"));
    }
    for (const auto& shape : shapes[s]) {
      int64_t n = 1;
      for (int64_t d : shape) {
        if (d < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("shape [", ShapeText(shape), "] has a negative dim"));
        }
        n = d == 0 ? 0 : (n > kMaxElementsPerTensor / d ? kMaxElementsPerTensor + 1 : n * d);
      }
      if (n > kMaxElementsPerTensor) {
        return TooMany(absl::StrCat("shape [", ShapeText(shape), "] has more than ",
                                    kMaxElementsPerTensor,
                                    " elements, the most a verify tensor may hold"),
                       "verify elements");
      }
    }
  }
  return shapes;
}

// The candidate's dtype rows, or those the caller named.
absl::StatusOr<std::vector<std::vector<std::string>>> SelectedRows(const VerifyCall& c,
                                                                   const registry::OpDef& cdef) {
  std::vector<std::vector<std::string>> rows = InputRows(cdef);
  if (c.dtypes.empty()) return rows;
  std::vector<std::vector<std::string>> kept;
  for (const std::string& d : c.dtypes) {
    auto it = std::find_if(rows.begin(), rows.end(),
                           [&](const auto& r) { return !r.empty() && r[0] == d; });
    if (it == rows.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", c.candidate, "' has no dtype row whose first input is ", d));
    }
    kept.push_back(*it);
  }
  return kept;
}

bool AnyFloat(const std::vector<std::string>& row) {
  return std::any_of(row.begin(), row.end(),
                     [](const std::string& d) { return DtypeOf(d).is_float(); });
}

// The `opjit verify` command line that runs the same cases again.
std::string VerifyReproduce(const VerifyCall& c, uint64_t seed) {
  std::string cmd = absl::StrCat("opjit verify ", OpName(c.ns, c.candidate, c.candidate_version));
  if (!c.reference.empty()) {
    absl::StrAppend(&cmd, " --against ", OpName(c.ns, c.reference, c.reference_version));
  }
  absl::StrAppend(&cmd, " --seed ", seed);
  if (c.seeds != 0) absl::StrAppend(&cmd, " --seeds ", c.seeds);
  for (const ShapeSet& set : c.shapes) {
    std::vector<std::string> parts;
    for (const auto& s : set) parts.push_back(ShapeText(s));
    absl::StrAppend(&cmd, " --shape ", absl::StrJoin(parts, ":"));
  }
  for (const std::string& d : c.dtypes) absl::StrAppend(&cmd, " --dtype ", ShellWord(d));
  if (c.low != 0 || c.high != 0) absl::StrAppend(&cmd, " --low ", c.low, " --high ", c.high);
  if (!c.special_values) absl::StrAppend(&cmd, " --no-special");
  if (c.tolerance.atol) absl::StrAppend(&cmd, " --atol ", *c.tolerance.atol);
  if (c.tolerance.rtol) absl::StrAppend(&cmd, " --rtol ", *c.tolerance.rtol);
  if (c.tolerance.ulps) absl::StrAppend(&cmd, " --ulps ", *c.tolerance.ulps);
  if (c.fp64_reference) absl::StrAppend(&cmd, " --fp64-reference");
  for (const std::string& n : c.inplace_inputs) absl::StrAppend(&cmd, " --inplace ", ShellWord(n));
  absl::StrAppend(&cmd, AttrFlags(c.attrs));
  if (c.settle_ms != 10) absl::StrAppend(&cmd, " --settle-ms ", c.settle_ms);
  return cmd;
}

}  // namespace

absl::StatusOr<std::vector<CaseInput>> Evaluator::Impl::GeneratedCases(
    const VerifyCall& c, const registry::OpDef& cdef, const Side& ref, uint64_t seed,
    std::vector<std::string>* notes) {
  OPJIT_ASSIGN_OR_RETURN(std::vector<ShapeSet> shapes, CheckedShapes(c, cdef));
  OPJIT_ASSIGN_OR_RETURN(auto rows, SelectedRows(c, cdef));
  // A row the reference refuses (probed on a shape set with no empty
  // tensor) is left out, and said so.
  const exec::ForwardCall ref_base = BaseCall(c.ns, c.principal, c.quarantine_caller, ref, c.attrs, c.deadline);
  const ShapeSet& probe_set = *std::find_if(shapes.begin(), shapes.end() - 1, [](const ShapeSet& s) {
    return std::all_of(s.begin(), s.end(), [](const auto& d) { return Elements(d) > 0; });
  });
  std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> runs;
  for (const auto& row : rows) {
    std::vector<std::string> ref_row = row;
    if (c.fp64_reference && Widened(row) != row &&
        Prepare(executor, ref_base, Descs(Widened(row), probe_set)).ok()) {
      ref_row = Widened(row);
      notes->push_back(absl::StrCat(row[0], ": reference in float64"));
    }
    absl::Status probe = Prepare(executor, ref_base, Descs(ref_row, probe_set)).status();
    if (IsRequestError(probe)) return probe;
    if (!probe.ok()) {
      notes->push_back(absl::StrCat(row.empty() ? "" : row[0],
                                    ": skipped, the reference refuses it: ", probe.message()));
      continue;
    }
    runs.emplace_back(row, ref_row);
  }
  if (runs.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("the reference '", c.reference,
                                                   "' accepts none of the dtype rows of '",
                                                   c.candidate, "'"));
  }
  const uint32_t seeds = c.seeds == 0 ? 2 : c.seeds;
  auto per_set = [&](const std::vector<std::string>& row) {
    return seeds + (AnyFloat(row) && c.special_values ? 1u : 0u);
  };
  size_t total = 0;
  for (const auto& run : runs) total += shapes.size() * per_set(run.first);
  if (total > kMaxCases) {
    return TooMany(absl::StrCat("this verify would run ", total, " cases; at most ", kMaxCases,
                                ": give fewer shapes, dtypes or seeds"),
                   "verify cases");
  }
  std::vector<CaseInput> cases;
  uint64_t stream = seed;
  for (const auto& [row, ref_row] : runs) {
    for (const ShapeSet& set : shapes) {
      for (uint32_t k = 0; k < per_set(row); ++k) {
        CaseInput ci;
        ci.kind = k < seeds ? "random" : "special";
        ci.seed = Mix(stream);
        ci.cand_in = Descs(row, set);
        ci.ref_in = Descs(ref_row, set);
        ci.specials = k >= seeds;
        cases.push_back(std::move(ci));
      }
    }
  }
  return cases;
}

absl::StatusOr<VerifyResult> Evaluator::Impl::Verify(const VerifyCall& c) {
  Side cand;
  OPJIT_ASSIGN_OR_RETURN(cand.record,
                         registry->GetShared(c.ns, c.candidate, c.candidate_version));
  cand.target = TargetOf(cand.record->def);
  const registry::OpDef& cdef = cand.record->def;
  OPJIT_RETURN_IF_ERROR(CheckVerifyCall(c, cdef));
  std::optional<Side> ref;
  if (!c.reference.empty()) {
    ref.emplace();
    OPJIT_ASSIGN_OR_RETURN(ref->record,
                           registry->GetShared(c.ns, c.reference, c.reference_version));
    ref->target = TargetOf(ref->record->def);
    const registry::OpDef& rdef = ref->record->def;
    if (rdef.inputs.size() != cdef.inputs.size() || rdef.outputs.size() != cdef.outputs.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the reference '", c.reference, "' takes ", rdef.inputs.size(), " input(s) and gives ",
          rdef.outputs.size(), " output(s); the candidate '", c.candidate, "' takes ",
          cdef.inputs.size(), " and gives ", cdef.outputs.size()));
    }
  }
  VerifyResult result;
  result.seed = c.seed;
  if (result.seed == 0) {
    OPJIT_ASSIGN_OR_RETURN(std::string hex, RandomHex128());
    result.seed = std::strtoull(hex.substr(0, 15).c_str(), nullptr, 16) | 1;
  }
  // The cases, all built before any runs, so the count limit holds first.
  absl::StatusOr<std::vector<CaseInput>> cases =
      ref ? GeneratedCases(c, cdef, *ref, result.seed, &result.tolerances) : GivenCases(c, cdef);
  if (!cases.ok()) return cases.status();
  OPJIT_RETURN_IF_ERROR(CheckVerifyBytes(*cases));
  std::vector<std::string> dtypes_seen;
  Regions case_regions;
  for (size_t i = 0; i < cases->size(); ++i) {
    OPJIT_RETURN_IF_ERROR(Interrupted(c.cancelled, Clock::time_point::max(), "verify"));
    if (PastDeadline(c.deadline)) return DeadlineError("verify", i, cases->size());
    CaseReport report;
    report.index = static_cast<int>(i);
    FillCase(c, &(*cases)[i]);
    const absl::Status ran =
        RunCase(c, cand, ref ? &*ref : nullptr, (*cases)[i], &case_regions, &report);
    ClearCase(&(*cases)[i]);
    OPJIT_RETURN_IF_ERROR(ran);
    for (const TensorDesc& d : (*cases)[i].cand_in) {
      if (std::find(dtypes_seen.begin(), dtypes_seen.end(), d.dtype) == dtypes_seen.end()) {
        dtypes_seen.push_back(d.dtype);
      }
    }
    (report.skipped ? result.skipped_cases
                    : report.passed ? result.passed_cases : result.failed_cases)++;
    if (!report.skipped && !report.deterministic) result.deterministic = false;
    result.cases.push_back(std::move(report));
  }
  for (const std::string& d : dtypes_seen) {
    result.tolerances.push_back(ToleranceText(d, ToleranceFor(c, d)));
  }
  if (std::any_of(dtypes_seen.begin(), dtypes_seen.end(),
                  [](const std::string& d) { return DtypeOf(d).is_float(); })) {
    result.tolerances.push_back(FpModeText("candidate", cdef, cand.target));
    if (ref) result.tolerances.push_back(FpModeText("reference", ref->record->def, ref->target));
  }
  result.passed = result.failed_cases == 0 && result.passed_cases > 0;
  result.reproduce = VerifyReproduce(c, result.seed);
  return result;
}

namespace {
// The benchmark's own limits, before anything runs.
absl::Status CheckBenchmarkCall(const BenchmarkCall& c) {
  if (c.warmup > kMaxWarmup) {
    return absl::InvalidArgumentError(
        absl::StrCat("warmup is ", c.warmup, "; at most ", kMaxWarmup, " per benchmark"));
  }
  if (c.max_reps > kMaxReps || c.min_reps > kMaxReps) {
    return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                          "repetitions are capped at ", kMaxReps, " per benchmark")),
                      reason::kQuotaExceeded, {{"limit", "benchmark reps"}});
  }
  if (c.min_time_ms > kMaxTimeMs) {
    return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                          "min_time_ms is capped at ", kMaxTimeMs, " per benchmark")),
                      reason::kQuotaExceeded, {{"limit", "benchmark time"}});
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<BenchmarkResult> Evaluator::Impl::Benchmark(const BenchmarkCall& c) {
  OPJIT_RETURN_IF_ERROR(CheckBenchmarkCall(c));
  std::vector<Side> sides(1);
  OPJIT_ASSIGN_OR_RETURN(sides[0].record, registry->GetShared(c.ns, c.op, c.version));
  sides[0].target = TargetOf(sides[0].record->def);
  if (!c.reference.empty()) {
    sides.emplace_back();
    OPJIT_ASSIGN_OR_RETURN(sides[1].record,
                           registry->GetShared(c.ns, c.reference, c.reference_version));
    sides[1].target = TargetOf(sides[1].record->def);
  }
  const registry::OpDef& def = sides[0].record->def;
  std::vector<std::vector<std::string>> rows = InputRows(def);
  std::vector<std::string> row = rows[0];
  if (!c.dtype.empty()) {
    auto it = std::find_if(rows.begin(), rows.end(),
                           [&](const auto& r) { return !r.empty() && r[0] == c.dtype; });
    if (it == rows.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", c.op, "' has no dtype row whose first input is ", c.dtype));
    }
    row = *it;
  }
  ShapeSet shape = c.shape.empty() ? ShapeSet{{int64_t{1} << 20}} : c.shape;
  if (shape.size() != 1 && shape.size() != def.inputs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the shape set has ", shape.size(),
                                                   " shape(s); give one per input (",
                                                   def.inputs.size(), ") or one for all"));
  }
  for (const auto& s : shape) {
    if (std::any_of(s.begin(), s.end(), [](int64_t d) { return d < 0; }) ||
        Elements(s) > kMaxElementsPerTensor) {
      return absl::InvalidArgumentError(absl::StrCat("shape [", ShapeText(s),
                                                     "] must have dims >= 0 and at most ",
                                                     kMaxElementsPerTensor, " elements"));
    }
  }
  const std::vector<TensorDesc> in = Descs(row, shape);
  const std::vector<std::string> bytes = Generate(in, c.seed == 0 ? 1 : c.seed, 0, 0, false);

  struct Prepared {
    exec::ForwardCall call;
    std::unique_ptr<CaseRegion> region;
    std::vector<double> e2e, kernel;
  };
  std::vector<Prepared> runs;
  for (const Side& side : sides) {
    exec::ForwardCall base = BaseCall(c.ns, c.principal, c.quarantine_caller, side, c.attrs, c.deadline);
    OPJIT_ASSIGN_OR_RETURN(exec::PreparedCall p, Prepare(executor, base, in));
    const Layout l = LayOut(in, p.outputs, 1);
    Prepared r;
    OPJIT_ASSIGN_OR_RETURN(r.region, CaseRegion::Create(regions, c.ns, c.principal, l.total,
                                                        options.region_lease_ms));
    for (size_t i = 0; i < in.size(); ++i) {
      std::memcpy(r.region->at(l.inputs[i]), bytes[i].data(), bytes[i].size());
    }
    r.call = PlacedCall(std::move(base), in, l, *r.region, 0);
    // The executor flushes right before each kernel, warm-ups too (its sweep
    // buffer is set up before the first measured run).
    r.call.flush_caches = c.flush_cache;
    runs.push_back(std::move(r));
  }
  uint64_t flushed = ~uint64_t{0};  // the least any measured run flushed
  auto run_once = [&](Prepared& r, bool record) -> absl::Status {
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<exec::ForwardResult> res = executor->Forward(r.call);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (!res.ok()) return res.status();
    if (record) {
      r.e2e.push_back(ms);
      r.kernel.push_back(res->kernel_ms);
      flushed = std::min(flushed, res->flushed_bytes);
    }
    return absl::OkStatus();
  };
  const uint32_t warmup = c.warmup, min_reps = std::max<uint32_t>(1, c.min_reps);
  const uint32_t max_reps = std::max(min_reps, c.max_reps == 0 ? 1000u : c.max_reps);
  for (uint32_t w = 0; w < warmup; ++w) {
    OPJIT_RETURN_IF_ERROR(Interrupted(c.cancelled, Clock::time_point::max(), "benchmark"));
    if (PastDeadline(c.deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "benchmark ran past its deadline in warm-up, after ", w, " of ", warmup,
          " warm-up run(s): give it a longer deadline or fewer warm-up runs"));
    }
    for (Prepared& r : runs) OPJIT_RETURN_IF_ERROR(run_once(r, false));
  }
  const Clock::time_point start = Clock::now();
  const auto min_time = std::chrono::milliseconds(c.min_time_ms);
  for (uint32_t rep = 0; rep < max_reps; ++rep) {
    if (rep >= min_reps && Clock::now() - start >= min_time) break;
    OPJIT_RETURN_IF_ERROR(Interrupted(c.cancelled, Clock::time_point::max(), "benchmark"));
    if (PastDeadline(c.deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "benchmark ran past its deadline after ", rep,
          " repetition(s): give it a longer deadline or a smaller min_time_ms"));
    }
    // Alternate which side goes first, so neither always runs warmer.
    for (size_t k = 0; k < runs.size(); ++k) {
      OPJIT_RETURN_IF_ERROR(run_once(runs[(rep + k) % runs.size()], true));
    }
  }
  auto stats = [](const Prepared& r) {
    TimingStats s;
    s.reps = static_cast<uint32_t>(r.e2e.size());
    s.median_ms = Percentile(r.e2e, 0.5);
    s.p10_ms = Percentile(r.e2e, 0.1);
    s.p90_ms = Percentile(r.e2e, 0.9);
    s.kernel_median_ms = Percentile(r.kernel, 0.5);
    s.kernel_p10_ms = Percentile(r.kernel, 0.1);
    s.kernel_p90_ms = Percentile(r.kernel, 0.9);
    s.spread = s.median_ms > 0 ? (s.p90_ms - s.p10_ms) / s.median_ms : 0;
    return s;
  };
  BenchmarkResult result;
  result.op = stats(runs[0]);
  result.flush_bytes = c.flush_cache && flushed != ~uint64_t{0} ? flushed : 0;
  result.shapes = Describe(in);
  if (runs.size() == 2) {
    result.reference = stats(runs[1]);
    std::vector<double> ratios;
    for (size_t i = 0; i < runs[0].kernel.size() && i < runs[1].kernel.size(); ++i) {
      // Kernel times of a few µs round to 0 on some clocks: use the call's.
      const double a = runs[0].kernel[i] > 0 ? runs[0].kernel[i] : runs[0].e2e[i];
      const double b = runs[1].kernel[i] > 0 ? runs[1].kernel[i] : runs[1].e2e[i];
      if (b > 0) ratios.push_back(a / b);
    }
    result.ratio = Percentile(ratios, 0.5);
    result.ratio_p10 = Percentile(ratios, 0.1);
    result.ratio_p90 = Percentile(ratios, 0.9);
  }
  std::string cmd = absl::StrCat("opjit bench ", OpName(c.ns, c.op, c.version));
  if (!c.reference.empty()) {
    absl::StrAppend(&cmd, " --against ", OpName(c.ns, c.reference, c.reference_version));
  }
  std::vector<std::string> parts;
  for (const auto& s : shape) parts.push_back(ShapeText(s));
  absl::StrAppend(&cmd, " --shape ", absl::StrJoin(parts, ":"), " --dtype ", row[0], " --seed ",
                  c.seed == 0 ? 1 : c.seed, " --warmup ", warmup, " --min-reps ", min_reps,
                  " --max-reps ", max_reps, " --min-time-ms ", c.min_time_ms);
  if (c.flush_cache) absl::StrAppend(&cmd, " --flush-cache");
  absl::StrAppend(&cmd, AttrFlags(c.attrs));
  result.reproduce = std::move(cmd);
  return result;
}

Evaluator::Evaluator(const EvaluatorOptions& options, registry::Registry* registry,
                     exec::Executor* executor, tensor::RegionManager* regions)
    : impl_(std::make_unique<Impl>(options, registry, executor, regions)) {}

Evaluator::~Evaluator() = default;

void Evaluator::Impl::Submit(Job job) {
  std::vector<Job> gone;  // queued by callers that have hung up: dropped
  absl::Status refused;
  {
    MutexLock lock(&mu);
    std::deque<Job>& q = queues[job.ns];
    for (auto it = q.begin(); it != q.end();) {
      if (it->cancelled && it->cancelled()) {
        gone.push_back(std::move(*it));
        it = q.erase(it);
        --queued;
      } else {
        ++it;
      }
    }
    if (stopping) {
      refused = absl::UnavailableError("the server is shutting down");
    } else if (q.size() >= options.max_queue_per_namespace) {
      refused = WithReason(
          absl::ResourceExhaustedError(absl::StrCat(
              "namespace '", job.ns, "' has ", q.size(),
              " evaluation(s) waiting, the most one namespace may queue (",
              options.max_queue_per_namespace, "); retry when one has finished")),
          reason::kQuotaExceeded,
          {{"limit", "evaluations per namespace"},
           {"max", absl::StrCat(options.max_queue_per_namespace)}});
    } else if (queued >= options.max_queue) {
      refused = WithReason(absl::ResourceExhaustedError(absl::StrCat(
                               "the server has ", queued,
                               " evaluations waiting, the most it queues; retry later")),
                           reason::kQuotaExceeded,
                           {{"limit", "evaluations"}, {"max", absl::StrCat(options.max_queue)}});
    } else {
      if (q.empty()) turn.push_back(job.ns);
      q.push_back(std::move(job));
      ++queued;
    }
    if (q.empty()) {
      turn.erase(std::remove(turn.begin(), turn.end(), job.ns), turn.end());
      queues.erase(job.ns);
    }
  }
  cv.Signal();
  for (Job& j : gone) j.refuse(absl::CancelledError("the caller cancelled it while it waited"));
  if (!refused.ok()) job.refuse(refused);
}

void Evaluator::Impl::Loop() {
  for (;;) {
    Job job;
    {
      MutexLock lock(&mu);
      while (!stopping && turn.empty()) cv.Wait(&mu);
      if (stopping) return;  // Stop answered what was queued
      const std::string ns = turn.front();
      turn.pop_front();
      std::deque<Job>& q = queues[ns];
      job = std::move(q.front());
      q.pop_front();
      --queued;
      if (q.empty()) {
        queues.erase(ns);
      } else {
        turn.push_back(ns);  // its next one waits for every other namespace's
      }
    }
    if (job.cancelled && job.cancelled()) {
      job.refuse(absl::CancelledError("the caller cancelled it while it waited"));
      continue;
    }
    job.run();
  }
}

void Evaluator::Impl::Stop() {
  std::map<std::string, std::deque<Job>> left;
  {
    MutexLock lock(&mu);
    stopping = true;
    stop.store(true);
    left.swap(queues);
    turn.clear();
    queued = 0;
  }
  cv.SignalAll();
  for (auto& [ns, q] : left) {
    for (Job& j : q) j.refuse(absl::UnavailableError("the server is shutting down"));
  }
}

absl::Status Evaluator::Impl::Interrupted(const std::function<bool()>& cancelled,
                                          Clock::time_point deadline, const char* what) const {
  if (stop.load()) {
    return absl::UnavailableError(
        absl::StrCat("the server is shutting down; the ", what, " was stopped"));
  }
  if (cancelled && cancelled()) {
    return absl::CancelledError(absl::StrCat("the caller cancelled the ", what));
  }
  if (PastDeadline(deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("the ", what, " ran past its deadline"));
  }
  return absl::OkStatus();
}

void Evaluator::Stop() { impl_->Stop(); }

void Evaluator::VerifyAsync(VerifyCall call, VerifyCallback done) {
  auto shared = std::make_shared<VerifyCall>(std::move(call));
  auto cb = std::make_shared<VerifyCallback>(std::move(done));
  Job job{shared->ns, shared->cancelled,
          [this, shared, cb] {
            shared->deadline = impl_->Capped(shared->deadline);
            (*cb)(impl_->Verify(*shared));
          },
          [cb](absl::Status s) { (*cb)(std::move(s)); }};
  impl_->Submit(std::move(job));
}

void Evaluator::BenchmarkAsync(BenchmarkCall call, BenchmarkCallback done) {
  auto shared = std::make_shared<BenchmarkCall>(std::move(call));
  auto cb = std::make_shared<BenchmarkCallback>(std::move(done));
  Job job{shared->ns, shared->cancelled,
          [this, shared, cb] {
            shared->deadline = impl_->Capped(shared->deadline);
            (*cb)(impl_->Benchmark(*shared));
          },
          [cb](absl::Status s) { (*cb)(std::move(s)); }};
  impl_->Submit(std::move(job));
}

}  // namespace opjit::evaluate
