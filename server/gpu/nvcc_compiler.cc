#include "server/gpu/nvcc_compiler.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/error_info.h"
#include "server/common/frame_io.h"
#include "server/common/logging.h"
#include "server/common/posix_acl.h"
#include "server/common/status_macros.h"
#include "server/common/subprocess.h"


namespace opjit::gpu {
namespace {

struct RunResult {
  int exit_code = -1;  // when the process exited
  int signal = 0;      // when a signal ended it
  bool timed_out = false;
  std::string output;  // stdout and stderr, interleaved
};

// Runs argv[0] with `argv` in a new process group, stdout+stderr into one
// pipe, stdin from /dev/null. Kills the group at the deadline.
absl::StatusOr<RunResult> Run(
    const std::vector<std::string>& argv, int timeout_ms, bool isolate = false,
    std::optional<subprocess::SpawnOptions::UserNamespace> as = std::nullopt) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0)
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  // A clean environment but for the search path and temp dir nvcc and its
  // host compiler need; opjit-gpu-sandbox is told its parent and tagged with
  // this daemon's state dir (its PDEATHSIG, kept across its exec, then ends
  // nvcc with the daemon).
  const std::string program = argv[0].substr(argv[0].rfind('/') + 1);
  subprocess::SpawnOptions spawn;
  spawn.path = argv[0];
  spawn.args.assign(argv.begin() + 1, argv.end());
  if (program == "opjit-gpu-sandbox") {
    spawn.args.insert(spawn.args.begin(),
                      {subprocess::kParentPidFlag, std::to_string(::getpid())});
    spawn.tag_instance = true;
  }
  spawn.env = subprocess::FromEnvironment({"PATH", "TMPDIR", "ASAN_OPTIONS", "UBSAN_OPTIONS",
                                           "LSAN_OPTIONS"});
  if (std::getenv("PATH") == nullptr) spawn.env.push_back("PATH=/usr/bin:/bin");
  spawn.fds = {{1, fds[1]}, {2, fds[1]}};
  // Under the sandbox: namespaces of its own, where the daemon can make
  // them (as a compile worker's); the sandbox's flags go before the "--"
  // that starts nvcc's command line.
  if (isolate) {
    subprocess::SpawnOptions with;
    subprocess::IsolateHelper(&with, as);
    spawn.args.insert(std::find(spawn.args.begin(), spawn.args.end(), "--"), with.args.begin(),
                      with.args.end());
    spawn.new_pid_namespace = with.new_pid_namespace;
    spawn.user_namespace = with.user_namespace;
  }
  absl::StatusOr<pid_t> started = subprocess::Spawn(spawn);
  close(fds[1]);
  if (!started.ok()) {
    close(fds[0]);
    return absl::UnavailableError(
        absl::StrCat("could not start ", program, ": ", started.status().message()));
  }
  const pid_t pid = *started;

  RunResult result;
  // nvcc's output (its log) up to 4 MiB; the rest is read, counted and
  // reported, so nvcc never blocks on a full pipe. EOF: every process
  // holding the pipe is gone.
  constexpr size_t kMaxOutputBytes = 4u << 20;
  uint64_t dropped = 0;
  const absl::Status drained = frame_io::ReadStream(
      fds[0], kMaxOutputBytes, absl::Now() + absl::Milliseconds(timeout_ms), &result.output,
      &dropped);
  if (absl::IsDeadlineExceeded(drained)) {
    result.timed_out = true;
    kill(-pid, SIGKILL);
  }
  if (dropped > 0) {
    absl::StrAppend(&result.output, "\n[... ", dropped,
                    " more bytes of compiler output left out]\n");
  }
  close(fds[0]);
  // At EOF it is ending: a few seconds to exit, then SIGKILL (the group).
  absl::StatusOr<subprocess::Exit> ended = subprocess::Reap(
      pid, result.timed_out ? absl::ZeroDuration() : absl::Seconds(5), /*kill_group=*/true);
  const int status = ended.ok() ? ended->wait_status : W_EXITCODE(255, 0);
  // nvcc's children (cicc, ptxas, gcc) are in the same group; make sure none
  // outlives a killed or crashed nvcc.
  if (result.timed_out || WIFSIGNALED(status)) kill(-pid, SIGKILL);
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  return result;
}

struct Arch {
  int sm = 0;
  std::string suffix;  // "", "a" or "f"
  bool operator<(const Arch& o) const { return sm != o.sm ? sm < o.sm : suffix < o.suffix; }
  bool operator==(const Arch& o) const { return sm == o.sm && suffix == o.suffix; }
};

// "sm_90" -> {90, ""}; "sm_90a" -> {90, "a"}.
absl::StatusOr<Arch> ParseArch(const std::string& arch) {
  Arch a;
  size_t i = 3;
  if (arch.rfind("sm_", 0) == 0) {
    while (i < arch.size() && i < 7 && std::isdigit(static_cast<unsigned char>(arch[i]))) {
      a.sm = a.sm * 10 + (arch[i++] - '0');
    }
    a.suffix = arch.substr(i);
  }
  if (i == 3 || (!a.suffix.empty() && a.suffix != "a" && a.suffix != "f")) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid GPU arch '", arch, "': expected sm_NN, e.g. sm_90"));
  }
  return a;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Writes a kernel's extra files under `dir` (each name a plain relative
