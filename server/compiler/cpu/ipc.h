// The wire protocol between opjit's CPU compiler (the daemon side) and its
// sandboxed compile workers (`opjit-compile-worker`). Both ends include this
// header; it has no LLVM or clang dependency.
//
// Transport: a SOCK_STREAM socketpair. Each message is one untyped frame of
// server/common/frame_io.h: a 4-byte little-endian payload length, then the
// payload. A payload starts with a one-byte MessageKind, followed by the
// fields of that message in a fixed order, in the codec of
// server/common/codec.h (integers little-endian, strings as u32 length +
// bytes, string lists as u32 count + strings).
//
// Exchange: the worker sends one Hello when it is ready; then, for each
// WorkerRequest the daemon sends, the worker answers with one WorkerResponse.
// A worker that hits an LLVM fatal error or runs out of memory sends a
// WorkerResponse with the matching kind and exits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/common/frame_io.h"

namespace opjit::compiler::ipc {

// Bumped whenever a message layout changes; both ends must agree.
inline constexpr uint32_t kProtocolVersion = 6;  // 6: a profile's prefix PCH
// The largest frame each way. A request carries a source (at most 1 MiB,
// registry/validate.h) and its options; a response carries the object
// (kernels compile to KiBs, a few MiB with big tables) and the
// diagnostics. A worker whose response would be larger answers with a
// compile error instead (worker_main.cc).
inline constexpr uint32_t kMaxRequestBytes = 64u << 20;
inline constexpr uint32_t kMaxResponseBytes = 64u << 20;
// The daemon reads kFromWorker (a frame that has begun must end within 10 s;
// all compile workers' frames in flight share a 256 MiB budget), the worker
// reads kToWorker.
extern const frame_io::ChannelLimits kFromWorker;
extern const frame_io::ChannelLimits kToWorker;

enum class MessageKind : uint8_t { kHello = 1, kRequest = 2, kResponse = 3 };

// Sent once by a worker after startup.
struct Hello {
  uint32_t protocol_version = kProtocolVersion;
  int32_t pid = 0;
  std::string clang_version;          // clang::getClangFullVersion()
  std::string triple;                 // the target triple of the compile job
  std::string cpu;                    // -target-cpu the driver chose for -march=native
  std::vector<std::string> features;  // -target-feature list, sorted
  std::string fixed_flags;            // the fixed driver flags, space-separated
};

enum class RequestMode : uint8_t {
  kCompile = 1,  // compile `source` to an object
};

// What the descriptor that comes with a request (SCM_RIGHTS) is for. The
// worker never sees the PCH directory: it gets one file, opened by the
// daemon, and names it only by a virtual path (kPchVirtualDir).
enum class PchUse : uint8_t {
  kNone = 0,   // no PCH (a descriptor that comes anyway is closed)
  kLoad = 1,   // the descriptor is the PCH of `preamble`, read-only: load it
  kBuild = 2,  // build the PCH of `preamble`, write it to the descriptor (a
               // new, empty file), then compile with it
};

// Where a compile sees its preamble header and PCH: in memory, never on disk.
inline constexpr char kPchVirtualDir[] = "/opjit-preamble";
// Where a compile sees the request's extra files (WorkerRequest::files): in
// memory, for that compile only, searched first (-I); diagnostics and
// __FILE__ name them without this prefix.
inline constexpr char kFilesVirtualDir[] = "/opjit-src";

// One extra file of a request: a relative name (the registry's rules:
// registry/validate.h) and its content.
struct File {
  std::string name;
  std::string content;
};

enum class Language : uint8_t { kC = 1, kCxx = 2 };

struct WorkerRequest {
  RequestMode mode = RequestMode::kCompile;
  Language language = Language::kCxx;
  std::string source;
  std::string file_name;                  // a bare file name, no directory
  std::vector<std::string> options;       // validated user options
  std::vector<std::string> include_dirs;  // -I dirs in order, all allowed for reading
  // The PCH (C++ only): what the request's descriptor is for, the preamble's
  // directives (the header it is built from, served from memory), and the
  // user options it is built with.
  PchUse pch = PchUse::kNone;
  std::string preamble;
  std::vector<std::string> pch_options;
  // Bytes at the start of `source` the PCH stands for (its preamble, see
  // preamble.h): blanked when the PCH is used, compiled as they are when not.
  uint32_t preamble_bytes = 0;
  // Extra files: headers the source includes, and C/C++ translation units
  // (.c .cc .cpp .cxx) compiled with the same flags and linked into the one
  // object. Served from memory under kFilesVirtualDir.
  std::vector<File> files;
  // The descriptor (pch == kLoad) is a toolchain profile's shared prefix
  // PCH (cpu_compiler.h, CpuCompilerOptions::profiles) rather than the
  // source's preamble's: `preamble` is the header it was built from (clang
  // checks it as it loads the PCH), and nothing is blanked; it is loaded ahead of
  // the source when `prefix_main`, and of each extra unit named in
  // `prefix_units`. Another compile of the request does without it.
  bool pch_prefix = false;
  bool prefix_main = false;
  std::vector<std::string> prefix_units;
};

enum class ResponseKind : uint8_t {
  kOk = 1,
  kCompileError = 2,  // diagnostics explain it
  kFatalError = 3,    // LLVM fatal error; `diagnostics` holds its message; worker exits
  kOutOfMemory = 4,   // allocation failed under the memory limit; worker exits
  kBadRequest = 5,    // the request could not be decoded or set up; `diagnostics` says why
};

struct WorkerResponse {
  ResponseKind kind = ResponseKind::kOk;
  std::string object;
  std::string diagnostics;
  std::vector<std::string> dependencies;
  double compile_ms = 0;
  // Non-empty when the PCH could not be used; the compile still ran without it.
  std::string pch_note;
  bool pch_used = false;
  bool pch_built = false;  // kBuild: the whole PCH was written to the descriptor
  bool pch_stale = false;  // kLoad: the PCH could not be loaded (a header changed)
};

// Encoders return a whole payload (without the length prefix).
std::string Encode(const Hello& m);
std::string Encode(const WorkerRequest& m);
std::string Encode(const WorkerResponse& m);

// Decoders return DATA_LOSS for a malformed or truncated payload, or a
// payload of another kind, and INVALID_ARGUMENT for a field out of range.
absl::StatusOr<Hello> DecodeHello(const std::string& payload);
absl::StatusOr<WorkerRequest> DecodeRequest(const std::string& payload);
absl::StatusOr<WorkerResponse> DecodeResponse(const std::string& payload);

// Writes one frame to `fd`, waiting at most until `deadline`
// (absl::InfiniteFuture() for no limit), refusing a payload over the
// reader's limit (`limits`: the daemon writes kToWorker, the worker
// kFromWorker), with `pass_fd` (>= 0) attached. Never raises SIGPIPE.
// Errors: RESOURCE_EXHAUSTED (too large, nothing sent), DEADLINE_EXCEEDED,
// UNAVAILABLE (peer gone or I/O error).
absl::Status WriteFrame(int fd, const std::string& payload, absl::Time deadline,
                        const frame_io::ChannelLimits& limits = kToWorker, int pass_fd = -1);

// Reads one frame from `fd` into `*payload`, waiting at most until `deadline`.
// Errors: DEADLINE_EXCEEDED; OUT_OF_RANGE when the peer closed the stream
// before a frame began (clean EOF); DATA_LOSS when the peer broke the
// protocol (a frame over the limit, cut short or stalled);
// RESOURCE_EXHAUSTED when the budget is spent; UNAVAILABLE on I/O errors.
// kToWorker accepts one descriptor per frame: it lands in `*received_fd`
// (-1 when none came; the caller owns it), or is closed when that is null.
absl::Status ReadFrame(int fd, std::string* payload, absl::Time deadline,
                       const frame_io::ChannelLimits& limits = kFromWorker,
                       int* received_fd = nullptr);

// The bytes of a whole frame (length prefix and payload), for a worker that
// must send without allocating (out of memory, fatal errors).
std::string EncodeFrame(const std::string& payload);

}  // namespace opjit::compiler::ipc
