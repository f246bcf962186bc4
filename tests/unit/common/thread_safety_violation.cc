// Must NOT compile under -Wthread-safety -Werror=thread-safety: the
// thread_safety_check test (tests/unit/common/CMakeLists.txt) expects clang
// to refuse the unlocked read below, which shows the check is on.
#include "server/common/mutex.h"

struct Counter {
  opjit::Mutex mu;
  int count ABSL_GUARDED_BY(mu) = 0;
  int Read() { return count; }  // no lock: refused
};

int main() { return Counter().Read(); }