// path); returns the files and the directories made for them.
template <typename Files>
absl::StatusOr<std::vector<std::string>> WriteExtraFiles(const std::string& dir,
                                                         const Files& files) {
  std::vector<std::string> written;
  for (const auto& [fname, content] : files) {
    const std::filesystem::path rel(fname);
    bool bad = fname.empty() || rel.is_absolute() || fname.find('\\') != std::string::npos ||
               fname.find('\0') != std::string::npos;
    for (const auto& part : rel) bad = bad || part == ".." || part == "." || part.empty();
    if (bad || rel.lexically_normal().string() != fname) {
      return absl::InvalidArgumentError(
          absl::StrCat("extra file name \"", fname, "\" is not a plain relative path"));
    }
    std::filesystem::path path = std::filesystem::path(dir) / rel;
    std::error_code ec;
    for (auto parent = rel.parent_path(); !parent.empty(); parent = parent.parent_path()) {
      written.push_back((std::filesystem::path(dir) / parent).string());
    }
    std::filesystem::create_directories(path.parent_path(), ec);
    std::ofstream f(path, std::ios::binary);
    f.write(content.data(), static_cast<std::streamsize>(content.size()));
    if (ec || !f) return absl::InternalError(absl::StrCat("could not write the extra file ", fname));
    written.push_back(path.string());
  }
  return written;
}

}  // namespace

