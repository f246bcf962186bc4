#include "client/cpp/npy.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace opjit::client {
namespace {

const std::vector<std::string> kDtypes = {"float16", "float32", "float64", "int8",
                                          "int16",   "int32",   "int64",   "uint8",
                                          "uint16",  "uint32",  "uint64",  "bool"};

NpyArray MakeArray(const std::string& dtype, std::vector<int64_t> shape, uint32_t seed = 1) {
  NpyArray a;
  a.dtype = dtype;
  a.shape = std::move(shape);
  uint64_t n = *NpyDtypeSize(dtype);
  for (int64_t d : a.shape) n *= static_cast<uint64_t>(d);
  std::mt19937 rng(seed);
  a.data.resize(n);
  for (char& c : a.data) c = static_cast<char>(dtype == "bool" ? rng() % 2 : rng());
  return a;
}

// Builds a .npy file by hand around `header` (the dict text, unpadded).
std::string RawNpy(const std::string& header, const std::string& data, int major = 1) {
  std::string out = "\x93NUMPY";
  out.push_back(static_cast<char>(major));
  out.push_back(0);
  const uint32_t len = static_cast<uint32_t>(header.size());
  for (int i = 0; i < (major == 1 ? 2 : 4); ++i) out.push_back(static_cast<char>(len >> (8 * i)));
  return out + header + data;
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "opjit-npy-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data()) != nullptr ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void ExpectInvalid(std::string_view bytes, const std::string& needle) {
  auto parsed = ParseNpy(bytes);
  ASSERT_FALSE(parsed.ok()) << "accepted; wanted an error containing: " << needle;
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << parsed.status();
  EXPECT_NE(parsed.status().message().find(needle), std::string::npos)
      << parsed.status() << "\nwanted: " << needle;
}

TEST(NpyTest, RoundTripsEveryDtypeAndShape) {
  const std::vector<std::vector<int64_t>> shapes = {{}, {0}, {3}, {2, 3, 4}};
  for (const std::string& dtype : kDtypes) {
    for (const auto& shape : shapes) {
      NpyArray a = MakeArray(dtype, shape);
      std::string bytes = SerializeNpy(a);
      ASSERT_FALSE(bytes.empty());
      EXPECT_EQ(bytes[6], 1);  // Version 1.0.
      const size_t header_len =
          static_cast<unsigned char>(bytes[8]) | (static_cast<unsigned char>(bytes[9]) << 8);
      EXPECT_EQ((10 + header_len) % 64, 0u) << dtype;
      EXPECT_EQ(bytes[10 + header_len - 1], '\n');
      auto back = ParseNpy(bytes);
      ASSERT_TRUE(back.ok()) << dtype << ": " << back.status();
      EXPECT_EQ(back->dtype, dtype);
      EXPECT_EQ(back->shape, shape);
      EXPECT_EQ(back->data, a.data);
    }
  }
}

TEST(NpyTest, WritesNumPyStyleHeaders) {
  std::string bytes = SerializeNpy(MakeArray("float32", {3}));
  EXPECT_NE(bytes.find("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }"),
            std::string::npos);
  bytes = SerializeNpy(MakeArray("bool", {}));
  EXPECT_NE(bytes.find("{'descr': '|b1', 'fortran_order': False, 'shape': (), }"),
            std::string::npos);
  bytes = SerializeNpy(MakeArray("uint8", {2, 3}));
  EXPECT_NE(bytes.find("'shape': (2, 3), }"), std::string::npos);
}

TEST(NpyTest, ParsesHeaderVariants) {
  const std::string f4(12, '\0');
  for (const std::string& header : {
           std::string("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }   \n"),
           std::string("{'descr':'<f4','fortran_order':False,'shape':(3,)}"),
           std::string(
               "{ \"shape\" : ( 3 , ) , \"descr\" : \"<f4\" , \"fortran_order\" : False }\n"),
           std::string("{'descr': '=f4', 'fortran_order': False, 'shape': (3L,), }\n"),
           std::string("{'descr': 'f4', 'fortran_order': False, 'shape': (3,)}\n"),
           std::string("\t{'descr': '<f4', 'fortran_order': False, 'shape': [3][0:0] or (3,)}"),
       }) {
    auto parsed = ParseNpy(RawNpy(header, f4));
    if (header.find("[0:0]") != std::string::npos) {  // Not a literal: refused.
      EXPECT_FALSE(parsed.ok());
      continue;
    }
    ASSERT_TRUE(parsed.ok()) << header << ": " << parsed.status();
    EXPECT_EQ(parsed->dtype, "float32");
    EXPECT_EQ(parsed->shape, std::vector<int64_t>{3});
  }
  auto scalar = ParseNpy(RawNpy("{'descr': '|u1', 'fortran_order': False, 'shape': ()}", "x"));
  ASSERT_TRUE(scalar.ok()) << scalar.status();
  EXPECT_TRUE(scalar->shape.empty());
  EXPECT_EQ(scalar->data, "x");
  for (const char* descr : {"|i1", "<i1", "=i1", ">i1", "i1"}) {
    auto i1 = ParseNpy(RawNpy(
        std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (2,)}", "ab"));
    ASSERT_TRUE(i1.ok()) << descr << ": " << i1.status();
    EXPECT_EQ(i1->dtype, "int8");
  }
  // Versions 2.0 and 3.0 have a 4-byte header length.
  for (int major : {2, 3}) {
    auto v = ParseNpy(RawNpy("{'descr': '<i8', 'fortran_order': False, 'shape': (1, 1)}",
                             std::string(8, '\1'), major));
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->dtype, "int64");
    EXPECT_EQ(v->shape, (std::vector<int64_t>{1, 1}));
  }
}

TEST(NpyTest, RefusesWhatItCannotRepresent) {
  auto header = [](const std::string& descr, const std::string& rest = "'shape': (2,)") {
    return "{'descr': " + descr + ", 'fortran_order': False, " + rest + "}";
  };
  ExpectInvalid(RawNpy(header("'>f4'"), std::string(8, '\0')),
                "big-endian arrays are not supported; use arr.astype('<f4')");
  ExpectInvalid(RawNpy(header("'>u2'"), std::string(4, '\0')), "arr.astype('<u2')");
  ExpectInvalid(
      RawNpy("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2)}", std::string(16, '\0')),
      "Fortran-ordered arrays are not supported; save np.ascontiguousarray(a)");
  ExpectInvalid(RawNpy(header("'|O'"), std::string(16, '\0')), "object arrays");
  ExpectInvalid(RawNpy(header("'<U3'"), std::string(24, '\0')), "unicode");
  ExpectInvalid(RawNpy(header("'|S3'"), std::string(6, '\0')), "byte string");
  ExpectInvalid(RawNpy(header("'<c8'"), std::string(16, '\0')), "complex");
  ExpectInvalid(RawNpy(header("'<M8[ns]'"), std::string(16, '\0')), "datetime");
  ExpectInvalid(RawNpy(header("[('a', '<f4'), ('b', '<i4')]"), std::string(16, '\0')),
                "structured dtypes");
  ExpectInvalid(RawNpy(header("'|V8'"), std::string(16, '\0')), "structured or void");
  ExpectInvalid(RawNpy(header("'<f3'"), std::string(6, '\0')), "unsupported dtype '<f3'");
  ExpectInvalid(RawNpy(header("'<f16'"), std::string(32, '\0')), "unsupported dtype");
  ExpectInvalid(RawNpy(header("'<fx4'"), std::string(8, '\0')), "unsupported dtype");
  ExpectInvalid(RawNpy(header("'<f04'"), std::string(8, '\0')), "unsupported dtype");
}

TEST(NpyTest, RefusesMalformedFiles) {
  const std::string good = SerializeNpy(MakeArray("float32", {2, 3}));
  ExpectInvalid("", "not a .npy file");
  ExpectInvalid("\x93NUMPZ\x01\x00", "not a .npy file");
  std::string v4 = good;
  v4[6] = 4;
  ExpectInvalid(v4, "unsupported .npy format version 4.0");
  ExpectInvalid(good.substr(0, 9), "truncated inside its preamble");
  ExpectInvalid(good.substr(0, 40), "truncated: header of");
  ExpectInvalid(good.substr(0, good.size() - 1),
                ".npy data truncated: float32 (2, 3) needs 24 bytes, but only 23");
  ExpectInvalid(good + "xx", "2 unexpected bytes after");

  const std::string d = "'descr': '<f4'";
  const std::string f = "'fortran_order': False";
  const std::string s = "'shape': (1,)";
  const std::string four(4, '\0');
  ExpectInvalid(RawNpy("{" + d + ", " + f + "}", four), "needs the keys");
  ExpectInvalid(RawNpy("{" + d + ", " + f + ", " + s + ", 'extra': 1}", four), "unexpected key");
  ExpectInvalid(RawNpy("{" + d + ", " + d + ", " + f + ", " + s + "}", four), "duplicate key");
  ExpectInvalid(RawNpy("{" + d + ", " + f + ", 'shape': (-1,)}", four), "non-negative");
  ExpectInvalid(RawNpy("{" + d + ", " + f + ", 'shape': (1)}", four), "'shape' is not a tuple");
  ExpectInvalid(RawNpy("{" + d + ", " + f + ", 'shape': (1.5,)}", four), "malformed");
  ExpectInvalid(RawNpy("{" + d + ", 'fortran_order': 0, " + s + "}", four), "True or False");
  ExpectInvalid(RawNpy("{'descr': 4, " + f + ", " + s + "}", four), "not a string");
  ExpectInvalid(RawNpy("[1, 2]", four), "not a dictionary");
  ExpectInvalid(RawNpy("{" + d + ", " + f + ", " + s, four), "malformed .npy header");
  ExpectInvalid(RawNpy("{" + d + ", " + f + ", " + s + "} junk", four), "after the dictionary");
  ExpectInvalid(RawNpy("{'descr: '<f4'}", four), "malformed .npy header");
  ExpectInvalid(RawNpy("{" + d + ", " + f + ", 'shape': (99999999999999999999,)}", four),
                "integer too large");
  ExpectInvalid(RawNpy("{" + d + ", " + f + ", 'shape': (4611686018427387904, 4)}", four),
                "too large");
  ExpectInvalid(RawNpy(std::string(10000, '(') + "1" + std::string(10000, ')'), four),
                "nesting too deep");
  std::string ones;
  for (int i = 0; i < 65; ++i) ones += "1, ";
  ExpectInvalid(RawNpy("{" + d + ", " + f + ", 'shape': (" + ones + ")}", four),
                "rank 65 is over the maximum of 64");
}

TEST(NpyTest, SurvivesCorruption) {
  const std::string good = SerializeNpy(MakeArray("int16", {5, 7}));
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_FALSE(ParseNpy(good.substr(0, n)).ok()) << n;
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 5000; ++i) {
    std::string bad = good;
    for (int k = 0; k < 3; ++k) bad[rng() % 128] = static_cast<char>(rng());
    (void)ParseNpy(bad);  // Any answer but a crash.
  }
}

