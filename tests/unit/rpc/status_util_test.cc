#include "server/rpc/status_util.h"

#include <gtest/gtest.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "opjit/v1/error.pb.h"
#include "server/common/error_info.h"

namespace opjit::rpc {
namespace {

constexpr char kErrorInfoType[] = "type.googleapis.com/google.rpc.ErrorInfo";
constexpr char kDiagnosticsType[] = "type.googleapis.com/opjit.v1.CompileDiagnostics";

// What the status takes in HTTP/2 headers: grpc-message percent-encoded,
// grpc-status-details-bin base64-encoded, plus both names.
size_t HeaderBytes(const grpc::Status& s) {
  const size_t details = s.error_details().size();
  return GrpcMessageWireSize(s.error_message()) + (details + 2) / 3 * 4 +
         sizeof("grpc-message") + sizeof("grpc-status-details-bin");
}

v1::Status Rich(const grpc::Status& s) {
  v1::Status rich;
  EXPECT_TRUE(rich.ParseFromString(s.error_details()));
  return rich;
}

bool Diagnostics(const grpc::Status& s, v1::CompileDiagnostics* out) {
  const v1::Status rich = Rich(s);
  for (const auto& any : rich.details()) {
    if (any.type_url() == kDiagnosticsType) return out->ParseFromString(any.value());
  }
  return false;
}

v1::ErrorInfo Info(const grpc::Status& s) {
  v1::ErrorInfo info;
  const v1::Status rich = Rich(s);
  for (const auto& any : rich.details()) {
    if (any.type_url() == kErrorInfoType) EXPECT_TRUE(info.ParseFromString(any.value()));
  }
  return info;
}

// Clang's output for `n` diagnostics, each with its source line and caret.
std::string ClangOutput(int n) {
  std::string out = "op \"default/big\" CPU implementation: compile failed:\n";
  for (int i = 0; i < n; ++i) {
    absl::StrAppend(&out, "kernel.cc:", i + 2, ":19: error: use of undeclared identifier 'u", i,
                    "'\nint f() { return u", i, "; }\n                  ^\n");
  }
  absl::StrAppend(&out, n, " errors generated.\n");
  return out;
}

void ExpectBounded(const grpc::Status& s) {
  EXPECT_LE(GrpcMessageWireSize(s.error_message()), kMaxStatusMessageBytes);
  EXPECT_LE(s.error_details().size(), kMaxStatusDetailsBytes);
  // Well under gRPC clients' default 8 KiB of metadata.
  EXPECT_LT(HeaderBytes(s), 6 * 1024);
  EXPECT_EQ(Rich(s).message(), s.error_message());
}

TEST(ToGrpcStatusTest, OkIsOk) { EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok()); }

TEST(ToGrpcStatusTest, SmallErrorsPassUnchanged) {
  const absl::Status in = WithReason(absl::NotFoundError("op \"default/nope\" not found"),
                                     reason::kOpNotFound, {{"op", "nope"}});
  const grpc::Status s = ToGrpcStatus(in);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), "op \"default/nope\" not found");
  EXPECT_EQ(ReasonOf(s), "OP_NOT_FOUND");
  EXPECT_EQ(Info(s).metadata().at("op"), "nope");
  ExpectBounded(s);
}

TEST(ToGrpcStatusTest, AHugeMessageKeepsItsStartAndCountsTheRest) {
  const std::string id(100000, 'c');
  const grpc::Status s = ToGrpcStatus(WithReason(
      absl::FailedPreconditionError(absl::StrCat("no backward context \"", id, "\"")),
      reason::kContextNotFound));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(ReasonOf(s), "CONTEXT_NOT_FOUND");
  EXPECT_TRUE(absl::StartsWith(s.error_message(), "no backward context \"ccc"));
  EXPECT_TRUE(absl::EndsWith(s.error_message(), " KiB) not shown")) << s.error_message();
  EXPECT_GT(s.error_message().size(), kMaxStatusMessageBytes / 2);
  ExpectBounded(s);
}

TEST(ToGrpcStatusTest, MessagesAreBoundedAsEncodedNotAsBytes) {
  // Newlines and non-ASCII cost three bytes each in grpc-message.
  std::string text;
  for (int i = 0; i < 20000; ++i) text += (i % 2) ? "\n" : "\xE2\x82\xAC";
  const grpc::Status s = ToGrpcStatus(absl::InvalidArgumentError(text));
  ExpectBounded(s);
  EXPECT_EQ(ReasonOf(s), "INVALID_ARGUMENT");
  // Never cut inside the 3-byte character.
  const std::string& m = s.error_message();
  const std::string kept = m.substr(0, m.find("\n..."));
  for (size_t i = 0; i < kept.size();) {
    if (kept[i] == '\n') {
      ++i;
      continue;
    }
    ASSERT_EQ(kept.substr(i, 3), "\xE2\x82\xAC") << "at " << i;
    i += 3;
  }
}