absl::StatusOr<NvccOutput> CompileAotSharedObject(const NvccRequest& request) {
  const auto start = std::chrono::steady_clock::now();
  if (request.archs.empty()) return absl::InvalidArgumentError("NvccRequest.archs is empty");
  std::vector<Arch> archs;
  for (const std::string& a : request.archs) {
    OPJIT_ASSIGN_OR_RETURN(Arch parsed, ParseArch(a));
    archs.push_back(parsed);
  }
  std::sort(archs.begin(), archs.end());
  archs.erase(std::unique(archs.begin(), archs.end()), archs.end());

  const std::string nvcc = request.cuda_root + "/bin/nvcc";
  if (access(nvcc.c_str(), X_OK) != 0) {
    return absl::UnavailableError(
        absl::StrCat("nvcc not found at ", nvcc, "; install the CUDA toolkit"));
  }
  std::string tmp_root = request.tmp_dir;
  if (tmp_root.empty()) {
    const char* t = std::getenv("TMPDIR");
    tmp_root = t != nullptr && *t != '\0' ? t : "/tmp";
  }
  std::string tmpl = tmp_root + "/opjit-nvcc-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp in ", tmp_root, ": ", std::strerror(errno)));
  }
  const std::string dir = tmpl;
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{dir};

  // The source keeps its file name (without directories), so diagnostics read
  // "kernel.cu(3): error: ...".
  std::string name = std::filesystem::path(request.file_name).filename().string();
  if (name.empty() || name == "." || name == "..") name = "kernel.cu";
  if (name.size() < 3 || name.compare(name.size() - 3, 3, ".cu") != 0) name += ".cu";
  const std::string src = dir + "/" + name;
  const std::string out = dir + "/k.so";
  {
    std::ofstream f(src, std::ios::binary);
    f.write(request.source.data(), static_cast<std::streamsize>(request.source.size()));
    if (!f) return absl::InternalError(absl::StrCat("could not write ", src));
  }
  // The extra files beside the source, in this compile's own directory.
  OPJIT_ASSIGN_OR_RETURN(std::vector<std::string> written, WriteExtraFiles(dir, request.files));

  std::vector<std::string> argv;
  std::optional<subprocess::SpawnOptions::UserNamespace> as;  // a non-root daemon's compile ids
  if (!request.sandbox_path.empty()) {
    argv = {request.sandbox_path, "--exec", "--rw", dir, "--ro", request.cuda_root,
            "--memory", std::to_string(request.memory_limit_bytes)};
    // A root daemon's compile uid owns the temp dir (and reads the source).
    if (request.compile_uid > 0 && ::geteuid() == 0) {
      const uid_t u = static_cast<uid_t>(request.compile_uid);
      if (::chown(dir.c_str(), u, u) != 0 || ::chown(src.c_str(), u, u) != 0) {
        return absl::InternalError(absl::StrCat("chown of the temp dir: ", std::strerror(errno)));
      }
      for (const std::string& w : written) {
        if (::chown(w.c_str(), u, u) != 0) {
          return absl::InternalError(absl::StrCat("chown of the temp dir: ", std::strerror(errno)));
        }
      }
      argv.insert(argv.end(), {"--uid", std::to_string(request.compile_uid)});
    } else if (request.compile_uid > 0) {
      // Not root: the temp dir's ACL lets the compile uid work in it (the
      // source is world-readable; what nvcc writes, the daemon reads).
      const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      absl::Status granted = fd >= 0 ? GrantUserAll(fd, static_cast<uid_t>(request.compile_uid))
                                     : absl::InternalError(std::strerror(errno));
      if (fd >= 0) ::close(fd);
      bool readable = ::chmod(src.c_str(), 0644) == 0;
      for (const std::string& w : written) {
        const bool is_dir = std::filesystem::is_directory(w);
        readable = readable && ::chmod(w.c_str(), is_dir ? 0755 : 0644) == 0;
      }
      if (granted.ok() && readable) {
        as = subprocess::CompileIds(request.compile_uid, request.compile_gid);
      } else {
        Logger("gpu")->warn("nvcc runs as opjitd's own uid: the compile uid cannot be granted "
                            "its temp directory ({})",
                            std::string(granted.message()));
      }
    }
    if (!request.kernel_include_dir.empty()) argv.insert(argv.end(), {"--ro", request.kernel_include_dir});
    for (const std::string& d : request.extra_include_dirs) argv.insert(argv.end(), {"--ro", d});
    argv.push_back("--");
  }
  argv.insert(argv.end(), {nvcc, "-shared", "-Xcompiler", "-fPIC", "-O3"});
  for (const Arch& a : archs) {
    argv.push_back(
        absl::StrCat("--generate-code=arch=compute_", a.sm, a.suffix, ",code=sm_", a.sm, a.suffix));
  }
  // Generic PTX of the lowest arch, so GPUs newer than every CUBIN still run it.
  argv.push_back(absl::StrCat("--generate-code=arch=compute_", archs.front().sm, ",code=compute_",
                              archs.front().sm));
  // The kernel's own files first (quoted includes find them beside the
  // source anyway; this serves <helper.h> and includes from other dirs).
  if (!request.files.empty()) argv.push_back("-I" + dir);
  if (!request.kernel_include_dir.empty()) argv.push_back("-I" + request.kernel_include_dir);
  for (const std::string& d : request.extra_include_dirs) argv.push_back("-I" + d);
  argv.insert(argv.end(), request.options.begin(), request.options.end());
  argv.insert(argv.end(), {"-o", out, src});

  auto log = Logger("gpu");
  log->debug("nvcc: {}", absl::StrJoin(argv, " "));
  OPJIT_ASSIGN_OR_RETURN(RunResult r,
                         Run(argv, request.timeout_ms, !request.sandbox_path.empty(), as));
  // Paths of the temp dir mean nothing to the client.
  std::string diagnostics = r.output;
  for (size_t p = 0; (p = diagnostics.find(dir + "/", p)) != std::string::npos;)
    diagnostics.erase(p, dir.size() + 1);

  if (r.timed_out) {
    return absl::DeadlineExceededError(
        absl::StrCat("nvcc ran past ", request.timeout_ms, " ms and was killed\n", diagnostics));
  }
  if (r.signal != 0) {
    return absl::InternalError(absl::StrCat("nvcc died of signal ", r.signal, "\n", diagnostics));
  }
  if (r.exit_code != 0)
    return WithReason(absl::InvalidArgumentError(absl::StrCat("compile failed:\n", diagnostics)),
                      reason::kCompileFailed);

  NvccOutput result;
  result.shared_object = ReadFile(out);
  if (result.shared_object.size() < 64) {
    return absl::InternalError(
        absl::StrCat("nvcc succeeded but wrote no shared object\n", diagnostics));
  }
  result.diagnostics = std::move(diagnostics);
  result.compile_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  log->debug("nvcc compiled {} ({} bytes) in {:.0f} ms", name, result.shared_object.size(),
             result.compile_ms);
  return result;
}

absl::StatusOr<std::string> NvccToolchainId(const std::string& cuda_root) {
  const std::string nvcc = cuda_root + "/bin/nvcc";
  if (access(nvcc.c_str(), X_OK) != 0) {
    return absl::UnavailableError(
        absl::StrCat("nvcc not found at ", nvcc, "; install the CUDA toolkit"));
  }
  OPJIT_ASSIGN_OR_RETURN(RunResult r, Run({nvcc, "--version"}, 30000));
  if (r.exit_code != 0)
    return absl::UnavailableError(absl::StrCat("nvcc --version failed:\n", r.output));
  // The last line: "Build cuda_13.0.r13.0/compiler.36424714_0"; the release line
  // before it has the version. Keep both.
  std::string id = "nvcc";
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("release") != std::string::npos || line.rfind("Build ", 0) == 0)
      absl::StrAppend(&id, ";", line);
  }
  // The host compiler changes the host code in the .so.
  absl::StatusOr<RunResult> host = Run({"/usr/bin/env", "gcc", "--version"}, 30000);
  if (host.ok() && host->exit_code == 0) {
    absl::StrAppend(&id, ";host=", host->output.substr(0, host->output.find('\n')));
  }
  return id;
}

}  // namespace opjit::gpu
