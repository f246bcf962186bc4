// opjit_help2man NAME SUMMARY VERSION < HELP_TEXT > NAME.1
// A build tool: the man page of a program from its --help text (see
// ManPageFromHelp). Used for opjitd, whose flags are parsed in server/main.cc.
#include <iostream>
#include <iterator>
#include <string>

#include "client/cli/cli_docs.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: opjit_help2man NAME SUMMARY VERSION < HELP_TEXT\n";
    return 2;
  }
  const std::string help((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  if (help.empty()) {
    std::cerr << "opjit_help2man: no help text on stdin\n";
    return 1;
  }
  std::cout << opjit::cli::ManPageFromHelp(argv[1], argv[2], argv[3], help);
  return 0;
}
