#include "server/runner/worker_protocol.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/status_macros.h"
#include "server/compiler/kernel_compiler.h"
#include "server/registry/attr_value.h"
#include "server/registry/canonical.h"

namespace opjit::runner::wire {

void Writer::Desc(const TensorDesc& d) {
  Str(d.dtype);
  Count(d.shape.size());
  for (int64_t x : d.shape) I64(x);
}

void Writer::Descs(const std::vector<TensorDesc>& v) {
  Count(v.size());
  for (const auto& d : v) Desc(d);
}

TensorDesc Reader::Desc() {
  TensorDesc d;
  d.dtype = Str();
  d.shape.resize(Count(8));
  for (auto& x : d.shape) x = I64();
  return d;
}

std::vector<TensorDesc> Reader::Descs() {
  // A descriptor takes at least its dtype's length and its rank: 8 bytes.
  std::vector<TensorDesc> v(Count(8));
  for (auto& d : v) {
    d = Desc();
    if (!ok()) return {};
  }
  return v;
}

std::string EncodeKernel(const compiler::CompiledKernel& k) {
  Writer w;
  w.U8(static_cast<uint8_t>(k.target));
  w.Str(k.cache_key);
  // The frame keeps its layout: a CPU object's fields (empty for a GPU
  // binary), then a flag and the GPU binary's fields.
  const compiler::CpuObject no_object;
  const compiler::CpuObject* cpu = k.cpu_object() != nullptr ? k.cpu_object() : &no_object;
  w.Str(cpu->elf);
  w.Strs(cpu->libraries);
  w.Strs(cpu->defined_symbols);
  const compiler::GpuBinary* gpu = k.gpu();
  w.U8(gpu != nullptr);
  if (gpu != nullptr) {
    const auto& g = *gpu;
    w.Count(g.cubins.size());
    for (const auto& [arch, bin] : g.cubins) {
      w.Str(arch);
      w.Str(bin);
    }
    w.Str(g.ptx);
    w.Str(g.ptx_arch);
    w.Count(g.lowered_names.size());
    for (const auto& [expr, name] : g.lowered_names) {
      w.Str(expr);
      w.Str(name);
    }
    w.Str(g.shared_object);
    w.Strs(g.archs);
  }
  return std::move(w.out());
}

absl::StatusOr<std::shared_ptr<const compiler::CompiledKernel>> DecodeKernel(std::string_view in) {
  Reader r(in);
  auto k = std::make_shared<compiler::CompiledKernel>();
  // Only the targets this build knows; anything else is a protocol error,
  // never a CPU kernel by default.
  const uint8_t target = r.U8();
  switch (static_cast<registry::Target>(target)) {
    case registry::Target::kCpu:
    case registry::Target::kGpu:
      k->target = static_cast<registry::Target>(target);
      break;
    default:
      if (r.ok()) {
        return absl::DataLossError(
            absl::StrCat("malformed kernel frame: unknown target ", static_cast<int>(target)));
      }
  }
  k->cache_key = r.Str();
  compiler::CpuObject cpu;
  cpu.elf = r.Str();
  cpu.libraries = r.Strs();
  cpu.defined_symbols = r.Strs();
  if (!r.U8()) {
    k->artifact = std::move(cpu);
  } else {
    // A GPU binary: the CPU fields are empty.
    if (!cpu.elf.empty() || !cpu.libraries.empty() || !cpu.defined_symbols.empty()) {
      return absl::DataLossError("malformed kernel frame");
    }
    compiler::GpuBinary* g = &k->artifact.emplace<compiler::GpuBinary>();
    // Each entry takes at least its two string lengths.
    for (uint32_t i = 0, n = r.Count(8); r.ok() && i < n; ++i) {
      std::string arch = r.Str();
      g->cubins[arch] = r.Str();
    }
    g->ptx = r.Str();
    g->ptx_arch = r.Str();
    for (uint32_t i = 0, n = r.Count(8); r.ok() && i < n; ++i) {
      std::string expr = r.Str();
      g->lowered_names[expr] = r.Str();
    }
    g->shared_object = r.Str();
    g->archs = r.Strs();
  }
  if (!r.done()) return absl::DataLossError("malformed kernel frame");
  return std::shared_ptr<const compiler::CompiledKernel>(std::move(k));
}

std::string EncodeInstance(uint64_t id, const InstanceSpec& spec) {
  Writer w;
  w.U64(id);
  w.Str(spec.kernel->cache_key);
  w.Str(spec.ns);
  w.Str(spec.label);
  w.Str(spec.entry);
  w.Descs(spec.inputs);
  w.Strs(spec.input_names);
  w.Descs(spec.outputs);
  w.Count(spec.attrs.size());
  for (const auto& [name, value] : spec.attrs) {
    w.Str(name);
    w.U8(static_cast<uint8_t>(registry::ValueTypeOf(value)));
    w.Str(registry::FormatAttrValue(value));
  }
  // GPU launches need the op's launch spec and names.
  const bool gpu = spec.kernel->target == registry::Target::kGpu && spec.def != nullptr;
  w.U8(gpu);
  if (gpu) {
    w.Str(registry::ToJson(*spec.def));
    w.U32(static_cast<uint32_t>(spec.impl_index));
  }
  return std::move(w.out());
}

absl::StatusOr<InstanceSpec> DecodeInstance(
    std::string_view in, uint64_t* id,
    const std::map<std::string, std::shared_ptr<const compiler::CompiledKernel>>& kernels) {
  Reader r(in);
  InstanceSpec spec;
  *id = r.U64();
  std::string key = r.Str();
  spec.ns = r.Str();
  spec.label = r.Str();
  spec.entry = r.Str();
  spec.inputs = r.Descs();
  spec.input_names = r.Strs();
  spec.outputs = r.Descs();
  // An attribute takes at least its name's length, its type and its text's length.
  for (uint32_t i = 0, n = r.Count(9); r.ok() && i < n; ++i) {
    std::string name = r.Str();
    auto type = static_cast<registry::ValueType>(r.U8());
    std::string text = r.Str();
    if (!r.ok()) break;
    OPJIT_ASSIGN_OR_RETURN(spec.attrs[name], registry::ParseAttrValue(type, text));
  }
  if (r.U8()) {
    std::string json = r.Str();
    spec.impl_index = static_cast<int>(r.U32());
    if (!r.ok()) return absl::DataLossError("malformed instance frame");
    OPJIT_ASSIGN_OR_RETURN(registry::OpDef def, registry::FromJson(json));
    spec.def = std::make_shared<const registry::OpDef>(std::move(def));
  }
  if (!r.done()) return absl::DataLossError("malformed instance frame");
  auto it = kernels.find(key);
  if (it == kernels.end()) return absl::NotFoundError("kernel not loaded");
  spec.kernel = it->second;
  return spec;
}

namespace {

// All executors' frames in flight in the daemon, together.
frame_io::PeerBudget executor_budget(64u << 20);

frame_io::ChannelLimits FromExecutor() {
  frame_io::ChannelLimits l;
  l.name = "executor channel";
  l.max_frame_bytes = kMaxFromExecutorBytes;
  l.stall_limit = absl::Seconds(5);
  l.budget = &executor_budget;
  return l;
}

frame_io::ChannelLimits ToExecutor() {
  frame_io::ChannelLimits l;
  l.name = "executor channel";
  l.max_frame_bytes = kMaxToExecutorBytes;
  l.accept_fd = true;
  return l;
}

}  // namespace

const frame_io::ChannelLimits kFromExecutor = FromExecutor();
const frame_io::ChannelLimits kToExecutor = ToExecutor();

absl::Status SendFrame(int sock, Msg type, std::string_view payload, int fd, absl::Time deadline) {
  return frame_io::WriteFrame(sock, kToExecutor, static_cast<uint8_t>(type), payload, deadline, fd);
}

absl::Status RecvFrame(int sock, Msg* type, std::string* payload, absl::Time deadline, int* fd,
                       const frame_io::ChannelLimits& limits) {
  frame_io::ChannelLimits l = limits;
  l.accept_fd = l.accept_fd && fd != nullptr;
  frame_io::Frame f;
  absl::Status s = frame_io::ReadFrame(sock, l, deadline, &f);
  if (fd != nullptr) *fd = f.fd;
  if (!s.ok()) return s;
  *type = static_cast<Msg>(f.type);
  *payload = std::move(f.body);
  return absl::OkStatus();
}

std::string MessageWithReason(const absl::Status& status) {
  std::optional<ErrorReason> r = GetReason(status);
  if (!r || r->reason != reason::kKernelFailed) return std::string(status.message());
  auto rc = r->metadata.find("return_code");
  return absl::StrCat("\x1f", r->reason, "\x1f", rc == r->metadata.end() ? "" : rc->second,
                      "\x1f", status.message());
}

absl::Status StatusFromReply(int32_t code, const std::string& message) {
  if (code == 0) return absl::OkStatus();
  if (code < 0 || code > 16) return absl::InternalError("the executor process sent a bad reply");
  const auto c = static_cast<absl::StatusCode>(code);
  const std::string prefix = absl::StrCat("\x1f", reason::kKernelFailed, "\x1f");
  if (message.rfind(prefix, 0) == 0) {
    const size_t end = message.find('\x1f', prefix.size());
    if (end != std::string::npos && end - prefix.size() <= 12) {
      return WithReason(absl::Status(c, message.substr(end + 1)), reason::kKernelFailed,
                        {{"return_code", message.substr(prefix.size(), end - prefix.size())}});
    }
  }
  return absl::Status(c, message);
}

}  // namespace opjit::runner::wire
