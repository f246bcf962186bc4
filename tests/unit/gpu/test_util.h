// Helpers shared by the GPU tests.
#pragma once

#include <string>
#include <vector>

namespace opjit::gpu::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with the object.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct CommandResult {
  int exit_code = -1;  // -1 when it did not exit normally
  std::string output;  // stdout and stderr
};

// Runs argv (no shell) and waits for it.
CommandResult RunCommand(const std::vector<std::string>& argv);

void WriteFile(const std::string& path, const std::string& bytes);
std::string ReadFile(const std::string& path);

struct ElfSymbol {
  std::string name;
  bool defined = false;
  bool function = false;
};

// The dynamic symbol table (.dynsym) of an ELF64 little-endian image; empty
// when there is none or the image is malformed. Sets *type to e_type.
std::vector<ElfSymbol> DynamicSymbols(const std::string& elf, int* type = nullptr);

}  // namespace opjit::gpu::testing
