#include "client/cpp/npy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace opjit::client {
namespace {

static_assert(std::endian::native == std::endian::little,
              "opjit's tensor bytes are little-endian; this host is not");

constexpr std::string_view kMagic = "\x93NUMPY";
constexpr size_t kMaxRank = 64;  // NumPy 2's limit.
constexpr int kMaxNesting = 16;  // Of tuples/lists/dicts in a header.
constexpr size_t kAlign = 64;    // Data offset alignment NumPy uses.

struct DtypeInfo {
  std::string_view name;
  char kind;  // NumPy kind: 'f', 'i', 'u', 'b'.
  uint64_t size;
};
constexpr std::array<DtypeInfo, 12> kDtypes = {{
    {"bool", 'b', 1},
    {"float16", 'f', 2},
    {"float32", 'f', 4},
    {"float64", 'f', 8},
    {"int16", 'i', 2},
    {"int32", 'i', 4},
    {"int64", 'i', 8},
    {"int8", 'i', 1},
    {"uint16", 'u', 2},
    {"uint32", 'u', 4},
    {"uint64", 'u', 8},
    {"uint8", 'u', 1},
}};

const DtypeInfo* FindDtype(std::string_view name) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

std::string Clip(std::string_view s) {
  std::string out;
  for (char c : s.substr(0, 64)) out.push_back(c >= 0x20 && c < 0x7f ? c : '?');
  if (s.size() > 64) out += "...";
  return out;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("(", absl::StrJoin(shape, ", "), shape.size() == 1 ? ",)" : ")");
}

// Size in bytes of `shape` elements of `elem` bytes; nullopt-like false on
// negative dims or overflow past 2^63 - 1.
bool ComputeBytes(uint64_t elem, const std::vector<int64_t>& shape, uint64_t* out) {
  uint64_t bytes = elem;
  bool empty = false;
  for (int64_t d : shape) {
    if (d < 0) return false;
    empty = empty || d == 0;
  }
  if (empty) {
    *out = 0;
    return true;
  }
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes) ||
        bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return false;
    }
  }
  *out = bytes;
  return true;
}

// ---- A parser for the Python literal that is a .npy header. ----

struct PyValue {
  enum Kind { kStr, kInt, kBool, kNone, kTuple, kList, kDict } kind = kNone;
  std::string str;
  int64_t integer = 0;
  bool boolean = false;
  std::vector<PyValue> items;  // kTuple, kList.
  std::vector<PyValue> keys;   // kDict, with values[i] for keys[i].
  std::vector<PyValue> values;
};

class PyLiteralParser {
 public:
  explicit PyLiteralParser(std::string_view text) : text_(text) {}

  // Parses the whole text as one literal (whitespace around it allowed).
  absl::StatusOr<PyValue> ParseAll() {
    PyValue value;
    if (!ParseValue(0, &value)) return Error();
    SkipSpace();
    if (pos_ != text_.size()) {
      error_ = "unexpected text after the dictionary";
      return Error();
    }
    return value;
  }

 private:
  absl::Status Error() const {
    return absl::InvalidArgumentError(absl::StrCat("malformed .npy header: ", error_, " at byte ",
                                                   pos_, " of \"", Clip(text_), "\""));
  }

  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool Fail(const char* message) {
    error_ = message;
    return false;
  }

  bool ParseValue(int depth, PyValue* out) {
    if (depth > kMaxNesting) return Fail("nesting too deep");
    SkipSpace();
    if (pos_ >= text_.size()) return Fail("unexpected end");
    char c = text_[pos_];
    if (c == '{') return ParseDict(depth, out);
    if (c == '(') return ParseSequence(depth, ')', out);
    if (c == '[') return ParseSequence(depth, ']', out);
    if (c == '\'' || c == '"') return ParseString(out);
    if (c == '-' || c == '+' || (c >= '0' && c <= '9')) return ParseInt(out);
    for (auto [word, kind, value] : {std::tuple{std::string_view("True"), PyValue::kBool, true},
                                     std::tuple{std::string_view("False"), PyValue::kBool, false},
                                     std::tuple{std::string_view("None"), PyValue::kNone, false}}) {
      if (text_.substr(pos_, word.size()) == word) {
        size_t end = pos_ + word.size();
        if (end < text_.size() &&
            (std::isalnum(static_cast<unsigned char>(text_[end])) || text_[end] == '_')) {
          break;
        }
        pos_ = end;
        out->kind = kind;
        out->boolean = value;
        return true;
      }
    }
    return Fail("expected a value");
  }

