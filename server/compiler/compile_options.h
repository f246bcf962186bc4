// The compile-option allow-lists: the one place they are written. Each
// compile backend answers with its own (CompileBackend::OptionRefusal), the
// registry asks through registry::TargetRules (validate.h), and the CPU
// compiler and its worker check every request against the same rule again.
//
//   CPU (c++ and c):
//     -D<macro>[=<value>]  -U<macro>   (<macro> a C identifier, at most 128)
//     -O0 -O1 -O2 -O3  -ffast-math -fno-fast-math  -fno-math-errno -fmath-errno
//     -std=c++17 -std=c++20 (c++)      -std=c11 -std=c17 (c)
//     -ffp-contract=off -ffp-contract=on -ffp-contract=fast
//     -w  -W<warning>                  (<warning> of [A-Za-z0-9_=+-]: no -Wl, -Wa, -Wp)
//   GPU (cuda, NVRTC spellings):
//     -D<macro>[=<value>]  -U<macro>
//     -std=c++17 -std=c++20 (also --std=)  --use_fast_math (also -use_fast_math)
//     -arch=<a> --gpu-architecture=<a> (<a>: sm_NN, sm_NNa, compute_NN, compute_NNa)
//     --ftz= --prec-div= --prec-sqrt= --fmad= (each =true or =false)
//     -lineinfo --generate-line-info  --maxrregcount=<N> (also -maxrregcount=)
//     --extra-device-vectorization --restrict -w --disable-warnings
//   A -D value holds no control characters.
//
// Plain functions of their arguments (thread-safe), with no dependency
// beyond the standard library, so the sandboxed compile worker links them too.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace opjit::compiler {

// The languages of the CPU backend ({"c++", "c"}) and of the GPU backend
// ({"cuda"}), in the order messages list them.
const std::vector<std::string>& CpuLanguages();
const std::vector<std::string>& CudaLanguages();

// "" when `option` is allowed for a CPU compile of `language` ("c++" or "c");
// otherwise why not ("allowed for c: -std=c11, -std=c17", "not allowed for c++").
std::string CpuOptionRefusal(std::string_view language, std::string_view option);

// "" when `option` is allowed for a CUDA compile (NVRTC or nvcc); otherwise
// why not ("not allowed for cuda").
std::string CudaOptionRefusal(std::string_view option);

// The floating-point mode a compile with `options` (allowed ones) gets, as
// Verify reports it. CPU: the JIT compiles at -O3 -march=native, where
// clang's default is fp-contract=on (a*b+c in one expression may become one
// FMA); -ffast-math makes it fast, -ffp-contract= sets it:
// "fp-contract=on, no fast-math". CUDA (NVRTC and nvcc): "fmad=true, no
// fast-math" by default; --fmad=false, --use_fast_math change it.
std::string CpuFpMode(const std::vector<std::string>& options);
std::string CudaFpMode(const std::vector<std::string>& options);

}  // namespace opjit::compiler
