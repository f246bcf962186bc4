#include "server/common/paths.h"

#include <unistd.h>

#include <cstdlib>

namespace opjit {

std::string DefaultStateDir() {
  if (const char* s = std::getenv("OPJIT_STATE_DIR"); s != nullptr && *s) return s;
  if (const char* h = std::getenv("HOME"); h != nullptr && *h) return std::string(h) + "/.opjit";
  return "/tmp/opjit-" + std::to_string(getuid());
}

std::string DefaultSocketAddress(const std::string& state_dir) {
  return "unix:" + state_dir + "/opjitd.sock";
}

std::string DefaultServerAddress() {
  if (const char* s = std::getenv("OPJIT_SERVER"); s != nullptr && *s) return s;
  return DefaultSocketAddress(DefaultStateDir());
}

}  // namespace opjit
