#include "server/compiler/cpu/preamble.h"

#include <map>
#include <string>
#include <string_view>

#include "gtest/gtest.h"

namespace opjit::compiler {
namespace {

TEST(PreambleTest, LeadingIncludesCommentsAndBlankLines) {
  const std::string src =
      "// Copyright\n/* a block\n   comment */\n#include <cmath>\n\n#  include \"x.h\" // why\n"
      "extern \"C\" int F();\n#include <vector>\n";
  Preamble p = ComputePreamble(src);
  EXPECT_TRUE(p.has_include);
  EXPECT_EQ(p.directives, "#include <cmath>\n#  include \"x.h\"\n");
  EXPECT_EQ(src.substr(p.bytes, 10), "extern \"C\"") << "ends at the first declaration";
}

TEST(PreambleTest, ConditionalsCloseBeforeItEnds) {
  // extern "C" { inside an #ifdef: the preamble stops before the #ifdef.
  const std::string src =
      "#include <stdint.h>\n#ifdef __cplusplus\nextern \"C\" {\n#endif\nint x;\n";
  Preamble p = ComputePreamble(src);
  EXPECT_EQ(p.directives, "#include <stdint.h>\n");
  EXPECT_EQ(p.bytes, std::string("#include <stdint.h>\n").size());
  // A balanced conditional stays in.
  const std::string balanced = "#ifndef N\n#define N 4\n#endif\n#include <cmath>\nint y;\n";
  p = ComputePreamble(balanced);
  EXPECT_EQ(p.directives, "#ifndef N\n#define N 4\n#endif\n#include <cmath>\n");
  EXPECT_EQ(balanced.substr(p.bytes), "int y;\n");
}

TEST(PreambleTest, OtherDirectivesEndIt) {
  for (const char* stop : {"#pragma once\n", "#line 10\n", "#error no\n", "#include_next <a.h>\n",
                           "%:include <cmath>\n"}) {
    const std::string src = std::string("#include <cmath>\n") + stop + "#include <vector>\n";
    Preamble p = ComputePreamble(src);
    EXPECT_EQ(p.directives, "#include <cmath>\n") << stop;
  }
}

TEST(PreambleTest, ContinuationsAndMultiLineComments) {
  const std::string src = "#define TWO \\\n  2\n#include /* inline */ <cmath>\nint z;";
  Preamble p = ComputePreamble(src);
  EXPECT_EQ(p.directives, "#define TWO   2\n#include   <cmath>\n");
  EXPECT_EQ(src.substr(p.bytes), "int z;");
  // An unterminated comment or literal ends the preamble where it starts.
  EXPECT_EQ(ComputePreamble("#include <cmath>\n/* open\nint q;").directives, "#include <cmath>\n");
  EXPECT_EQ(ComputePreamble("#include <cmath>\n#define S \"open\n").directives,
            "#include <cmath>\n");
  // Comment markers inside a string are not comments.
  EXPECT_EQ(ComputePreamble("#define P \"a//b\" /* c */\n").directives, "#define P \"a//b\"\n");
}

TEST(PreambleTest, NoPreamble) {
  EXPECT_EQ(ComputePreamble("int x;\n#include <cmath>\n").bytes, 0u);
  EXPECT_FALSE(ComputePreamble("").has_include);
  Preamble defines_only = ComputePreamble("#define A 1\nint a = A;\n");
  EXPECT_FALSE(defines_only.has_include);
  EXPECT_EQ(defines_only.directives, "#define A 1\n");
  // A whole file of directives is all preamble.
  EXPECT_EQ(ComputePreamble("#include <cmath>").bytes, 16u);
}

TEST(PreambleTest, BlankingKeepsLines) {
  const std::string src = "#include <cmath>\n// c\nint x;\n";
  Preamble p = ComputePreamble(src);
  std::string blank = BlankPreamble(src, p.bytes);
  EXPECT_EQ(blank, std::string(16, ' ') + "\n    \nint x;\n");
  EXPECT_EQ(BlankPreamble("ab", 99), "  ");
}

// A toolchain profile's prefix PCH (<torch/extension.h> alone) serves a
// unit only when loading it first compiles the unit as written.
TEST(PreambleTest, StartsWithIncludeReadsThroughExtraFilesAndGuards) {
  const std::map<std::string, std::string> files = {
      {"ms_ext.h", "// decls\n#ifndef MS_EXT_H\n#define MS_EXT_H\n#include <vector>\n"
                   "#include <torch/extension.h>\nint f();\n#endif\n"},
      {"once.h", "#pragma once\n#include <torch/extension.h>\n"},
      {"empty.h", "#pragma once\n#include <cstdint>\n"},
      {"defines.h", "#pragma once\n#define NDEBUG 1\n#include <torch/extension.h>\n"},
      {"algorithm", "#define X 1\n"},
  };
  auto file = [&](std::string_view name) -> const std::string* {
    auto it = files.find(std::string(name));
    return it == files.end() ? nullptr : &it->second;
  };
  const std::string h = "torch/extension.h";
  // The guide's leaky_relu.cpp and ms_ext.cpp.
  EXPECT_TRUE(StartsWithInclude(
      "#include <string.h>\n#include <torch/extension.h> // the header part\n"
      "#include \"ms_ext.h\"\nextern \"C\" int F();\n",
      h, file));
  EXPECT_TRUE(StartsWithInclude("/* x */\n#include \"ms_ext.h\"\n#include <string>\n", h, file));
  EXPECT_TRUE(StartsWithInclude("#include \"once.h\"\n", h, file));
  EXPECT_TRUE(StartsWithInclude("#include \"empty.h\"\n#include \"torch/extension.h\"\n", h, file));
  // What could change the header's meaning comes first: no.
  EXPECT_FALSE(StartsWithInclude("#define NDEBUG\n#include <torch/extension.h>\n", h, file));
  EXPECT_FALSE(StartsWithInclude("#include \"defines.h\"\n", h, file));
  EXPECT_FALSE(StartsWithInclude("#include <algorithm>\n#include <torch/extension.h>\n", h, file))
      << "an extra file named algorithm is searched first";
  EXPECT_FALSE(StartsWithInclude("#include \"other.h\"\n#include <torch/extension.h>\n", h, file));
  EXPECT_FALSE(StartsWithInclude("int x;\n#include <torch/extension.h>\n", h, file));
  EXPECT_FALSE(StartsWithInclude("#if 1\n#include <torch/extension.h>\n#endif\n", h, file));
  EXPECT_FALSE(StartsWithInclude("#ifndef G\n#define G 2\n#include <torch/extension.h>\n", h,
                                 file));
  EXPECT_FALSE(StartsWithInclude("#include <cmath>\n", h, file)) << "never reaches it";
  EXPECT_FALSE(StartsWithInclude("#include \"empty.h\"\n", h, file));
  // A file that includes itself does not loop.
  const std::map<std::string, std::string> loop = {{"a.h", "#include \"a.h\"\n"}};
  EXPECT_FALSE(StartsWithInclude("#include \"a.h\"\n", h, [&](std::string_view n) {
    auto it = loop.find(std::string(n));
    return it == loop.end() ? nullptr : &it->second;
  }));
}

}  // namespace
}  // namespace opjit::compiler
