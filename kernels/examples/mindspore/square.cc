// y = x * x (float32), and its backward dx = 2 * x * dout taking MindSpore's bprop
// arguments (x, out, dout). Both entries live in one file, so one compile serves
// both ops (MindSpore's tests build them as square.so and square_bprop.so; a
// .so name maps to this source: see opjit.mindspore.sources). Written for opjit
// in MindSpore's aot ABI.
#include <cstdint>
#include <cstring>

namespace {

int64_t Elems(int* ndims, int64_t** shapes, int i) {
  int64_t n = 1;
  for (int d = 0; d < ndims[i]; ++d) n *= shapes[i][d];
  return n;
}

bool AllF32(int nparam, const char** dtypes) {
  for (int i = 0; i < nparam; ++i) {
    if (std::strcmp(dtypes[i], "float32") != 0) return false;
  }
  return true;
}

}  // namespace

extern "C" int CustomSquare(int nparam, void** params, int* ndims, int64_t** shapes,
                            const char** dtypes, void* stream, void* extra) {
  (void)stream;
  (void)extra;
  if (nparam != 2) return 1;
  if (!AllF32(nparam, dtypes)) return 2;
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  const int64_t n = Elems(ndims, shapes, 1);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * x[i];
  return 0;
}

extern "C" int CustomSquareBprop(int nparam, void** params, int* ndims, int64_t** shapes,
                                 const char** dtypes, void* stream, void* extra) {
  (void)stream;
  (void)extra;
  if (nparam != 4) return 1;  // x, out, dout, dx
  if (!AllF32(nparam, dtypes)) return 2;
  const float* x = static_cast<const float*>(params[0]);
  const float* dout = static_cast<const float*>(params[2]);
  float* dx = static_cast<float*>(params[3]);
  const int64_t n = Elems(ndims, shapes, 3);
  for (int64_t i = 0; i < n; ++i) dx[i] = 2.0f * x[i] * dout[i];
  return 0;
}
