// Cache keys from content only (server/compiler/cache_key.h): the same
// headers at two install prefixes give the same keys; a changed header, a
// new file in an include root or another root order gives others.
#include "server/compiler/cache_key.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "server/compiler/kernel_compiler.h"
#include "tests/unit/cache/test_util.h"

namespace opjit::compiler {
namespace {

namespace fs = std::filesystem;
using cache::testing::TempDir;
using cache::testing::WriteFile;

// A copy of a small include tree under `root`: kernel.h, opjit/extra.h.
void MakeTree(const std::string& root, const std::string& scale = "2.0f") {
  fs::create_directories(root + "/opjit");
  WriteFile(root + "/kernel.h", "#pragma once\nconstexpr float kScale = " + scale + ";\n");
  WriteFile(root + "/opjit/extra.h", "#pragma once\n#include \"kernel.h\"\n");
}

CompileJob Job() {
  CompileJob job;
  job.source = "#include <opjit/extra.h>\nfloat F() { return kScale; }\n";
  job.file_name = "kernel.cc";
  job.options = {"-O2"};
  return job;
}

TEST(IncludeRootsTest, SameContentAtTwoPrefixesHasOneIdentity) {
  TempDir d;
  MakeTree(d.Sub("build/kernels/include"));
  MakeTree(d.Sub("usr/share/opjit/include"));
  fs::create_directories(d.Sub("a/torch"));
  fs::create_directories(d.Sub("b/torch"));
  WriteFile(d.Sub("a/torch/all.h"), "// torch\n");
  WriteFile(d.Sub("b/torch/all.h"), "// torch\n");
  auto a = IncludeRoots::Create(d.Sub("build/kernels/include"), {d.Sub("a")});
  auto b = IncludeRoots::Create(d.Sub("usr/share/opjit/include"), {d.Sub("b")});
  EXPECT_EQ(a.Identity(), b.Identity());
  EXPECT_EQ(a.files_hashed(), 3u);
  EXPECT_EQ(a.Identity().size(), 64u);
  EXPECT_EQ(a.Identity().find(d.path()), std::string::npos);

  // Portable names hold no prefix, and map back onto each daemon's roots.
  const std::string pa = a.Portable(d.Sub("build/kernels/include/opjit/extra.h"));
  const std::string pb = b.Portable(d.Sub("usr/share/opjit/include/opjit/extra.h"));
  EXPECT_EQ(pa, "kernel:opjit/extra.h");
  EXPECT_EQ(pa, pb);
  EXPECT_EQ(a.Portable(d.Sub("a/torch/all.h")), "extra1:torch/all.h");
  EXPECT_EQ(b.Local(pa), fs::canonical(d.Sub("usr/share/opjit/include")).string() +
                             "/opjit/extra.h");
  // Outside every root: the absolute path, unchanged both ways.
  EXPECT_EQ(a.Portable("/usr/include/stdio.h"), "/usr/include/stdio.h");
  EXPECT_EQ(b.Local("/usr/include/stdio.h"), "/usr/include/stdio.h");
  // A label this daemon lacks, or a name that climbs out of its root.
  EXPECT_EQ(b.Local("extra7:x.h"), "");
  EXPECT_EQ(b.Local("kernel:../../etc/passwd"), "");
  EXPECT_EQ(b.Local("kernel:"), "");
  EXPECT_EQ(b.Local("nolabel"), "");
  // A root's own path is not a file under it.
  EXPECT_EQ(a.Portable(fs::canonical(d.Sub("a")).string()),
            fs::canonical(d.Sub("a")).string());
}

TEST(IncludeRootsTest, InnermostRootNamesAFile) {
  TempDir d;
  MakeTree(d.Sub("inc"));
  auto r = IncludeRoots::Create(d.Sub("inc"), {d.Sub("inc/opjit")});
  EXPECT_EQ(r.Portable(fs::canonical(d.Sub("inc")).string() + "/opjit/extra.h"),
            "extra1:extra.h");
  EXPECT_EQ(r.Portable(fs::canonical(d.Sub("inc")).string() + "/kernel.h"), "kernel:kernel.h");
}

TEST(IncludeRootsTest, ContentNamesAndOrderChangeTheIdentity) {
  TempDir d;
  MakeTree(d.Sub("base"));
  MakeTree(d.Sub("edited"), "3.0f");
  MakeTree(d.Sub("added"));
  WriteFile(d.Sub("added/stdio.h"), "// shadows the system's\n");
  MakeTree(d.Sub("other"));
  fs::create_directories(d.Sub("x"));
  const std::string base = IncludeRoots::Create(d.Sub("base"), {}).Identity();
  EXPECT_EQ(base, IncludeRoots::Create(d.Sub("base"), {}).Identity());  // stable
  EXPECT_NE(base, IncludeRoots::Create(d.Sub("edited"), {}).Identity());
  EXPECT_NE(base, IncludeRoots::Create(d.Sub("added"), {}).Identity());
  // A file moved between roots, or the roots in another search order.
  EXPECT_NE(IncludeRoots::Create(d.Sub("base"), {d.Sub("x")}).Identity(),
            IncludeRoots::Create(d.Sub("x"), {d.Sub("base")}).Identity());
  EXPECT_NE(base, IncludeRoots::Create(d.Sub("base"), {d.Sub("x")}).Identity());
  // Renaming a file changes it too.
  fs::rename(d.Sub("other/kernel.h"), d.Sub("other/kernel2.h"));
  EXPECT_NE(base, IncludeRoots::Create(d.Sub("other"), {}).Identity());
  // A missing directory is an empty root, not an error.
  EXPECT_NE(base, IncludeRoots::Create(d.Sub("missing"), {}).Identity());
}

TEST(IncludeRootsTest, PastTheLimitsFilesCountByNameAndSize) {
  TempDir d;
  MakeTree(d.Sub("a"));
  MakeTree(d.Sub("b"), "3.0f");  // same size as a's: only the content differs
  IncludeRoots::Limits limits;
  limits.max_files = 1;
  auto a = IncludeRoots::Create(d.Sub("a"), {}, limits);
  EXPECT_EQ(a.files_hashed(), 1u);
  EXPECT_EQ(a.files_listed_only(), 1u);
  // kernel.h sorts first: it is hashed, so the edit still shows.
  EXPECT_NE(a.Identity(), IncludeRoots::Create(d.Sub("b"), {}, limits).Identity());
  limits.max_files = 0;
  EXPECT_EQ(IncludeRoots::Create(d.Sub("a"), {}, limits).Identity(),
            IncludeRoots::Create(d.Sub("b"), {}, limits).Identity());
}

TEST(CacheKeyTest, RequestKeyHoldsEveryInputButNoPath) {
  const std::string id = "clang=16; triple=x86_64";
  const std::string inc(64, 'a');
  const std::string key = RequestKey(Job(), id, inc);
  EXPECT_EQ(key.size(), 64u);
  EXPECT_EQ(key, RequestKey(Job(), id, inc));
  EXPECT_NE(key, RequestKey(Job(), id + "x", inc));
  EXPECT_NE(key, RequestKey(Job(), id, std::string(64, 'b')));
  CompileJob j = Job();
  j.source += " ";
  EXPECT_NE(key, RequestKey(j, id, inc));
  j = Job();
  j.options = {"-O3"};
  EXPECT_NE(key, RequestKey(j, id, inc));
  j = Job();
  j.libraries = {"m"};
  EXPECT_NE(key, RequestKey(j, id, inc));
  j = Job();
  j.language = "c";
  EXPECT_NE(key, RequestKey(j, id, inc));
  j = Job();
  j.target = registry::Target::kGpu;
  EXPECT_NE(key, RequestKey(j, id, inc));
  // What logs call it is not part of it.
  j = Job();
  j.label = "ns/op";
  EXPECT_EQ(key, RequestKey(j, id, inc));
}

TEST(CacheKeyTest, FinalKeyFollowsNamesAndContentsInAnyOrder) {
  const std::string rk(64, 'r');
  const std::string d1(64, '1'), d2(64, '2');
  const std::vector<std::pair<std::string, std::string>> deps = {
      {"kernel:opjit/kernel.h", d1}, {"/usr/include/stdio.h", d2}};
  const std::string key = FinalKey(rk, deps);
  // Sorted inside: local paths sort differently on another host.
  EXPECT_EQ(key, FinalKey(rk, {deps[1], deps[0]}));
  EXPECT_NE(key, FinalKey(rk, {{"kernel:opjit/kernel.h", d2}, {"/usr/include/stdio.h", d2}}));
  EXPECT_NE(key, FinalKey(rk, {{"extra1:opjit/kernel.h", d1}, {"/usr/include/stdio.h", d2}}));
  EXPECT_NE(key, FinalKey(rk, {deps[0]}));
  EXPECT_NE(key, FinalKey(std::string(64, 's'), deps));
}

}  // namespace
}  // namespace opjit::compiler
