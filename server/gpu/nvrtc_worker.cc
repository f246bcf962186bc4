// The NVRTC worker's side of the pool (nvrtc_pool.h): the request loop that
// opjit-gpu-sandbox --nvrtc-worker runs once it is confined.
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/gpu/nvrtc_pool.h"

namespace opjit::gpu {
namespace {

namespace fs = std::filesystem;

// At most this many files of the include dirs are looked at per compile.
constexpr size_t kMaxIncludeFiles = 4096;

// What the extra include dirs hold, as names, sizes, inodes and times:
// NVRTC loads a PCH without checking its headers, so the PCHs go when this
// changes (an operator edited a header).
std::string IncludeState(const std::vector<std::string>& dirs) {
  std::string out;
  size_t n = 0;
  for (const std::string& dir : dirs) {
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(
             dir, fs::directory_options::skip_permission_denied, ec);
         !ec && it != fs::recursive_directory_iterator() && n < kMaxIncludeFiles;
         it.increment(ec), ++n) {
      struct stat st {};
      if (::lstat(it->path().c_str(), &st) != 0) continue;
      absl::StrAppend(&out, it->path().native(), "\x1f", st.st_size, ":", st.st_ino, ":",
                      st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, "\n");
    }
  }
  return out;
}

// Removes every PCH (every file) in `dir`.
void DropPchs(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::error_code rm;
    fs::remove_all(e.path(), rm);
  }
}

// Before a compile with PCHs: they go when a header changed, or when less
// than a quarter of the tmpfs is free (a new PCH must fit: NVRTC fails a
// compile whose PCH it cannot write).
void KeepPchsUsable(const NvrtcOptions& o, std::string* include_state) {
  std::string now = IncludeState(o.extra_include_dirs);
  struct statvfs vfs {};
  const bool short_of_room = ::statvfs(o.pch_dir.c_str(), &vfs) == 0 &&
                             vfs.f_bavail * 4 < vfs.f_blocks;
  if (now != *include_state || short_of_room) DropPchs(o.pch_dir);
  *include_state = std::move(now);
}

// RLIMIT_CPU: `seconds` more than the worker has used, for a compile that
// nobody waits for any more (the daemon's deadline comes first).
void LimitCpu(uint64_t seconds) {
  if (seconds == 0) return;
  rusage u{};
  rlimit l{};
  if (::getrusage(RUSAGE_SELF, &u) != 0 || ::getrlimit(RLIMIT_CPU, &l) != 0) return;
  const rlim_t used = static_cast<rlim_t>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1;
  l.rlim_cur = std::min<rlim_t>(used + seconds, l.rlim_max);
  (void)::setrlimit(RLIMIT_CPU, &l);
}

absl::StatusOr<GpuCompileOutput> CompileOne(const NvrtcCompiler& compiler, std::string_view body,
                                            uint64_t cpu_seconds, std::string* include_state) {
  GpuCompileRequest req;
  if (!DecodeGpuRequest(body, &req)) return absl::InvalidArgumentError("malformed compile request");
  const NvrtcOptions& o = compiler.options();
  if (!o.pch_dir.empty()) KeepPchsUsable(o, include_state);
  LimitCpu(cpu_seconds);
  bool pch_broke = false;
  absl::StatusOr<GpuCompileOutput> out = compiler.CompileHere(req, &pch_broke);
  if (pch_broke) DropPchs(o.pch_dir);
  return out;
}

}  // namespace

int ServeNvrtcWorker(const NvrtcCompiler& compiler, int fd, uint64_t cpu_seconds) {
  const NvrtcOptions& o = compiler.options();
  if (!frame_io::WriteFrame(fd, nvrtc_wire::kFromWorker, nvrtc_wire::kHello,
                            nvrtc_wire::EncodeHello(!o.pch_dir.empty()), absl::InfiniteFuture())
           .ok()) {
    return 4;
  }
  std::string include_state = IncludeState(o.extra_include_dirs);
  for (;;) {
    frame_io::Frame f;
    absl::Status s = frame_io::ReadFrame(fd, nvrtc_wire::kToWorker, absl::InfiniteFuture(), &f);
    if (absl::IsOutOfRange(s)) return 0;  // the daemon is done with this worker
    if (!s.ok() || f.type != nvrtc_wire::kRequest) return 4;
    std::string answer = EncodeGpuResult(CompileOne(compiler, f.body, cpu_seconds, &include_state));
    if (answer.size() >= nvrtc_wire::kMaxResultBytes) {
      answer = EncodeGpuResult(absl::ResourceExhaustedError(absl::StrCat(
          "the GPU compiler's answer was over ", nvrtc_wire::kMaxResultBytes >> 20,
          " MiB; refused")));
    }
    if (!frame_io::WriteFrame(fd, nvrtc_wire::kFromWorker, nvrtc_wire::kResult, answer,
                              absl::InfiniteFuture())
             .ok()) {
      return 4;
    }
  }
}

}  // namespace opjit::gpu