TEST(NpyTest, ValidateAndSerializeRejectInvalidArrays) {
  EXPECT_TRUE(ValidateNpyArray(MakeArray("int32", {2})).ok());
  NpyArray bad = MakeArray("int32", {2});
  bad.data.pop_back();
  EXPECT_EQ(ValidateNpyArray(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SerializeNpy(bad), "");
  EXPECT_EQ(ValidateNpyArray(NpyArray{.dtype = "complex64", .shape = {}, .data = ""}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateNpyArray(NpyArray{.dtype = "int8", .shape = {-1}, .data = ""}).code(),
            absl::StatusCode::kInvalidArgument);
  TempDir dir;
  EXPECT_EQ(WriteNpy(dir.path() + "/x.npy", bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/x.npy"));
}

TEST(NpyTest, FileErrorsCarryOsCodes) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  auto missing = ReadNpy(dir.path() + "/missing.npy");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("missing.npy"), std::string::npos);
  EXPECT_EQ(WriteNpy(dir.path() + "/no/such/dir/x.npy", MakeArray("int8", {1})).code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(ReadNpy(dir.path()).ok());  // A directory.
  const std::string path = dir.path() + "/a.npy";
  ASSERT_TRUE(WriteNpy(path, MakeArray("uint16", {4, 4})).ok());
  auto back = ReadNpy(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->data, MakeArray("uint16", {4, 4}).data);
  std::ofstream(dir.path() + "/junk.npy") << "hello";
  auto junk = ReadNpy(dir.path() + "/junk.npy");
  EXPECT_EQ(junk.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(junk.status().message().find("junk.npy: not a .npy file"), std::string::npos);
}

// ---- Interoperability with real NumPy. ----

constexpr char kPython[] = "/usr/bin/python3";

// Runs `script` with /usr/bin/python3 (argv[1] = dir); returns its exit code.
int RunPython(const std::string& dir, const std::string& script) {
  const std::string path = dir + "/script.py";
  std::ofstream(path) << script;
  const std::string cmd =
      std::string(kPython) + " " + path + " " + dir + " >" + dir + "/python.log 2>&1";
  int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class NumpyInteropTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    if (::access(kPython, X_OK) != 0) GTEST_SKIP() << kPython << " is not installed";
    if (RunPython(dir_.path(), "import numpy\n") != 0) {
      GTEST_SKIP() << kPython << " cannot import numpy (install python3-numpy)";
    }
  }
  TempDir dir_;
};

TEST_F(NumpyInteropTest, ReadsFilesNumPyWrote) {
  const std::string script = R"PY(
import sys, numpy as np
d = sys.argv[1]
rng = np.random.default_rng(3)
names = ['float16', 'float32', 'float64', 'int8', 'int16', 'int32', 'int64',
         'uint8', 'uint16', 'uint32', 'uint64', 'bool']
for name in names:
    for tag, shape in [('s', ()), ('e', (0,)), ('v', (3,)), ('t', (2, 3, 4))]:
        if name == 'bool':
            a = rng.integers(0, 2, size=shape).astype(bool)
        elif name.startswith('float'):
            a = (rng.standard_normal(size=shape) * 100).astype(name)
        else:
            info = np.iinfo(name)
            a = rng.integers(info.min, info.max, size=shape, dtype=name, endpoint=True)
        np.save(f'{d}/{name}_{tag}.npy', a)
        open(f'{d}/{name}_{tag}.bin', 'wb').write(a.tobytes())
a = np.arange(24, dtype='<i4').reshape(2, 3, 4)
for v in [(2, 0), (3, 0)]:
    with open(f'{d}/v{v[0]}.npy', 'wb') as f:
        np.lib.format.write_array(f, a, version=v)
np.save(f'{d}/noncontig.npy', a[:, ::2, :])  # np.save makes it C order.
open(f'{d}/noncontig.bin', 'wb').write(np.ascontiguousarray(a[:, ::2, :]).tobytes())
np.save(f'{d}/fortran.npy', np.asfortranarray(np.ones((3, 4), dtype='<f4')))
np.save(f'{d}/object.npy', np.array([1, 'x', None], dtype=object), allow_pickle=True)
np.save(f'{d}/bigendian.npy', np.arange(5, dtype='>f4'))
np.save(f'{d}/unicode.npy', np.array(['ab', 'c']))
np.save(f'{d}/complex.npy', np.ones(2, dtype=np.complex64))
np.save(f'{d}/structured.npy', np.zeros(2, dtype=[('a', '<f4'), ('b', '<i8')]))
)PY";
  ASSERT_EQ(RunPython(dir_.path(), script), 0) << ReadFile(dir_.path() + "/python.log");
  const std::string& d = dir_.path();
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"s", {}}, {"e", {0}}, {"v", {3}}, {"t", {2, 3, 4}}};
  for (const std::string& dtype : kDtypes) {
    for (const auto& [tag, shape] : shapes) {
      const std::string base = d + "/" + dtype + "_" + tag;
      auto a = ReadNpy(base + ".npy");
      ASSERT_TRUE(a.ok()) << base << ": " << a.status();
      EXPECT_EQ(a->dtype, dtype) << base;
      EXPECT_EQ(a->shape, shape) << base;
      EXPECT_EQ(a->data, ReadFile(base + ".bin")) << base;
    }
  }
  for (const char* v : {"v2", "v3"}) {
    auto a = ReadNpy(d + "/" + std::string(v) + ".npy");
    ASSERT_TRUE(a.ok()) << v << ": " << a.status();
    EXPECT_EQ(a->dtype, "int32");
    EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3, 4}));
    ASSERT_EQ(a->data.size(), 96u);
    int32_t last;
    std::memcpy(&last, a->data.data() + 92, 4);
    EXPECT_EQ(last, 23);
  }
  auto nc = ReadNpy(d + "/noncontig.npy");
  ASSERT_TRUE(nc.ok()) << nc.status();
  EXPECT_EQ(nc->data, ReadFile(d + "/noncontig.bin"));

  const std::vector<std::pair<std::string, std::string>> refused = {
      {"fortran", "Fortran-ordered arrays are not supported; save np.ascontiguousarray(a)"},
      {"object", "object arrays"},
      {"bigendian", "big-endian arrays are not supported; use arr.astype('<f4')"},
      {"unicode", "unicode"},
      {"complex", "complex"},
      {"structured", "structured dtypes"},
  };
  for (const auto& [name, needle] : refused) {
    auto a = ReadNpy(d + "/" + name + ".npy");
    ASSERT_FALSE(a.ok()) << name;
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_NE(a.status().message().find(needle), std::string::npos) << a.status();
  }
}

