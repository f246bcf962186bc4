// Op-spec JSON -> OpDef -> validation -> canonical form, as a registration
// travels: the client's JSON spec (protobuf's JSON mapping of opjit.v1.OpDef),
// the server's conversion and ValidateOpDef, and the store's canonical JSON.
// Invariants: every refusal is an input error; a valid definition's canonical
// form parses back to the same text and hash; the store's parser never
// accepts text it then cannot re-emit identically.
#include <google/protobuf/util/json_util.h>

#include <cstdint>
#include <string>

#include "opjit/v1/op.pb.h"
#include "server/registry/canonical.h"
#include "server/registry/validate.h"
#include "server/rpc/convert.h"
#include "tests/fuzz/fuzz_util.h"

using opjit::fuzz::IsInputError;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (1 << 16)) return 0;
  const std::string text(reinterpret_cast<const char*>(data), size);

  opjit::v1::OpDef proto;
  google::protobuf::util::JsonParseOptions opts;
  opts.ignore_unknown_fields = false;
  if (google::protobuf::util::JsonStringToMessage(text, &proto, opts).ok()) {
    auto def = opjit::rpc::OpDefFromProto(proto);
    if (!def.ok()) {
      FUZZ_CHECK(IsInputError(def.status()));
    } else {
      absl::Status valid = opjit::registry::ValidateOpDef(*def);
      FUZZ_CHECK(valid.ok() || IsInputError(valid));
      if (valid.ok()) {
        const std::string canon = opjit::registry::ToJson(*def);
        auto back = opjit::registry::FromJson(canon);
        FUZZ_CHECK(back.ok());
        FUZZ_CHECK(opjit::registry::ToJson(*back) == canon);
        FUZZ_CHECK(opjit::registry::ContentHash(*back) == opjit::registry::ContentHash(*def));
        FUZZ_CHECK(opjit::registry::ValidateOpDef(*back).ok());
        opjit::v1::OpDef again;
        opjit::rpc::OpDefToProto(*back, &again);
        auto def2 = opjit::rpc::OpDefFromProto(again);
        FUZZ_CHECK(def2.ok());
        FUZZ_CHECK(opjit::registry::ToJson(*def2) == canon);
      }
    }
  }

  // The store's own parser, on arbitrary text.
  auto stored = opjit::registry::FromJson(text);
  if (stored.ok()) {
    const std::string canon = opjit::registry::ToJson(*stored);
    auto back = opjit::registry::FromJson(canon);
    FUZZ_CHECK(back.ok());
    FUZZ_CHECK(opjit::registry::ToJson(*back) == canon);
  } else {
    FUZZ_CHECK(IsInputError(stored.status()));
  }
  return 0;
}
