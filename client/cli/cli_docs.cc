#include "client/cli/cli_docs.h"

#include <algorithm>
#include <cctype>
#include <sstream>

namespace opjit::cli {
namespace {

// Escapes text for roff: backslashes, dashes (as \-, so they stay ASCII
// minus signs), and a leading '.' or '\'' that would start a request.
std::string Roff(const std::string& text) {
  std::string out;
  bool line_start = true;
  for (char c : text) {
    if (line_start && (c == '.' || c == '\'')) out += "\\&";
    if (c == '\\') {
      out += "\\e";
    } else if (c == '-') {
      out += "\\-";
    } else {
      out += c;
    }
    line_start = c == '\n';
  }
  return out;
}

// Paragraphs (separated by blank lines) as roff paragraphs; lines that start
// with two spaces are kept as they are (examples, lists).
std::string RoffParagraphs(const std::string& text) {
  std::ostringstream out;
  std::istringstream in(text);
  std::string line;
  bool verbatim = false;
  while (std::getline(in, line)) {
    if (line.empty()) {
      if (verbatim) out << ".fi\n";
      verbatim = false;
      out << ".PP\n";
      continue;
    }
    const bool literal = line.rfind("  ", 0) == 0;
    if (literal && !verbatim) out << ".nf\n";
    if (!literal && verbatim) out << ".fi\n";
    verbatim = literal;
    out << Roff(line) << "\n";
  }
  if (verbatim) out << ".fi\n";
  return out.str();
}

void RoffFlags(std::ostringstream& out, const std::vector<FlagDoc>& flags) {
  for (const auto& f : flags) {
    out << ".TP\n\\fB" << Roff(f.name) << "\\fR";
    if (!f.value.empty()) out << " \\fI" << Roff(f.value) << "\\fR";
    out << "\n" << Roff(f.help);
    if (f.repeatable) out << " Repeatable.";
    out << "\n";
  }
}

std::string Usage(const CommandDoc& c) {
  std::string u = c.name;
  if (!c.flags.empty()) u += " [OPTIONS]";
  if (!c.positional.empty()) u += " " + c.positional;
  return u;
}

// Words for bash: the flags of `flags`, space-separated.
std::string FlagWords(const std::vector<FlagDoc>& flags) {
  std::string out;
  for (const auto& f : flags) out += (out.empty() ? "" : " ") + f.name;
  return out;
}

}  // namespace

std::string ManPage(const ProgramDoc& doc) {
  std::ostringstream out;
  out << ".\\\" Generated from the " << doc.name << " command table; do not edit.\n";
  out << ".TH " << Roff(doc.name == "opjit" ? "OPJIT" : doc.name) << " 1 \"\" \"" << doc.name << " "
      << Roff(doc.version) << "\" \"User Commands\"\n";
  out << ".SH NAME\n" << Roff(doc.name) << " \\- " << Roff(doc.summary) << "\n";
  out << ".SH SYNOPSIS\n\\fB" << Roff(doc.name) << "\\fR";
  for (const auto& g : doc.globals) {
    out << " [\\fB" << Roff(g.name) << "\\fR" << (g.value.empty() ? "" : " \\fI" + Roff(g.value) + "\\fR")
        << "]";
  }
  out << " \\fICOMMAND\\fR [\\fIARGS\\fR]\n";
  out << ".SH DESCRIPTION\n" << Roff(doc.summary) << ". \\fB" << Roff(doc.name)
      << " \\fICOMMAND\\fB \\-\\-help\\fR prints a command's own flags.\n";
  out << ".SH GLOBAL OPTIONS\nGiven before the command (\\fB\\-\\-json\\fR also after it).\n";
  RoffFlags(out, doc.globals);
  out << ".SH COMMANDS\n";
  for (const auto& c : doc.commands) {
    out << ".SS \"" << Roff(Usage(c)) << "\"\n" << Roff(c.summary) << ".\n";
    if (!c.positional.empty()) {
      out << ".TP\n\\fI" << Roff(c.positional) << "\\fR\n" << Roff(c.positional_help) << "\n";
    }
    RoffFlags(out, c.flags);
    if (!c.details.empty()) out << ".PP\n" << RoffParagraphs(c.details);
  }
  if (!doc.environment.empty()) out << ".SH ENVIRONMENT\n" << RoffParagraphs(doc.environment);
  if (!doc.exit_status.empty()) out << ".SH EXIT STATUS\n" << RoffParagraphs(doc.exit_status);
  out << ".SH SEE ALSO\n\\fBopjitd\\fR(1)\n";
  return out.str();
}

std::string ManPageFromHelp(const std::string& name, const std::string& summary,
                            const std::string& version, const std::string& help) {
  std::ostringstream out;
  out << ".\\\" Generated from `" << name << " --help`; do not edit.\n";
  std::string upper;
  for (char c : name) upper += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  out << ".TH " << Roff(upper) << " 1 \"\" \"" << Roff(name + " " + version)
      << "\" \"User Commands\"\n";
  out << ".SH NAME\n" << Roff(name) << " \\- " << Roff(summary) << "\n";
  std::istringstream in(help);
  std::string line;
  // SYNOPSIS: "usage: ..." (any case) and its indented continuation lines;
  // DESCRIPTION: unindented text up to the first section; OPTIONS: indented
  // text before any "Title:" line; then one section per "Title:".
  enum { kStart, kUsage, kDescription, kBody } state = kStart;
  bool open = false;  // inside .nf
  auto section = [&](const std::string& title, bool verbatim) {
    if (open) out << ".fi\n";
    out << ".SH " << Roff(title) << "\n";
    if (verbatim) out << ".nf\n";
    open = verbatim;
  };
  auto lower = [](std::string t) {
    for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return t;
  };
  while (std::getline(in, line)) {
    const bool indented = !line.empty() && line[0] == ' ';
    if (state == kStart && lower(line).rfind("usage:", 0) == 0) {
      section("SYNOPSIS", true);
      state = kUsage;
      const size_t at = line.find_first_not_of(' ', 6);
      out << Roff(at == std::string::npos ? "" : line.substr(at)) << "\n";
      continue;
    }
    if (state == kUsage && indented) {
      out << Roff(line.substr(std::min(line.find_first_not_of(' '), size_t{7}))) << "\n";
      continue;
    }
    if (!line.empty() && !indented && line.back() == ':') {
      std::string title = line.substr(0, line.size() - 1);
      for (char& c : title) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      section(title, true);
      state = kBody;
      continue;
    }
    if (state == kUsage || state == kStart) {
      if (line.empty()) continue;
      if (indented) {
        section("OPTIONS", true);
        state = kBody;
      } else {
        section("DESCRIPTION", false);
        state = kDescription;
      }
    }
    if (state == kDescription) {
      if (line.empty()) {
        out << ".PP\n";
        continue;
      }
      if (indented) {
        section("OPTIONS", true);
        state = kBody;
      }
    }
    out << Roff(line) << "\n";
  }
  if (open) out << ".fi\n";
  out << ".SH SEE ALSO\n\\fBopjit\\fR(1)\n";
  return out.str();
}

std::string BashCompletion(const ProgramDoc& doc) {
  const std::string fn = "_" + doc.name;
  std::ostringstream out;
  out << "# bash completion for " << doc.name << "; generated from its command table (`"
      << doc.name << " --bash-completion`), do not edit.\n";
  out << fn << "() {\n";
  out << "  local cur=\"${COMP_WORDS[COMP_CWORD]}\" prev=\"\"\n";
  out << "  [ \"$COMP_CWORD\" -gt 0 ] && prev=\"${COMP_WORDS[COMP_CWORD-1]}\"\n";
  std::string commands;
  for (const auto& c : doc.commands) commands += (commands.empty() ? "" : " ") + c.name;
  out << "  local commands=\"" << commands << "\"\n";
  // The command: the first word that is not a global flag or its value.
  std::string global_value_flags;
  for (const auto& g : doc.globals) {
    if (!g.value.empty()) global_value_flags += (global_value_flags.empty() ? "" : "|") + g.name;
  }
  out << "  local cmd=\"\" i=1\n";
  out << "  while [ \"$i\" -lt \"$COMP_CWORD\" ]; do\n";
  out << "    case \"${COMP_WORDS[i]}\" in\n";
  if (!global_value_flags.empty()) out << "      " << global_value_flags << ") i=$((i + 1)) ;;\n";
  out << "      -*) ;;\n";
  out << "      *) cmd=\"${COMP_WORDS[i]}\"; break ;;\n";
  out << "    esac\n    i=$((i + 1))\n  done\n";
  // A flag's value.
  out << "  case \"$prev\" in\n";
  auto value_cases = [&out](const std::vector<FlagDoc>& flags, const std::string& indent) {
    for (const auto& f : flags) {
      if (f.value.empty()) continue;
      out << indent << f.name << ") ";
      if (!f.choices.empty()) {
        out << "COMPREPLY=($(compgen -W \"" << f.choices << "\" -- \"$cur\")); return ;;\n";
      } else if (f.file) {
        out << "COMPREPLY=($(compgen -f -- \"$cur\")); compopt -o filenames 2>/dev/null; return ;;\n";
      } else {
        out << "COMPREPLY=(); return ;;\n";
      }
    }
  };
  value_cases(doc.globals, "    ");
  out << "  esac\n";
  out << "  case \"$cmd\" in\n";
  for (const auto& c : doc.commands) {
    out << "    " << c.name << ")\n";
    out << "      case \"$prev\" in\n";
    value_cases(c.flags, "        ");
    out << "      esac\n";
    out << "      if [[ \"$cur\" == -* ]]; then\n";
    out << "        COMPREPLY=($(compgen -W \"" << FlagWords(c.flags) << " --help\" -- \"$cur\"))\n";
    if (!c.positional_choices.empty()) {
      out << "      else\n        COMPREPLY=($(compgen -W \"" << c.positional_choices
          << "\" -- \"$cur\"))\n";
    } else if (c.positional_file) {
      out << "      else\n        COMPREPLY=($(compgen -f -- \"$cur\")); compopt -o filenames 2>/dev/null\n";
    }
    out << "      fi\n      return ;;\n";
  }
  out << "  esac\n";
  out << "  if [[ \"$cur\" == -* ]]; then\n";
  out << "    COMPREPLY=($(compgen -W \"" << FlagWords(doc.globals) << " --help\" -- \"$cur\"))\n";
  out << "  else\n    COMPREPLY=($(compgen -W \"$commands\" -- \"$cur\"))\n  fi\n";
  out << "}\n";
  out << "complete -F " << fn << " " << doc.name << "\n";
  return out.str();
}

}  // namespace opjit::cli
