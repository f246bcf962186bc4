#include "server/compiler/elf_symbols.h"

#include <elf.h>

#include <algorithm>
#include <cstring>

namespace opjit::compiler {
namespace {

absl::Status Malformed(std::string_view what) {
  return absl::InvalidArgumentError(
      std::string("the compiled object is malformed (") + std::string(what) + ")");
}

// [off, off + n) lies inside a buffer of `size` bytes.
bool Inside(uint64_t off, uint64_t n, uint64_t size) { return off <= size && n <= size - off; }

template <typename T>
T Load(std::string_view buf, uint64_t off) {
  T v;
  std::memcpy(&v, buf.data() + off, sizeof v);
  return v;
}

void SortUnique(std::vector<std::string>* v) {
  std::sort(v->begin(), v->end());
  v->erase(std::unique(v->begin(), v->end()), v->end());
}

}  // namespace

bool ElfSymbols::Defines(std::string_view name) const {
  return std::binary_search(defined.begin(), defined.end(), name);
}

absl::StatusOr<ElfSymbols> ReadElfSymbols(std::string_view object) {
  const uint64_t size = object.size();
  if (size < sizeof(Elf64_Ehdr)) return Malformed("shorter than an ELF header");
  const auto eh = Load<Elf64_Ehdr>(object, 0);
  if (std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 || eh.e_ident[EI_CLASS] != ELFCLASS64 ||
      eh.e_ident[EI_DATA] != ELFDATA2LSB) {
    return Malformed("not a little-endian ELF64 file");
  }
  if (eh.e_type != ET_REL || eh.e_machine != EM_X86_64) {
    return Malformed("not an x86-64 relocatable object");
  }
  if (eh.e_shentsize != sizeof(Elf64_Shdr) || eh.e_shnum == 0 ||
      !Inside(eh.e_shoff, uint64_t{eh.e_shnum} * sizeof(Elf64_Shdr), size)) {
    return Malformed("section headers out of bounds");
  }
  auto section = [&](uint64_t i) { return Load<Elf64_Shdr>(object, eh.e_shoff + i * sizeof(Elf64_Shdr)); };
  ElfSymbols out;
  for (uint64_t i = 0; i < eh.e_shnum; ++i) {
    const Elf64_Shdr sh = section(i);
    if (sh.sh_type != SHT_SYMTAB) continue;
    if (sh.sh_entsize != sizeof(Elf64_Sym) || !Inside(sh.sh_offset, sh.sh_size, size) ||
        sh.sh_link >= eh.e_shnum) {
      return Malformed("symbol table out of bounds");
    }
    const Elf64_Shdr str = section(sh.sh_link);
    if (str.sh_type != SHT_STRTAB || !Inside(str.sh_offset, str.sh_size, size)) {
      return Malformed("string table out of bounds");
    }
    const std::string_view strtab = object.substr(str.sh_offset, str.sh_size);
    for (uint64_t off = 0; off + sizeof(Elf64_Sym) <= sh.sh_size; off += sizeof(Elf64_Sym)) {
      const auto sym = Load<Elf64_Sym>(object, sh.sh_offset + off);
      const unsigned bind = ELF64_ST_BIND(sym.st_info);
      const unsigned type = ELF64_ST_TYPE(sym.st_info);
      if (bind != STB_GLOBAL && bind != STB_WEAK) continue;
      if (sym.st_name >= strtab.size()) return Malformed("symbol name out of bounds");
      const size_t end = strtab.find('\0', sym.st_name);
      if (end == std::string_view::npos) return Malformed("unterminated symbol name");
      std::string name(strtab.substr(sym.st_name, end - sym.st_name));
      if (name.empty()) continue;
      if (sym.st_shndx == SHN_UNDEF) {
        if (bind == STB_GLOBAL) out.undefined.push_back(std::move(name));
        continue;
      }
      if (type != STT_FUNC && type != STT_OBJECT && type != STT_NOTYPE && type != STT_GNU_IFUNC &&
          type != STT_COMMON) {
        continue;
      }
      const bool hidden = ELF64_ST_VISIBILITY(sym.st_other) != STV_DEFAULT;
      if (hidden) continue;
      if (bind == STB_GLOBAL && (type == STT_FUNC || type == STT_OBJECT)) out.exported.push_back(name);
      out.defined.push_back(std::move(name));
    }
  }
  SortUnique(&out.defined);
  SortUnique(&out.exported);
  SortUnique(&out.undefined);
  // A symbol both used and defined (a weak definition elsewhere) is defined.
  out.undefined.erase(std::remove_if(out.undefined.begin(), out.undefined.end(),
                                     [&](const std::string& s) { return out.Defines(s); }),
                      out.undefined.end());
  return out;
}

}  // namespace opjit::compiler
