// Launch-spec expressions (grid, block, shared memory, argument bindings of
// GPU ops): validation against names, then evaluation against shapes and
// attrs. Invariants: refusals are input errors; what validates evaluates
// without crashing; a resolved launch has every dimension >= 1.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <string>
#include <vector>

#include "server/gpu/launch_spec.h"
#include "tests/fuzz/fuzz_util.h"

using opjit::fuzz::IsInputError;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  opjit::gpu::LaunchEnv env;
  env.input_names = {"x", "w"};
  env.output_names = {"y"};
  const int rank = in.ConsumeIntegralInRange<int>(0, 4);
  std::vector<int64_t> shape;
  for (int i = 0; i < rank; ++i) shape.push_back(in.ConsumeIntegral<int64_t>());
  env.input_shapes = {shape, {in.ConsumeIntegralInRange<int64_t>(0, 1 << 20)}};
  env.output_shapes = {shape};
  env.attrs = {{"n", static_cast<double>(in.ConsumeIntegral<int32_t>())},
               {"alpha", in.ConsumeFloatingPoint<double>()}};
  env.float_attrs = {"alpha"};

  opjit::gpu::LaunchSpec spec;
  spec.kernel = "k";
  const int fields = in.ConsumeIntegralInRange<int>(1, 8);
  for (int i = 0; i < fields; ++i) {
    std::string e = in.ConsumeRandomLengthString(4096);
    switch (i % 4) {
      case 0: spec.grid.push_back(e); break;
      case 1: spec.block.push_back(e); break;
      case 2: spec.shared_mem = e; break;
      case 3: spec.args.push_back(e); break;
    }
  }
  const std::string tail = in.ConsumeRemainingBytesAsString();

  auto direct = opjit::gpu::EvalExpr(tail, env);
  FUZZ_CHECK(direct.ok() || IsInputError(direct.status()));

  absl::Status valid =
      opjit::gpu::ValidateLaunchSpec(spec, env.input_names, env.output_names, {"n", "alpha"});
  FUZZ_CHECK(valid.ok() || IsInputError(valid));
  if (!valid.ok()) return 0;
  auto config = opjit::gpu::Resolve(spec, env);
  if (config.ok()) {
    for (int d = 0; d < 3; ++d) {
      FUZZ_CHECK(config->grid[d] >= 1);
      FUZZ_CHECK(config->block[d] >= 1);
    }
  } else {
    FUZZ_CHECK(IsInputError(config.status()));
  }
  auto args = opjit::gpu::ResolveArgs(spec, env);
  FUZZ_CHECK(args.ok() || IsInputError(args.status()));
  return 0;
}
