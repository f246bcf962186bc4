// scale_add: y = 2 * x + 1, elementwise, float32 and float64 (MindSpore's aot
// ABI: params are x, then y). A reference, a correct candidate, wrong ones and
// cheats, for opjit.verify (tests/python/test_verify.py; see README.md here).
// Each entry is registered as an op of its own.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

int64_t Count(int ndim, const int64_t* shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

// body(x, y, n) with x and y typed by the first input's dtype; 2 for another dtype.
template <typename Body>
int Typed(void** params, int* ndims, int64_t** shapes, const char** dtypes, Body body) {
  const int64_t n = Count(ndims[0], shapes[0]);
  if (std::strcmp(dtypes[0], "float32") == 0) {
    body(static_cast<const float*>(params[0]), static_cast<float*>(params[1]), n);
    return 0;
  }
  if (std::strcmp(dtypes[0], "float64") == 0) {
    body(static_cast<const double*>(params[0]), static_cast<double*>(params[1]), n);
    return 0;
  }
  return 2;
}

template <typename T>
void Correct(const T* x, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = 2 * x[i] + 1;
}

const auto kCorrect = [](auto x, auto y, int64_t n) { Correct(x, y, n); };

// The bytes of y (n elements of the first input's dtype).
size_t OutputBytes(int* ndims, int64_t** shapes, const char** dtypes) {
  const size_t size = std::strcmp(dtypes[0], "float64") == 0 ? 8 : 4;
  return size * static_cast<size_t>(Count(ndims[0], shapes[0]));
}

}  // namespace

#define ENTRY(name)                                                                     \
  extern "C" int name([[maybe_unused]] int nparam, [[maybe_unused]] void** params,       \
                      [[maybe_unused]] int* ndims, [[maybe_unused]] int64_t** shapes,       \
                      [[maybe_unused]] const char** dtypes, [[maybe_unused]] void* stream,  \
                      [[maybe_unused]] void* extra)

// ---- correct -------------------------------------------------------------------------

// The reference, written another way: x + x is exactly 2 * x, so the bits agree.
ENTRY(ScaleAddRef) {
  return Typed(params, ndims, shapes, dtypes, [](auto x, auto y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] + x[i]) + 1;
  });
}

ENTRY(ScaleAdd) { return Typed(params, ndims, shapes, dtypes, kCorrect); }

// ---- wrong ---------------------------------------------------------------------------

// Every finite nonzero result 3 units in the last place toward zero.
ENTRY(ScaleAddUlp3) {
  return Typed(params, ndims, shapes, dtypes, [](auto x, auto y, int64_t n) {
    Correct(x, y, n);
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(y[i])) continue;
      for (int k = 0; k < 3; ++k) y[i] = std::nextafter(y[i], decltype(y[i] + 0)(0));
    }
  });
}

// Off by one: the loop stops before the last element.
ENTRY(ScaleAddOffByOne) {
  return Typed(params, ndims, shapes, dtypes, [](auto x, auto y, int64_t n) {
    for (int64_t i = 0; i + 1 < n; ++i) y[i] = 2 * x[i] + 1;
  });
}

// "Sanitizes" its input: the comparison x == x is false for NaN, which becomes 0.
ENTRY(ScaleAddNanToZero) {
  return Typed(params, ndims, shapes, dtypes, [](auto x, auto y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] == x[i] ? 2 * x[i] + 1 : 0;
  });
}

// Right on every size but 1031 (a prime), where it computes 2 * x.
ENTRY(ScaleAddWrongAt1031) {
  return Typed(params, ndims, shapes, dtypes, [](auto x, auto y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = 2 * x[i] + (n == 1031 ? 0 : 1);
  });
}

// Right, and writes its input too (x becomes 0): an in-place op.
ENTRY(ScaleAddClobber) {
  return Typed(params, ndims, shapes, dtypes, [](auto x, auto y, int64_t n) {
    Correct(x, y, n);
    auto* w = const_cast<decltype(y)>(x);
    for (int64_t i = 0; i < n; ++i) w[i] = 0;
  });
}

// Every other call, the last bit of every result flipped: not deterministic.
ENTRY(ScaleAddFlaky) {
  static int64_t calls = 0;
  const bool flip = calls++ % 2 == 1;
  return Typed(params, ndims, shapes, dtypes, [flip](auto x, auto y, int64_t n) {
    Correct(x, y, n);
    if (!flip) return;
    for (int64_t i = 0; i < n; ++i) {
      if (std::isfinite(y[i])) y[i] = std::nextafter(y[i], decltype(y[i] + 0)(0));
    }
  });
}

// Two inputs (x, b): y = 2 * x + 1 + b. A reference with another arity.
ENTRY(ScaleAddBias) {
  const int64_t n = Count(ndims[0], shapes[0]);
  if (std::strcmp(dtypes[0], "float32") != 0) return 2;
  const float* x = static_cast<const float*>(params[0]);
  const float* b = static_cast<const float*>(params[1]);
  float* y = static_cast<float*>(params[2]);
  for (int64_t i = 0; i < n; ++i) y[i] = 2 * x[i] + 1 + b[i];
  return 0;
}

// ---- cheats --------------------------------------------------------------------------

// Writes nothing: y keeps whatever the buffer held.
ENTRY(CheatWritesNothing) { return 0; }

// Writes the previous call's output (when it had this size), then keeps this call's.
ENTRY(CheatStale) {
  static std::vector<unsigned char> previous;
  const size_t bytes = OutputBytes(ndims, shapes, dtypes);
  std::vector<unsigned char> now(bytes);
  void* y = params[1];
  params[1] = now.data();
  const int rc = Typed(params, ndims, shapes, dtypes, kCorrect);
  params[1] = y;
  std::memcpy(y, previous.size() == bytes ? previous.data() : now.data(), bytes);
  previous.swap(now);
  return rc;
}

// Computes once per size, then copies the cached result whatever the input.
ENTRY(CheatCached) {
  static std::vector<unsigned char> cache;
  static bool filled = false;
  const size_t bytes = OutputBytes(ndims, shapes, dtypes);
  if (filled && cache.size() == bytes) {
    std::memcpy(params[1], cache.data(), bytes);
    return 0;
  }
  const int rc = Typed(params, ndims, shapes, dtypes, kCorrect);
  const auto* y = static_cast<const unsigned char*>(params[1]);
  cache.assign(y, y + bytes);
  filled = true;
  return rc;
}

// Returns at once; a detached thread writes y about 5 ms later. Where the
// thread cannot start, it returns 0 having written nothing.
ENTRY(CheatLateWrite) {
  const int64_t n = Count(ndims[0], shapes[0]);
  const bool f64 = std::strcmp(dtypes[0], "float64") == 0;
  const void* x = params[0];
  void* y = params[1];
  try {
    std::thread([=] {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      if (f64) {
        Correct(static_cast<const double*>(x), static_cast<double*>(y), n);
      } else {
        Correct(static_cast<const float*>(x), static_cast<float*>(y), n);
      }
    }).detach();
  } catch (...) {
  }
  return 0;
}

// Right only on the shape a tester picks (1024 elements); 2 * x elsewhere.
ENTRY(CheatTestShape) {
  return Typed(params, ndims, shapes, dtypes, [](auto x, auto y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = 2 * x[i] + (n == 1024 ? 1 : 0);
  });
}

// Right for its first 4 calls, 2 * x after.
ENTRY(CheatFirstCalls) {
  static int64_t calls = 0;
  const bool right = calls++ < 4;
  return Typed(params, ndims, shapes, dtypes, [right](auto x, auto y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = 2 * x[i] + (right ? 1 : 0);
  });
}
