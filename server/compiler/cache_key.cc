#include "server/compiler/cache_key.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/sha256.h"
#include "server/compiler/kernel_compiler.h"

namespace opjit::compiler {
namespace {

namespace fs = std::filesystem;

std::string CanonicalDir(const std::string& dir) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  std::string s = (ec ? fs::path(dir) : p).lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

// SHA-256 of a file's bytes; "" when it cannot be read.
std::string FileDigest(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  Sha256 h;
  char buf[1 << 16];
  while (in) {
    in.read(buf, sizeof(buf));
    if (in.gcount() > 0) h.Update(std::string_view(buf, static_cast<size_t>(in.gcount())));
  }
  if (in.bad()) return "";
  return h.HexDigest();
}

}  // namespace

IncludeRoots IncludeRoots::Create(const std::string& kernel_dir,
                                  const std::vector<std::string>& extra_dirs, Limits limits) {
  IncludeRoots r;
  if (!kernel_dir.empty()) r.roots_.push_back({"kernel", CanonicalDir(kernel_dir)});
  for (size_t i = 0; i < extra_dirs.size(); ++i) {
    r.roots_.push_back({absl::StrCat("extra", i + 1), CanonicalDir(extra_dirs[i])});
  }
  Sha256 id;
  id.UpdateField("opjit-include-roots-1");
  for (const Root& root : r.roots_) {
    id.UpdateField(root.label);
    // Sorted relative names, so that the walk's order does not matter.
    std::vector<std::pair<std::string, fs::path>> files;
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(
             root.dir, fs::directory_options::skip_permission_denied, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      std::error_code fe;
      if (!it->is_regular_file(fe) || fe) continue;
      files.emplace_back(it->path().lexically_relative(root.dir).string(), it->path());
    }
    std::sort(files.begin(), files.end());
    id.UpdateField(absl::StrCat(files.size()));
    uint64_t content_bytes = 0;
    for (size_t i = 0; i < files.size(); ++i) {
      const auto& [rel, path] = files[i];
      id.UpdateField(rel);
      std::error_code se;
      const uint64_t size = fs::file_size(path, se);
      const bool hash = !se && i < limits.max_files &&
                        content_bytes + size <= limits.max_content_bytes;
      if (hash) {
        content_bytes += size;
        const std::string digest = FileDigest(path);
        id.UpdateField(digest.empty() ? "unreadable" : digest);
        ++r.files_hashed_;
      } else {
        id.UpdateField(absl::StrCat("size=", se ? -1 : static_cast<int64_t>(size)));
        ++r.files_listed_only_;
      }
    }
  }
  r.identity_ = id.HexDigest();
  return r;
}

std::string IncludeRoots::Portable(const std::string& path) const {
  const Root* best = nullptr;
  for (const Root& root : roots_) {
    if (root.dir.empty() || root.dir == "/") continue;
    if (path.size() > root.dir.size() + 1 && path.compare(0, root.dir.size(), root.dir) == 0 &&
        path[root.dir.size()] == '/' && (best == nullptr || root.dir.size() > best->dir.size())) {
      best = &root;
    }
  }
  if (best == nullptr) return path;
  return absl::StrCat(best->label, ":", path.substr(best->dir.size() + 1));
}

std::string IncludeRoots::Local(const std::string& portable) const {
  if (portable.empty() || portable[0] == '/') return portable;
  const size_t colon = portable.find(':');
  if (colon == std::string::npos || colon + 1 == portable.size()) return "";
  const std::string label = portable.substr(0, colon);
  const std::string rel = portable.substr(colon + 1);
  // A relative name that climbs out of its root is not one this daemon wrote.
  if (rel[0] == '/' || fs::path(rel).lexically_normal().string().rfind("..", 0) == 0) return "";
  for (const Root& root : roots_) {
    if (root.label == label) return absl::StrCat(root.dir, "/", rel);
  }
  return "";
}

std::string RequestKey(const CompileJob& job, const std::string& backend_identity,
                       const std::string& include_identity) {
  Sha256 h;
  h.UpdateField(absl::StrCat("opjit-kernel-abi-", kKernelAbiVersion));
  h.UpdateField(backend_identity);
  h.UpdateField(include_identity);
  h.UpdateField(registry::TargetName(job.target));
  h.UpdateField(job.language);
  h.UpdateField(absl::StrJoin(job.options, "\x1f"));
  h.UpdateField(absl::StrJoin(job.libraries, "\x1f"));
  h.UpdateField(job.source);
  // Always kernel.<ext> (see CompileJob::file_name), which __FILE__ sees.
  h.UpdateField(job.file_name);
  // The extra files, by name and content, in order; nothing for a one-file
  // kernel, whose key stays what it was.
  if (!job.files.empty()) {
    h.UpdateField(absl::StrCat("files=", job.files.size()));
    for (const registry::SourceFile& f : job.files) {
      h.UpdateField(f.name);
      h.UpdateField(f.content);
    }
  }
  return h.HexDigest();
}

std::string FinalKey(const std::string& request_key,
                     const std::vector<std::pair<std::string, std::string>>& deps) {
  // Sorted by portable name: local paths sort differently on another host.
  std::vector<std::pair<std::string, std::string>> sorted = deps;
  std::sort(sorted.begin(), sorted.end());
  Sha256 h;
  h.UpdateField(request_key);
  for (const auto& [name, digest] : sorted) {
    h.UpdateField(name);
    h.UpdateField(digest);
  }
  return h.HexDigest();
}

}  // namespace opjit::compiler
