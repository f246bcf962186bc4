#include "tests/unit/gpu/test_util.h"

#include <elf.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

extern char** environ;

namespace opjit::gpu::testing {

TempDir::TempDir() {
  const char* t = std::getenv("TMPDIR");
  std::string tmpl =
      std::string(t != nullptr && *t != '\0' ? t : "/tmp") + "/opjit-gpu-test-XXXXXX";
  if (mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  if (!path_.empty()) std::filesystem::remove_all(path_, ec);
}

CommandResult RunCommand(const std::vector<std::string>& argv) {
  CommandResult r;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return r;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, cargv[0], &actions, nullptr, cargv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    r.output = std::string("spawn failed: ") + std::strerror(rc);
    return r;
  }
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof(buf))) > 0) r.output.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  return r;
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<ElfSymbol> DynamicSymbols(const std::string& elf, int* type) {
  std::vector<ElfSymbol> out;
  if (elf.size() < sizeof(Elf64_Ehdr) || std::memcmp(elf.data(), ELFMAG, SELFMAG) != 0 ||
      elf[EI_CLASS] != ELFCLASS64 || elf[EI_DATA] != ELFDATA2LSB) {
    return out;
  }
  Elf64_Ehdr eh;
  std::memcpy(&eh, elf.data(), sizeof(eh));
  if (type != nullptr) *type = eh.e_type;
  auto section = [&](size_t i, Elf64_Shdr* sh) {
    const uint64_t off = eh.e_shoff + i * uint64_t{eh.e_shentsize};
    if (eh.e_shentsize != sizeof(Elf64_Shdr) || off + sizeof(Elf64_Shdr) > elf.size()) return false;
    std::memcpy(sh, elf.data() + off, sizeof(*sh));
    return true;
  };
  for (size_t i = 0; i < eh.e_shnum; ++i) {
    Elf64_Shdr sh;
    if (!section(i, &sh) || sh.sh_type != SHT_DYNSYM) continue;
    Elf64_Shdr strtab;
    if (!section(sh.sh_link, &strtab)) return out;
    if (sh.sh_offset + sh.sh_size > elf.size() || strtab.sh_offset + strtab.sh_size > elf.size())
      return out;
    for (uint64_t off = 0; off + sizeof(Elf64_Sym) <= sh.sh_size; off += sizeof(Elf64_Sym)) {
      Elf64_Sym sym;
      std::memcpy(&sym, elf.data() + sh.sh_offset + off, sizeof(sym));
      if (sym.st_name >= strtab.sh_size) continue;
      const char* name = elf.data() + strtab.sh_offset + sym.st_name;
      const size_t max = strtab.sh_size - sym.st_name;
      ElfSymbol s;
      s.name.assign(name, strnlen(name, max));
      s.defined = sym.st_shndx != SHN_UNDEF;
      s.function = ELF64_ST_TYPE(sym.st_info) == STT_FUNC;
      out.push_back(std::move(s));
    }
  }
  return out;
}

}  // namespace opjit::gpu::testing
