// Cache keys from content only. Two daemons installed under different
// prefixes (a build tree's kernels/include and /usr/share/opjit/include, or
// libtorch's headers in two places) must compute the same keys for the same
// source and the same header contents, or a fleet that mixes install
// prefixes never shares the Redis tier. So nothing here hashes where a file
// is, only what it holds and which include root it was found under:
//
//   include identity = for each include root, in search order: its label
//                      ("kernel", "extra1", "extra2", ...) and a digest of its
//                      tree (every regular file's relative name and content),
//                      taken once at startup
//   request key      = SHA-256(ABI version, backend identity, include
//                      identity, target, language, options, libraries,
//                      source, canonical file name, then each extra file
//                      of the job: its name and content)
//   final key        = SHA-256(request key, then per header the compile read:
//                      its portable name and the SHA-256 of its content)
//
// A header's portable name is "<label>:<path relative to the root>" when it
// lies under an include root (the innermost one), else its absolute path
// (the system's and the compiler's own headers, which a package puts at the
// same place on every host). Manifests (local and remote) record portable
// names, so a daemon maps another's dependencies onto its own roots and
// checks their contents there.
//
// Editing a header changes the final key of every compile that read it; adding
// or editing a file in an include root changes the include identity at the
// next start (a new file can shadow a system header without any recorded
// dependency changing).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace opjit::compiler {

struct CompileJob;

class IncludeRoots {
 public:
  // Bounds of the startup walk of one root: past them, the rest of the files
  // count by name and size only (the final key still holds the content of
  // every header a compile reads). Defaults: 20000 files, 256 MiB.
  struct Limits {
    size_t max_files = 20000;
    uint64_t max_content_bytes = 256ull << 20;
  };

  IncludeRoots() = default;
  // Roots in search order: the kernel include dir ("kernel") first, then the
  // extra include dirs ("extra1", "extra2", ...). An empty kernel dir is
  // skipped; a missing directory counts as empty. Reads every file once.
  static IncludeRoots Create(const std::string& kernel_dir,
                             const std::vector<std::string>& extra_dirs, Limits limits);
  static IncludeRoots Create(const std::string& kernel_dir,
                             const std::vector<std::string>& extra_dirs) {
    return Create(kernel_dir, extra_dirs, Limits());
  }

  // "kernel:opjit/kernel.h" for a path under a root (the longest matching
  // one), else `path` itself.
  std::string Portable(const std::string& path) const;
  // Back to a path on this host; "" for a label this daemon does not have.
  std::string Local(const std::string& portable) const;
  // Labels and tree digests of the roots, in order: part of the request key.
  const std::string& Identity() const { return identity_; }
  // Files hashed by content at startup, and files counted by name only.
  size_t files_hashed() const { return files_hashed_; }
  size_t files_listed_only() const { return files_listed_only_; }

 private:
  struct Root {
    std::string label;
    std::string dir;  // canonical, no trailing '/'
  };
  std::vector<Root> roots_;
  std::string identity_;
  size_t files_hashed_ = 0, files_listed_only_ = 0;
};

// The digest of what a job's source and `backend_identity` make, with the
// include identity: nothing in it names a host path.
std::string RequestKey(const CompileJob& job, const std::string& backend_identity,
                       const std::string& include_identity);

// The final content key: `request_key`, then (portable name, content SHA-256)
// of each dependency, in the order given.
std::string FinalKey(const std::string& request_key,
                     const std::vector<std::pair<std::string, std::string>>& deps);

}  // namespace opjit::compiler