TEST(ToGrpcStatusTest, ManyCompileErrorsKeepTheFirstDiagnosticsAndCountTheRest) {
  const std::string output = ClangOutput(300);
  ASSERT_GT(output.size(), 20000u);
  const grpc::Status s =
      ToGrpcStatus(WithReason(absl::InvalidArgumentError(output), reason::kCompileFailed));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(ReasonOf(s), "COMPILE_FAILED");
  ExpectBounded(s);

  // The message: the first lines whole, then how many diagnostics are left.
  const std::string& m = s.error_message();
  EXPECT_TRUE(absl::StartsWith(m, "op \"default/big\" CPU implementation: compile failed:\n"
                                  "kernel.cc:2:19: error: use of undeclared identifier 'u0'\n"));
  const size_t marker = m.find("\n... and ");
  ASSERT_NE(marker, std::string::npos) << m;
  const size_t shown = ParseDiagnostics(m.substr(0, marker)).size();
  EXPECT_GE(shown, 3u);
  EXPECT_TRUE(absl::EndsWith(m, absl::StrCat("... and ", 300 - shown, " more diagnostics (") +
                                    m.substr(m.rfind('(') + 1)));
  EXPECT_TRUE(absl::EndsWith(m, " KiB) not shown")) << m;

  // The details: the first diagnostics in order and whole, and the count of the rest.
  v1::CompileDiagnostics diags;
  ASSERT_TRUE(Diagnostics(s, &diags));
  ASSERT_GE(diags.diagnostics_size(), 10);
  for (int i = 0; i < diags.diagnostics_size(); ++i) {
    const v1::Diagnostic& d = diags.diagnostics(i);
    EXPECT_EQ(d.file(), "kernel.cc");
    EXPECT_EQ(d.line(), i + 2);
    EXPECT_EQ(d.column(), 19);
    EXPECT_EQ(d.severity(), "error");
    EXPECT_EQ(d.text(), absl::StrCat("use of undeclared identifier 'u", i, "'"));
  }
  EXPECT_EQ(diags.omitted_diagnostics(), 300 - diags.diagnostics_size());
}

TEST(ToGrpcStatusTest, AFewCompileErrorsComeWhole) {
  const std::string output = ClangOutput(3);
  const grpc::Status s =
      ToGrpcStatus(WithReason(absl::InvalidArgumentError(output), reason::kCompileFailed));
  EXPECT_EQ(s.error_message(), output);
  v1::CompileDiagnostics diags;
  ASSERT_TRUE(Diagnostics(s, &diags));
  EXPECT_EQ(diags.diagnostics_size(), 3);
  EXPECT_EQ(diags.omitted_diagnostics(), 0);
}

TEST(ToGrpcStatusTest, OneHugeDiagnosticIsCut) {
  const std::string output =
      absl::StrCat("compile failed:\n", std::string(5000, 'f'), ".cc:1:2: error: ",
                   std::string(100000, 't'), "\n");
  const grpc::Status s =
      ToGrpcStatus(WithReason(absl::InvalidArgumentError(output), reason::kCompileFailed));
  ExpectBounded(s);
  v1::CompileDiagnostics diags;
  ASSERT_TRUE(Diagnostics(s, &diags));
  ASSERT_EQ(diags.diagnostics_size(), 1);
  EXPECT_LT(diags.diagnostics(0).file().size(), 200u);
  EXPECT_LT(diags.diagnostics(0).text().size(), 600u);
  EXPECT_TRUE(absl::EndsWith(diags.diagnostics(0).text(), "...(100000 bytes)"));
  EXPECT_EQ(diags.omitted_diagnostics(), 0);
}

TEST(ToGrpcStatusTest, HugeReasonMetadataIsCut) {
  const absl::Status in =
      WithReason(absl::ResourceExhaustedError("quota"), reason::kQuotaExceeded,
                 {{"namespace", std::string(100000, 'n')}, {"quota", "max_ops"}});
  const grpc::Status s = ToGrpcStatus(in);
  ExpectBounded(s);
  const v1::ErrorInfo info = Info(s);
  EXPECT_EQ(info.reason(), "QUOTA_EXCEEDED");
  EXPECT_LT(info.metadata().at("namespace").size(), 200u);
  EXPECT_EQ(info.metadata().at("quota"), "max_ops");
}

TEST(ParseDiagnosticsTest, CountsPastItsLimit) {
  const std::string output = ClangOutput(300);
  size_t total = 0;
  const auto first = ParseDiagnostics(output, 5, &total);
  EXPECT_EQ(first.size(), 5u);
  EXPECT_EQ(total, 300u);
  EXPECT_EQ(first[4].line, 6);
  EXPECT_EQ(ParseDiagnostics(output).size(), 300u);
  EXPECT_EQ(ParseDiagnostics("a.cc:1:2: fatal error: 'x.h' file not found")[0].severity,
            "fatal error");
}

TEST(BoundStatusMessageTest, CutsAtALineEndAndNamesWhatIsLeft) {
  std::string text;
  for (int i = 0; i < 100; ++i) absl::StrAppend(&text, "line ", i, " of some output\n");
  const std::string m = BoundStatusMessage(text, 512, false);
  EXPECT_LE(GrpcMessageWireSize(m), 512u);
  const std::string kept = m.substr(0, m.find("\n... ("));
  EXPECT_TRUE(absl::EndsWith(kept, " of some output")) << kept;
  EXPECT_TRUE(absl::EndsWith(m, "KiB) not shown")) << m;
  EXPECT_EQ(BoundStatusMessage("short", 512, false), "short");
}

}  // namespace
}  // namespace opjit::rpc
