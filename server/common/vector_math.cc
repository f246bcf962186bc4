#include "server/common/vector_math.h"

#include <dlfcn.h>

#include "server/common/logging.h"

namespace opjit {

bool LoadVectorMath() {
#if defined(__x86_64__)
  static const bool loaded = [] {
    if (dlopen("libmvec.so.1", RTLD_NOW | RTLD_GLOBAL) != nullptr) return true;
    const char* err = dlerror();
    Logger("loader")->warn("libmvec.so.1 could not be loaded ({}): kernels whose math loops "
                           "vectorized will not link",
                           err != nullptr ? err : "unknown error");
    return false;
  }();
  return loaded;
#else
  return false;
#endif
}

}  // namespace opjit
