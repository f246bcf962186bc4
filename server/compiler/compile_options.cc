#include "server/compiler/compile_options.h"

#include <algorithm>


namespace opjit::compiler {
namespace {

constexpr size_t kMaxMacroLen = 128;

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

bool IsAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// [A-Za-z_][A-Za-z0-9_]{0,127}.
bool IsIdent(std::string_view s) {
  if (s.empty() || s.size() > kMaxMacroLen || !IsAlpha(s[0])) return false;
  return std::all_of(s.begin() + 1, s.end(), [](char c) { return IsAlpha(c) || IsDigit(c); });
}

// -D<macro>[=<value>] or -U<macro>.
bool IsMacroOption(std::string_view opt, std::string_view flag) {
  if (!StartsWith(opt, flag)) return false;
  std::string_view rest = opt.substr(flag.size());
  size_t eq = rest.find('=');
  std::string_view macro = rest.substr(0, eq);
  if (!IsIdent(macro)) return false;
  if (eq == std::string_view::npos) return true;
  if (flag == "-U") return false;
  for (char c : rest.substr(eq + 1)) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return false;
  }
  return true;
}

bool IsWarningOption(std::string_view opt) {
  if (opt == "-w") return true;
  if (!StartsWith(opt, "-W") || opt.size() == 2) return false;
  for (char c : opt.substr(2)) {
    if (!IsAlpha(c) && !IsDigit(c) && c != '-' && c != '=' && c != '+') return false;
  }
  return true;
}

bool IsBoolValued(std::string_view opt, std::string_view prefix) {
  if (!StartsWith(opt, prefix)) return false;
  std::string_view value = opt.substr(prefix.size());
  return value == "true" || value == "false";
}

bool IsGpuArch(std::string_view a) {
  std::string_view digits;
  if (StartsWith(a, "sm_")) {
    digits = a.substr(3);
  } else if (StartsWith(a, "compute_")) {
    digits = a.substr(8);
  } else {
    return false;
  }
  if (!digits.empty() && digits.back() == 'a') digits.remove_suffix(1);
  if (digits.size() < 2 || digits.size() > 3) return false;
  return std::all_of(digits.begin(), digits.end(), IsDigit);
}

bool IsPositiveInt(std::string_view s) {
  return !s.empty() && s.size() <= 4 && std::all_of(s.begin(), s.end(), IsDigit) && s[0] != '0';
}

// The -D and -U rule, the same for every language: "" when `opt` is neither.
std::string MacroRefusal(std::string_view opt, bool* matched) {
  *matched = true;
  if (StartsWith(opt, "-D")) {
    return IsMacroOption(opt, "-D") ? "" : "-D needs a C identifier, optionally =<value>";
  }
  if (StartsWith(opt, "-U")) {
    return IsMacroOption(opt, "-U") ? "" : "-U needs a C identifier";
  }
  *matched = false;
  return "";
}

}  // namespace

const std::vector<std::string>& CpuLanguages() {
  static const auto* langs = new std::vector<std::string>{"c++", "c"};
  return *langs;
}

const std::vector<std::string>& CudaLanguages() {
  static const auto* langs = new std::vector<std::string>{"cuda"};
  return *langs;
}

std::string CpuOptionRefusal(std::string_view language, std::string_view opt) {
  bool macro;
  std::string why = MacroRefusal(opt, &macro);
  if (macro) return why;
  if (opt == "-O0" || opt == "-O1" || opt == "-O2" || opt == "-O3" || opt == "-ffast-math" ||
      opt == "-fno-fast-math" || opt == "-fno-math-errno" || opt == "-fmath-errno") {
    return "";
  }
  if (StartsWith(opt, "-std=")) {
    if (language == "c++" && (opt == "-std=c++17" || opt == "-std=c++20")) return "";
    if (language == "c" && (opt == "-std=c11" || opt == "-std=c17")) return "";
    return language == "c" ? "allowed for c: -std=c11, -std=c17"
                           : "allowed for c++: -std=c++17, -std=c++20";
  }
  if (StartsWith(opt, "-ffp-contract=")) {
    const std::string_view v = opt.substr(14);
    return v == "off" || v == "on" || v == "fast" ? "" : "-ffp-contract= needs off, on or fast";
  }
  if (IsWarningOption(opt)) return "";
  return "not allowed for " + std::string(language);
}

std::string CudaOptionRefusal(std::string_view opt) {
  bool macro;
  std::string why = MacroRefusal(opt, &macro);
  if (macro) return why;
  if (opt == "-std=c++17" || opt == "-std=c++20" || opt == "--std=c++17" ||
      opt == "--std=c++20" || opt == "--use_fast_math" || opt == "-use_fast_math" ||
      opt == "-lineinfo" || opt == "--generate-line-info" ||
      opt == "--extra-device-vectorization" || opt == "--restrict" || opt == "-w" ||
      opt == "--disable-warnings") {
    return "";
  }
  if (StartsWith(opt, "-arch=")) {
    return IsGpuArch(opt.substr(6)) ? "" : "-arch= needs sm_NN or compute_NN";
  }
  if (StartsWith(opt, "--gpu-architecture=")) {
    return IsGpuArch(opt.substr(19)) ? "" : "--gpu-architecture= needs sm_NN or compute_NN";
  }
  for (std::string_view p : {"--ftz=", "--prec-div=", "--prec-sqrt=", "--fmad="}) {
    if (StartsWith(opt, p)) {
      return IsBoolValued(opt, p) ? "" : std::string(p) + " needs true or false";
    }
  }
  for (std::string_view p : {"--maxrregcount=", "-maxrregcount="}) {
    if (StartsWith(opt, p)) {
      return IsPositiveInt(opt.substr(p.size())) ? "" : std::string(p) + " needs a count";
    }
  }
  return "not allowed for cuda";
}

std::string CpuFpMode(const std::vector<std::string>& options) {
  // The driver's rule, in order: -ffast-math contracts across statements
  // (fast), -fno-fast-math goes back to the default, -ffp-contract= wins
  // where it comes later.
  std::string contract = "on";
  bool fast_math = false;
  for (const std::string& o : options) {
    if (o == "-ffast-math") {
      fast_math = true;
      contract = "fast";
    } else if (o == "-fno-fast-math") {
      fast_math = false;
      if (contract == "fast") contract = "on";
    } else if (StartsWith(o, "-ffp-contract=")) {
      contract = o.substr(14);
    }
  }
  return "fp-contract=" + contract + (fast_math ? ", fast-math" : ", no fast-math");
}

std::string CudaFpMode(const std::vector<std::string>& options) {
  // --use_fast_math implies --fmad=true, --ftz=true and approximate
  // division and square root; an explicit --fmad= wins where it comes later.
  std::string fmad = "true";
  bool fast_math = false;
  for (const std::string& o : options) {
    if (o == "--use_fast_math" || o == "-use_fast_math") {
      fast_math = true;
      fmad = "true";
    } else if (StartsWith(o, "--fmad=")) {
      fmad = o.substr(7);
    }
  }
  return "fmad=" + fmad + (fast_math ? ", use_fast_math" : ", no fast-math");
}

}  // namespace opjit::compiler
