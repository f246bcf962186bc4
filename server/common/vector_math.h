// glibc's vector math library (libmvec): kernels compiled with
// -fveclib=libmvec call its _ZGV* functions where their math loops
// vectorized, so whoever checks or loads a kernel object resolves them from
// the process, as it does the rest of libm.
#pragma once

namespace opjit {

// Loads libmvec.so.1 into the process once, RTLD_GLOBAL, so that
// dlsym(RTLD_DEFAULT, "_ZGVdN8v_expf") finds it. True when it is loaded;
// false (logged once, as a warning) where there is none (not x86-64, or
// no glibc vector math). Thread-safe.
bool LoadVectorMath();

}  // namespace opjit
