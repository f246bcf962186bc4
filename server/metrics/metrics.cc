#include "server/metrics/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/logging.h"

namespace opjit::metrics {
namespace {

// Distinct warnings logged at most; beyond it misuse is ignored silently.
constexpr size_t kMaxWarnings = 1000;

bool IsMetricName(std::string_view s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
                    (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

bool IsLabelName(std::string_view s) {
  if (s.empty() || s.substr(0, 2) == "__") return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                    (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

// Length of the valid UTF-8 sequence starting at s[i] (RFC 3629: no overlong
// forms, no surrogates, nothing above U+10FFFF), or 0 when it is invalid.
size_t Utf8SequenceLength(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = byte(i);
  if (c < 0x80) return 1;
  size_t len;
  unsigned char lo = 0x80, hi = 0xBF;  // bounds of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + len > s.size()) return 0;
  if (byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < len; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  }
  return len;
}

// Appends `s` with backslash and newline escaped (and double quote when
// `quote`), invalid UTF-8 replaced by U+FFFD.
void AppendEscaped(std::string* out, std::string_view s, bool quote) {
  for (size_t i = 0; i < s.size();) {
    const char c = s[i];
    if (c == '\\') {
      out->append("\\\\");
    } else if (c == '\n') {
      out->append("\\n");
    } else if (c == '"' && quote) {
      out->append("\\\"");
    } else {
      const size_t len = Utf8SequenceLength(s, i);
      if (len == 0) {
        out->append("\xEF\xBF\xBD");
        ++i;
        continue;
      }
      out->append(s.substr(i, len));
      i += len;
      continue;
    }
    ++i;
  }
}

void AppendValue(std::string* out, double v) {
  if (std::isnan(v)) {
    out->append("NaN");
  } else if (std::isinf(v)) {
    out->append(v > 0 ? "+Inf" : "-Inf");
  } else if (v == std::trunc(v) && std::fabs(v) <= 9007199254740992.0) {
    absl::StrAppend(out, static_cast<int64_t>(v));
  } else {
    char buf[64];
    const auto result = std::to_chars(buf, buf + sizeof(buf), v);
    out->append(buf, result.ptr);
  }
}

// Appends {a="x",b="y"} (plus le="<le>" when `le` is given); nothing when
// there are no labels at all.
void AppendLabels(std::string* out, const std::vector<std::string>& names,
                  const std::vector<std::string>& values, const std::string* le) {
  if (names.empty() && le == nullptr) return;
  out->push_back('{');
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out->push_back(',');
    absl::StrAppend(out, names[i], "=\"");
    AppendEscaped(out, values[i], /*quote=*/true);
    out->push_back('"');
  }
  if (le != nullptr) {
    if (!names.empty()) out->push_back(',');
    absl::StrAppend(out, "le=\"", *le, "\"");
  }
  out->push_back('}');
}

// Truncates `s` to at most `max` bytes without splitting a UTF-8 character.
std::string Truncated(const std::string& s, size_t max) {
  if (s.size() <= max) return s;
  size_t n = max;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return s.substr(0, n);
}

}  // namespace

const char* Registry::TypeName(Type type) {
  switch (type) {
    case Type::kCounter:
      return "counter";
    case Type::kGauge:
      return "gauge";
    case Type::kHistogram:
      return "histogram";
  }
  return "untyped";
}

Registry::Registry(Options options)
    : options_([&] {
        options.max_series_per_family = std::max<size_t>(options.max_series_per_family, 1);
        options.max_label_value_bytes = std::max<size_t>(options.max_label_value_bytes, 1);
        return options;
      }()) {}

void Registry::DeclareCounter(std::string name, std::string help,
                              std::vector<std::string> label_names) {
  Declare(Type::kCounter, std::move(name), std::move(help), std::move(label_names), {});
}

void Registry::DeclareGauge(std::string name, std::string help,
                            std::vector<std::string> label_names) {
  Declare(Type::kGauge, std::move(name), std::move(help), std::move(label_names), {});
}

void Registry::DeclareHistogram(std::string name, std::string help,
                                std::vector<std::string> label_names, std::vector<double> buckets) {
  buckets.erase(
      std::remove_if(buckets.begin(), buckets.end(), [](double b) { return !std::isfinite(b); }),
      buckets.end());
  std::sort(buckets.begin(), buckets.end());
  buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());
  Declare(Type::kHistogram, std::move(name), std::move(help), std::move(label_names),
          std::move(buckets));
}

void Registry::Declare(Type type, std::string name, std::string help,
                       std::vector<std::string> label_names, std::vector<double> buckets) {
  std::string warning;
  {
    absl::MutexLock lock(&mu_);
    std::string invalid;
    if (!IsMetricName(name)) invalid = "invalid metric name";
    for (size_t i = 0; i < label_names.size() && invalid.empty(); ++i) {
      const std::string& label = label_names[i];
      if (!IsLabelName(label)) {
        invalid = absl::StrCat("invalid label name \"", label, "\"");
      } else if (type == Type::kHistogram && label == "le") {
        invalid = "a histogram may not have a label named \"le\"";
      } else if (std::find(label_names.begin(), label_names.begin() + i, label) !=
                 label_names.begin() + i) {
        invalid = absl::StrCat("duplicate label name \"", label, "\"");
      }
    }
    if (!invalid.empty()) {
      std::string key = absl::StrCat("invalid:", name);
      WarnOnceLocked(std::move(key),
                     absl::StrCat("ignoring declaration of metric \"", name, "\": ", invalid),
                     &warning);
    } else if (auto it = by_name_.find(name); it != by_name_.end()) {
      const Family& f = *it->second;
      if (f.type != type || f.help != help || f.label_names != label_names ||
          f.buckets != buckets) {
        WarnOnceLocked(absl::StrCat("redeclared:", name),
                       absl::StrCat("ignoring conflicting re-declaration of metric \"", name,
                                    "\" (first declared as a ", TypeName(f.type), " with labels [",
                                    absl::StrJoin(f.label_names, ","), "])"),
                       &warning);
      }
    } else {
      auto family = std::make_unique<Family>();
      family->name = std::move(name);
      family->help = std::move(help);
      family->type = type;
      family->label_names = std::move(label_names);
      family->buckets = std::move(buckets);
      by_name_.emplace(family->name, family.get());
      families_.push_back(std::move(family));
    }
  }
  if (!warning.empty()) Logger("metrics")->warn("{}", warning);
}

Registry::Family* Registry::FindLocked(const std::string& name, size_t label_count,
                                       std::string* warning) {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) {
    WarnOnceLocked(absl::StrCat("undeclared:", name),
                   absl::StrCat("ignoring update of undeclared metric \"", name, "\""), warning);
    return nullptr;
  }
  Family* family = it->second;
  if (family->label_names.size() != label_count) {
    WarnOnceLocked(absl::StrCat("labels:", name),
                   absl::StrCat("ignoring update of metric \"", name, "\" with ", label_count,
                                " label values; it has ", family->label_names.size(), " labels [",
                                absl::StrJoin(family->label_names, ","), "]"),
                   warning);
    return nullptr;
  }
  return family;
}

Registry::Series& Registry::SeriesLocked(Family& family,
                                         const std::vector<std::string>& label_values,
                                         std::string* warning) {
  const size_t max_bytes = options_.max_label_value_bytes;
  const bool too_long = std::any_of(label_values.begin(), label_values.end(),
                                    [&](const std::string& v) { return v.size() > max_bytes; });
  std::vector<std::string> truncated;
  if (too_long) {
    truncated.reserve(label_values.size());
    for (const std::string& v : label_values) truncated.push_back(Truncated(v, max_bytes));
  }
  const std::vector<std::string>& key = too_long ? truncated : label_values;

  auto it = family.series.find(key);
  if (it != family.series.end()) return it->second;
  std::vector<std::string> new_key;
  if (family.series.size() >= options_.max_series_per_family) {
    new_key.assign(key.size(), std::string(kOtherLabelValue));
    if (!family.overflow_warned) {
      family.overflow_warned = true;
      *warning =
          absl::StrCat("metric \"", family.name, "\" reached ", options_.max_series_per_family,
                       " series; new label sets are counted under \"", kOtherLabelValue, "\"");
    }
    it = family.series.find(new_key);
    if (it != family.series.end()) return it->second;
  } else {
    new_key = key;
  }
  Series series;
  if (family.type == Type::kHistogram) series.bucket_counts.assign(family.buckets.size() + 1, 0);
  return family.series.emplace(std::move(new_key), std::move(series)).first->second;
}

void Registry::WarnOnceLocked(std::string key, std::string message, std::string* warning) {
  if (warned_.size() >= kMaxWarnings) return;
  if (warned_.insert(std::move(key)).second) *warning = std::move(message);
}

void Registry::Inc(const std::string& name, const std::vector<std::string>& label_values,
                   double v) {
  std::string warning;
  {
    absl::MutexLock lock(&mu_);
    if (Family* f = FindLocked(name, label_values.size(), &warning)) {
      if (f->type == Type::kHistogram) {
        WarnOnceLocked(absl::StrCat("inc:", name),
                       absl::StrCat("ignoring Inc of histogram \"", name, "\""), &warning);
      } else if (f->type == Type::kCounter && !(v >= 0)) {
        WarnOnceLocked(absl::StrCat("negative:", name),
                       absl::StrCat("ignoring Inc of counter \"", name, "\" by ", v), &warning);
      } else {
        SeriesLocked(*f, label_values, &warning).value += v;
      }
    }
  }
  if (!warning.empty()) Logger("metrics")->warn("{}", warning);
}

void Registry::Set(const std::string& name, const std::vector<std::string>& label_values,
                   double v) {
  std::string warning;
  {
    absl::MutexLock lock(&mu_);
    if (Family* f = FindLocked(name, label_values.size(), &warning)) {
      if (f->type != Type::kGauge) {
        WarnOnceLocked(absl::StrCat("set:", name),
                       absl::StrCat("ignoring Set of ", TypeName(f->type), " \"", name, "\""),
                       &warning);
      } else {
        SeriesLocked(*f, label_values, &warning).value = v;
      }
    }
  }
  if (!warning.empty()) Logger("metrics")->warn("{}", warning);
}

void Registry::SetCounter(const std::string& name, const std::vector<std::string>& label_values,
                          double v) {
  std::string warning;
  {
    absl::MutexLock lock(&mu_);
    if (Family* f = FindLocked(name, label_values.size(), &warning)) {
      if (f->type != Type::kCounter) {
        WarnOnceLocked(
            absl::StrCat("setcounter:", name),
            absl::StrCat("ignoring SetCounter of ", TypeName(f->type), " \"", name, "\""),
            &warning);
      } else if (!(v >= 0)) {
        WarnOnceLocked(absl::StrCat("negative:", name),
                       absl::StrCat("ignoring SetCounter of counter \"", name, "\" to ", v),
                       &warning);
      } else {
        SeriesLocked(*f, label_values, &warning).value = v;
      }
    }
  }
  if (!warning.empty()) Logger("metrics")->warn("{}", warning);
}

void Registry::Observe(const std::string& name, const std::vector<std::string>& label_values,
                       double v) {
  std::string warning;
  {
    absl::MutexLock lock(&mu_);
    if (Family* f = FindLocked(name, label_values.size(), &warning)) {
      if (f->type != Type::kHistogram) {
        WarnOnceLocked(absl::StrCat("observe:", name),
                       absl::StrCat("ignoring Observe of ", TypeName(f->type), " \"", name, "\""),
                       &warning);
      } else if (std::isnan(v)) {
        WarnOnceLocked(absl::StrCat("nan:", name),
                       absl::StrCat("ignoring Observe of NaN in histogram \"", name, "\""),
                       &warning);
      } else {
        Series& s = SeriesLocked(*f, label_values, &warning);
        const size_t bucket =
            std::lower_bound(f->buckets.begin(), f->buckets.end(), v) - f->buckets.begin();
        ++s.bucket_counts[bucket];
        s.sum += v;
        ++s.count;
      }
    }
  }
  if (!warning.empty()) Logger("metrics")->warn("{}", warning);
}

void Registry::ClearGauge(const std::string& name) {
  std::string warning;
  {
    absl::MutexLock lock(&mu_);
    auto it = by_name_.find(name);
    if (it == by_name_.end()) {
      WarnOnceLocked(absl::StrCat("undeclared:", name),
                     absl::StrCat("ignoring ClearGauge of undeclared metric \"", name, "\""),
                     &warning);
    } else if (it->second->type != Type::kGauge) {
      WarnOnceLocked(
          absl::StrCat("clear:", name),
          absl::StrCat("ignoring ClearGauge of ", TypeName(it->second->type), " \"", name, "\""),
          &warning);
    } else {
      it->second->series.clear();
      it->second->overflow_warned = false;
    }
  }
  if (!warning.empty()) Logger("metrics")->warn("{}", warning);
}

void Registry::AddCollector(std::function<void(Registry&)> fn) {
  if (!fn) return;
  absl::MutexLock lock(&mu_);
  collectors_.push_back(std::move(fn));
}

std::string Registry::Render(const RenderFilter& filter) {
  absl::MutexLock render_lock(&render_mu_);
  std::vector<std::function<void(Registry&)>> collectors;
  {
    absl::MutexLock lock(&mu_);
    collectors = collectors_;
  }
  for (const auto& collect : collectors) collect(*this);

  std::string out;
  absl::MutexLock lock(&mu_);
  for (const auto& family : families_) {
    const Family& f = *family;
    // Index of the "namespace" label; a filtered render shows only families
    // that have one.
    const auto ns_label = std::find(f.label_names.begin(), f.label_names.end(), "namespace");
    const size_t ns_index = static_cast<size_t>(ns_label - f.label_names.begin());
    if (!filter.all && ns_label == f.label_names.end()) continue;
    const auto shown = [&](const std::vector<std::string>& values) {
      if (filter.all) return true;
      if (std::all_of(values.begin(), values.end(),
                      [](const std::string& v) { return v == kOtherLabelValue; })) {
        return false;  // the overflow series mixes namespaces
      }
      return filter.namespaces.count(values[ns_index]) > 0;
    };
    // A family with no series to show gets no HELP/TYPE lines: a declared
    // family without samples is a lint error to promtool.
    if (std::none_of(f.series.begin(), f.series.end(),
                     [&](const auto& kv) { return shown(kv.first); })) {
      continue;
    }
    absl::StrAppend(&out, "# HELP ", f.name, " ");
    AppendEscaped(&out, f.help, /*quote=*/false);
    absl::StrAppend(&out, "\n# TYPE ", f.name, " ", TypeName(f.type), "\n");
    if (f.type != Type::kHistogram) {
      for (const auto& [values, series] : f.series) {
        if (!shown(values)) continue;
        out.append(f.name);
        AppendLabels(&out, f.label_names, values, nullptr);
        out.push_back(' ');
        AppendValue(&out, series.value);
        out.push_back('\n');
      }
      continue;
    }
    std::vector<std::string> les;
    les.reserve(f.buckets.size() + 1);
    for (double b : f.buckets) {
      std::string le;
      AppendValue(&le, b);
      les.push_back(std::move(le));
    }
    les.push_back("+Inf");
    for (const auto& [values, series] : f.series) {
      if (!shown(values)) continue;
      uint64_t cumulative = 0;
      for (size_t i = 0; i < les.size(); ++i) {
        cumulative += series.bucket_counts[i];
        absl::StrAppend(&out, f.name, "_bucket");
        AppendLabels(&out, f.label_names, values, &les[i]);
        absl::StrAppend(&out, " ", cumulative, "\n");
      }
      absl::StrAppend(&out, f.name, "_sum");
      AppendLabels(&out, f.label_names, values, nullptr);
      out.push_back(' ');
      AppendValue(&out, series.sum);
      absl::StrAppend(&out, "\n", f.name, "_count");
      AppendLabels(&out, f.label_names, values, nullptr);
      absl::StrAppend(&out, " ", series.count, "\n");
    }
  }
  return out;
}

}  // namespace opjit::metrics
