// ProcessRunner's own files: the scratch directories of executors without
// namespaces live in a directory of the runner's own under
// host.scratch_dir, and starting or stopping a runner never touches
// anything else there (host.scratch_dir may be a shared directory such as
// /tmp: an earlier sweep of the whole directory emptied /tmp).
#include "server/runner/process_runner.h"

#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace opjit::runner {
namespace {

TEST(ProcessRunnerTest, StartAndStopLeaveOthersFilesInTheScratchDirectory) {
  char tmpl[] = "/tmp/opjit-prt-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::filesystem::create_directories(dir + "/someone/else");
  std::ofstream(dir + "/keep.txt") << "mine";
  std::ofstream(dir + "/someone/else/keep.bin") << "theirs";
  {
    ProcessRunnerOptions o;
    o.worker_path = OPJIT_BINARY_DIR "/bin/opjit-exec-worker";
    o.host.scratch_dir = dir;
    auto runner = ProcessRunner::Create(o);
    ASSERT_TRUE(runner.ok()) << runner.status();
  }
  EXPECT_TRUE(std::filesystem::exists(dir + "/keep.txt"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/someone/else/keep.bin"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace opjit::runner