TEST_F(NumpyInteropTest, NumPyLoadsFilesWeWrote) {
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"s", {}}, {"e", {0}}, {"v", {3}}, {"t", {2, 3, 4}}};
  uint32_t seed = 0;
  for (const std::string& dtype : kDtypes) {
    for (const auto& [tag, shape] : shapes) {
      NpyArray a = MakeArray(dtype, shape, ++seed);
      if (dtype == "float16" || dtype == "float32" || dtype == "float64") {
        // Finite values only, so NumPy's array_equal is meaningful.
        for (size_t i = 0; i < a.data.size(); ++i) {
          a.data[i] = static_cast<char>(i % (*NpyDtypeSize(dtype)) == 0 ? i : 0x10);
        }
      }
      const std::string base = dir_.path() + "/" + dtype + "_" + tag;
      ASSERT_TRUE(WriteNpy(base + ".npy", a).ok());
      std::ofstream(base + ".bin", std::ios::binary) << a.data;
    }
  }
  const std::string script = R"PY(
import sys, numpy as np
d = sys.argv[1]
names = ['float16', 'float32', 'float64', 'int8', 'int16', 'int32', 'int64',
         'uint8', 'uint16', 'uint32', 'uint64', 'bool']
bad = []
for name in names:
    for tag, shape in [('s', ()), ('e', (0,)), ('v', (3,)), ('t', (2, 3, 4))]:
        a = np.load(f'{d}/{name}_{tag}.npy', allow_pickle=False)
        raw = open(f'{d}/{name}_{tag}.bin', 'rb').read()
        want = np.frombuffer(raw, dtype=np.dtype(name).newbyteorder('<')).reshape(shape)
        if a.dtype != np.dtype(name) or a.shape != shape or not np.array_equal(a, want) \
                or a.tobytes() != raw or not a.flags.c_contiguous:
            bad.append(f'{name}_{tag}: {a.dtype} {a.shape}')
print('\n'.join(bad))
sys.exit(1 if bad else 0)
)PY";
  EXPECT_EQ(RunPython(dir_.path(), script), 0) << ReadFile(dir_.path() + "/python.log");
}

}  // namespace
}  // namespace opjit::client
