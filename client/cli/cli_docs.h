// Documents generated from the opjit CLI's own command table, so the man
// page and the bash completion cannot drift from the flags the parser takes.
// The build writes both (`opjit --man`, `opjit --bash-completion`).
#pragma once

#include <string>
#include <vector>

namespace opjit::cli {

// One flag of a command (or a global flag).
struct FlagDoc {
  std::string name;        // "--namespace"
  std::string value;       // "NS"; empty: a switch
  std::string help;        // one sentence
  std::string choices;     // space-separated values it takes ("cpu gpu"); empty: any
  bool file = false;       // the value is a path (completed as a file name)
  bool repeatable = false;
};

// One command.
struct CommandDoc {
  std::string name;        // "run"
  std::string positional;  // "OP"; empty: none
  std::string positional_help;
  std::string positional_choices;  // as FlagDoc::choices
  bool positional_file = false;
  std::string summary;     // one line
  std::string details;     // paragraphs shown after the flags ("" for none)
  std::vector<FlagDoc> flags;
};

struct ProgramDoc {
  std::string name;     // "opjit"
  std::string summary;  // one line, for NAME
  std::string version;  // "0.1.0 (b1ffefc)"
  std::vector<FlagDoc> globals;
  std::vector<CommandDoc> commands;
  std::string environment;  // paragraphs
  std::string exit_status;  // paragraphs
};

// A roff man page (section 1).
std::string ManPage(const ProgramDoc& doc);

// A man page for a program documented only by its --help text: the first
// lines that start with "usage:" (and their continuation) become the
// SYNOPSIS, an unindented line ending in ':' ("Exit status:") starts a
// section of that name, and the rest is kept as it is laid out (OPTIONS).
std::string ManPageFromHelp(const std::string& name, const std::string& summary,
                            const std::string& version, const std::string& help);

// A bash completion script: commands, each command's flags, the values of
// flags with choices, and file names where a path is expected.
std::string BashCompletion(const ProgramDoc& doc);

}  // namespace opjit::cli