  bool ParseString(PyValue* out) {
    const char quote = text_[pos_++];
    out->kind = PyValue::kStr;
    while (pos_ < text_.size()) {
      char c = text_[pos_++];
      if (c == quote) return true;
      if (c == '\n') return Fail("newline in string");
      if (c == '\\') {
        if (pos_ >= text_.size()) break;
        char e = text_[pos_++];
        out->str.push_back(e == 'n' ? '\n' : e == 't' ? '\t' : e);
      } else {
        out->str.push_back(c);
      }
    }
    return Fail("unterminated string");
  }

  bool ParseInt(PyValue* out) {
    bool negative = false;
    if (text_[pos_] == '-' || text_[pos_] == '+') negative = text_[pos_++] == '-';
    SkipSpace();
    if (pos_ >= text_.size() || text_[pos_] < '0' || text_[pos_] > '9') {
      return Fail("expected digits");
    }
    uint64_t value = 0;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      if (__builtin_mul_overflow(value, 10u, &value) ||
          __builtin_add_overflow(value, static_cast<uint64_t>(text_[pos_] - '0'), &value) ||
          value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Fail("integer too large");
      }
      ++pos_;
    }
    if (pos_ < text_.size() && (text_[pos_] == 'L' || text_[pos_] == 'l')) ++pos_;  // Python 2.
    out->kind = PyValue::kInt;
    out->integer = negative ? -static_cast<int64_t>(value) : static_cast<int64_t>(value);
    return true;
  }

  // "(a, b, )" or "[a, b]"; "(a)" is just a, as in Python.
  bool ParseSequence(int depth, char close, PyValue* out) {
    ++pos_;
    std::vector<PyValue> items;
    bool comma = false;
    while (true) {
      SkipSpace();
      if (pos_ < text_.size() && text_[pos_] == close) {
        ++pos_;
        break;
      }
      PyValue item;
      if (!ParseValue(depth + 1, &item)) return false;
      items.push_back(std::move(item));
      SkipSpace();
      if (pos_ < text_.size() && text_[pos_] == ',') {
        ++pos_;
        comma = true;
        continue;
      }
      if (pos_ < text_.size() && text_[pos_] == close) {
        ++pos_;
        break;
      }
      return Fail(close == ')' ? "expected ',' or ')'" : "expected ',' or ']'");
    }
    if (close == ')' && items.size() == 1 && !comma) {
      *out = std::move(items[0]);
      return true;
    }
    out->kind = close == ')' ? PyValue::kTuple : PyValue::kList;
    out->items = std::move(items);
    return true;
  }

  bool ParseDict(int depth, PyValue* out) {
    ++pos_;
    out->kind = PyValue::kDict;
    while (true) {
      SkipSpace();
      if (pos_ < text_.size() && text_[pos_] == '}') {
        ++pos_;
        return true;
      }
      PyValue key, value;
      if (!ParseValue(depth + 1, &key)) return false;
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != ':') return Fail("expected ':'");
      ++pos_;
      if (!ParseValue(depth + 1, &value)) return false;
      out->keys.push_back(std::move(key));
      out->values.push_back(std::move(value));
      SkipSpace();
      if (pos_ < text_.size() && text_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < text_.size() && text_[pos_] == '}') {
        ++pos_;
        return true;
      }
      return Fail("expected ',' or '}'");
    }
  }

  std::string_view text_;
  size_t pos_ = 0;
  const char* error_ = "";
};

absl::Status Invalid(std::string_view message) {
  return absl::InvalidArgumentError(std::string(message));
}

// Maps a NumPy descr string to an opjit dtype name.
absl::StatusOr<std::string> DtypeFromDescr(const std::string& descr) {
  std::string_view d(descr);
  char order = '|';
  if (!d.empty() && (d[0] == '<' || d[0] == '>' || d[0] == '|' || d[0] == '=')) {
    order = d[0];
    d.remove_prefix(1);
  }
  if (d.empty()) return Invalid("empty dtype descr in .npy header");
  const char kind = d[0];
  std::string_view digits = d.substr(1);
  switch (kind) {
    case 'O':
      return Invalid(
          "object arrays (dtype=object) are not supported; they hold pickled Python objects, "
          "not numbers");
    case 'U':
      return Invalid(absl::StrCat("unicode string arrays ('", Clip(descr),
                                  "') are not supported; only numeric and bool arrays are"));
    case 'S':
    case 'a':
      return Invalid(absl::StrCat("byte string arrays ('", Clip(descr),
                                  "') are not supported; only numeric and bool arrays are"));
    case 'c':
      return Invalid(absl::StrCat("complex arrays ('", Clip(descr),
                                  "') are not supported; split into real and imaginary parts"));
    case 'M':
    case 'm':
      return Invalid(absl::StrCat("datetime/timedelta arrays ('", Clip(descr),
                                  "') are not supported; convert with arr.astype('<i8')"));
    case 'V':
      return Invalid(absl::StrCat("structured or void dtypes ('", Clip(descr),
                                  "') are not supported; save each field as its own array"));
    default:
      break;
  }
  uint64_t size = 0;  // 0: not a size we know.
  if (!digits.empty() && digits.size() <= 2) {
    bool digits_only = digits[0] != '0';
    for (char c : digits) {
      digits_only = digits_only && c >= '0' && c <= '9';
      size = size * 10 + static_cast<uint64_t>(c - '0');
    }
    if (!digits_only) size = 0;
  }
  const DtypeInfo* found = nullptr;
  for (const DtypeInfo& info : kDtypes) {
    if (info.kind == kind && info.size == size) found = &info;
  }
  if (found == nullptr) {
    return Invalid(
        absl::StrCat("unsupported dtype '", Clip(descr),
                     "'; supported: float16/32/64, int8/16/32/64, uint8/16/32/64 and bool"));
  }
  if (order == '>' && size > 1) {
    return Invalid(absl::StrCat("big-endian arrays are not supported; use arr.astype('<",
                                std::string(1, kind), size, "')"));
  }
  return std::string(found->name);
}

std::string DescrOf(const DtypeInfo& info) {
  return absl::StrCat(info.size == 1 ? "|" : "<", std::string(1, info.kind), info.size);
}

uint64_t ReadLe(std::string_view bytes, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[at + i]);
  return v;
}

}  // namespace

absl::StatusOr<uint64_t> NpyDtypeSize(std::string_view dtype) {
  if (const DtypeInfo* info = FindDtype(dtype)) return info->size;
  std::vector<std::string> names;
  names.reserve(kDtypes.size());
  for (const DtypeInfo& d : kDtypes) names.emplace_back(d.name);
  return Invalid(absl::StrCat("unknown dtype '", Clip(dtype),
                              "'; known dtypes: ", absl::StrJoin(names, ", ")));
}

absl::Status ValidateNpyArray(const NpyArray& array) {
  absl::StatusOr<uint64_t> elem = NpyDtypeSize(array.dtype);
  if (!elem.ok()) return elem.status();
  if (array.shape.size() > kMaxRank) {
    return Invalid(absl::StrCat("rank ", array.shape.size(), " is over the maximum of ", kMaxRank));
  }
  uint64_t bytes;
  if (!ComputeBytes(*elem, array.shape, &bytes)) {
    return Invalid(absl::StrCat("shape ", ShapeString(array.shape),
                                " has a negative dimension or is too large"));
  }
  if (array.data.size() != bytes) {
    return Invalid(absl::StrCat(array.dtype, " ", ShapeString(array.shape), " needs ", bytes,
                                " bytes of data, got ", array.data.size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<NpyArray> ParseNpy(std::string_view bytes) {
  if (bytes.size() < kMagic.size() + 2 || bytes.substr(0, kMagic.size()) != kMagic) {
    return Invalid("not a .npy file: it does not start with \"\\x93NUMPY\"");
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  const int minor = static_cast<unsigned char>(bytes[7]);
  if ((major != 1 && major != 2 && major != 3) || minor != 0) {
    return Invalid(absl::StrCat("unsupported .npy format version ", major, ".", minor,
                                "; 1.0, 2.0 and 3.0 are supported"));
  }
  const size_t length_bytes = major == 1 ? 2 : 4;
  const size_t preamble = 8 + length_bytes;
  if (bytes.size() < preamble) return Invalid(".npy file truncated inside its preamble");
  const uint64_t header_len = ReadLe(bytes, 8, static_cast<int>(length_bytes));
  if (header_len > bytes.size() - preamble) {
    return Invalid(absl::StrCat(".npy file truncated: header of ", header_len, " bytes, but only ",
                                bytes.size() - preamble, " bytes follow the preamble"));
  }
  std::string_view header = bytes.substr(preamble, header_len);

  absl::StatusOr<PyValue> dict = PyLiteralParser(header).ParseAll();
  if (!dict.ok()) return dict.status();
  if (dict->kind != PyValue::kDict) return Invalid("malformed .npy header: not a dictionary");
  const PyValue* descr = nullptr;
  const PyValue* fortran = nullptr;
  const PyValue* shape = nullptr;
  for (size_t i = 0; i < dict->keys.size(); ++i) {
    const PyValue& key = dict->keys[i];
    const PyValue& value = dict->values[i];
    if (key.kind != PyValue::kStr) return Invalid("malformed .npy header: a key is not a string");
    const PyValue** slot = key.str == "descr"           ? &descr
                           : key.str == "fortran_order" ? &fortran
                           : key.str == "shape"         ? &shape
                                                        : nullptr;
    if (slot == nullptr) {
      return Invalid(absl::StrCat("malformed .npy header: unexpected key '", Clip(key.str), "'"));
    }
    if (*slot != nullptr) {
      return Invalid(absl::StrCat("malformed .npy header: duplicate key '", key.str, "'"));
    }
    *slot = &value;
  }
  if (descr == nullptr || fortran == nullptr || shape == nullptr) {
    return Invalid("malformed .npy header: it needs the keys 'descr', 'fortran_order' and 'shape'");
  }

  NpyArray array;
  if (descr->kind == PyValue::kList || descr->kind == PyValue::kTuple) {
    return Invalid(
        "structured dtypes (arrays with named fields) are not supported; save each field as its "
        "own array");
  }
  if (descr->kind != PyValue::kStr)
    return Invalid("malformed .npy header: 'descr' is not a string");
  absl::StatusOr<std::string> dtype = DtypeFromDescr(descr->str);
  if (!dtype.ok()) return dtype.status();
  array.dtype = *std::move(dtype);

  if (fortran->kind != PyValue::kBool) {
    return Invalid("malformed .npy header: 'fortran_order' is not True or False");
  }
  if (fortran->boolean) {
    return Invalid("Fortran-ordered arrays are not supported; save np.ascontiguousarray(a)");
  }

  if (shape->kind != PyValue::kTuple) {
    return Invalid("malformed .npy header: 'shape' is not a tuple");
  }
  if (shape->items.size() > kMaxRank) {
    return Invalid(
        absl::StrCat("rank ", shape->items.size(), " is over the maximum of ", kMaxRank));
  }
  for (const PyValue& dim : shape->items) {
    if (dim.kind != PyValue::kInt || dim.integer < 0) {
      return Invalid("malformed .npy header: 'shape' must hold non-negative integers");
    }
    array.shape.push_back(dim.integer);
  }

  const uint64_t elem = FindDtype(array.dtype)->size;
  uint64_t expected;
  if (!ComputeBytes(elem, array.shape, &expected)) {
    return Invalid(
        absl::StrCat("shape ", ShapeString(array.shape), " of ", array.dtype, " is too large"));
  }
  std::string_view data = bytes.substr(preamble + header_len);
  if (data.size() < expected) {
    return Invalid(absl::StrCat(".npy data truncated: ", array.dtype, " ", ShapeString(array.shape),
                                " needs ", expected, " bytes, but only ", data.size(),
                                " follow the header"));
  }
  if (data.size() > expected) {
    return Invalid(absl::StrCat(".npy file has ", data.size() - expected,
                                " unexpected bytes after the ", expected, " bytes of ", array.dtype,
                                " ", ShapeString(array.shape), " data"));
  }
  array.data.assign(data.data(), data.size());
  return array;
}

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("open ", path));
  std::string bytes;
  struct stat st;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
    bytes.reserve(static_cast<size_t>(st.st_size));
  }
  char buf[1 << 16];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return absl::ErrnoToStatus(err, absl::StrCat("read ", path));
    }
    if (n == 0) break;
    bytes.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  absl::StatusOr<NpyArray> array = ParseNpy(bytes);
  if (!array.ok()) {
    return absl::Status(array.status().code(), absl::StrCat(path, ": ", array.status().message()));
  }
  return array;
}

std::string SerializeNpy(const NpyArray& array) {
  if (!ValidateNpyArray(array).ok()) return "";
  const DtypeInfo* info = FindDtype(array.dtype);
  std::string dict =
      absl::StrCat("{'descr': '", DescrOf(*info),
                   "', 'fortran_order': False, 'shape': ", ShapeString(array.shape), ", }");
  // Preamble + dict + padding + '\n' is a multiple of 64.
  size_t preamble = 10;
  if (dict.size() + 1 + kAlign > 65535) preamble = 12;
  const size_t unpadded = preamble + dict.size() + 1;
  dict.append((kAlign - unpadded % kAlign) % kAlign, ' ');
  dict.push_back('\n');
  std::string out(kMagic);
  out.push_back(preamble == 10 ? 1 : 2);
  out.push_back(0);
  const uint64_t len = dict.size();
  for (size_t i = 0; i < preamble - 8; ++i)
    out.push_back(static_cast<char>((len >> (8 * i)) & 0xff));
  out += dict;
  out += array.data;
  return out;
}

absl::Status WriteNpy(const std::string& path, const NpyArray& array) {
  absl::Status valid = ValidateNpyArray(array);
  if (!valid.ok()) return valid;
  const std::string bytes = SerializeNpy(array);
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", counter++);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("create ", tmp));
  auto fail = [&](int err, const std::string& what) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return absl::ErrnoToStatus(err, what);
  };
  std::string_view rest(bytes);
  while (!rest.empty()) {
    ssize_t n = ::write(fd, rest.data(), rest.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail(errno, absl::StrCat("write ", tmp));
    }
    rest.remove_prefix(static_cast<size_t>(n));
  }
  if (::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return absl::ErrnoToStatus(err, absl::StrCat("close ", tmp));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return absl::ErrnoToStatus(err, absl::StrCat("rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace opjit::client
