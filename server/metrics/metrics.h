// A small Prometheus metrics registry: counters, gauges and histograms with
// labels, rendered in the text exposition format 0.0.4.
//
//   Registry r;
//   r.DeclareCounter("opjit_rpc_total", "RPCs handled.", {"method", "code"});
//   r.Inc("opjit_rpc_total", {"Run", "OK"});
//   std::string text = r.Render();
//
// A family (one metric name) is declared once with a fixed list of label
// names; each distinct list of label values is one series of that family.
//
// Misuse (an undeclared name, the wrong number of label values, an operation
// the family's type does not have, a negative counter increment) is a
// programming error, but it must never take the daemon down: the call is
// ignored and a warning is logged once per (kind of misuse, name) through
// Logger("metrics").
//
// Label values may come from clients (op names, namespaces), so the registry
// bounds what they can cost: at most Options::max_series_per_family series per
// family (new label sets beyond it are folded into one series whose label
// values are all "_other") and at most Options::max_label_value_bytes bytes per
// label value (longer values are truncated). Invalid UTF-8 in label values and
// help texts is rendered as U+FFFD so a scrape never fails to parse.
//
// Thread-safe: every method may be called from any thread. Updates (Inc, Set,
// Observe) take one absl::Mutex for a map lookup and an addition, cheap enough
// to call on every RPC.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace opjit::metrics {

// Label name -> value, order preserved as declared.
using Labels = std::vector<std::pair<std::string, std::string>>;

// The label value every label of a series takes once its family is full.
inline constexpr char kOtherLabelValue[] = "_other";

class Registry {
 public:
  struct Options {
    // Series one family may hold. Once a family holds this many, an update
    // with a new label set goes to the series whose label values are all
    // "_other" (created on demand, so a family holds at most this + 1 series).
    // Existing series keep being updated. Values below 1 count as 1.
    // Default: 10000.
    size_t max_series_per_family = 10000;
    // Bytes one label value may have; longer values are truncated (at a UTF-8
    // character boundary) before the series is looked up, so values that
    // differ only beyond it share a series. Values below 1 count as 1.
    // Default: 256.
    size_t max_label_value_bytes = 256;
  };

  Registry() : Registry(Options{}) {}
  explicit Registry(Options options);
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Declares a family once. Re-declaring a name with the same type, help,
  // label names (and buckets) is a no-op; a different re-declaration is
  // ignored (the first one stays) with a warning. `name` must match
  // [a-zA-Z_:][a-zA-Z0-9_:]*; label names must match [a-zA-Z_][a-zA-Z0-9_]*,
  // must not start with "__" and must be distinct; otherwise the declaration
  // is ignored with a warning. `help` is free text.
  void DeclareCounter(std::string name, std::string help, std::vector<std::string> label_names);
  void DeclareGauge(std::string name, std::string help, std::vector<std::string> label_names);
  // As above; `buckets` are the upper bounds (inclusive, "le") of the
  // buckets, +Inf implicit. They are sorted and deduplicated; NaN and
  // infinite bounds are dropped. A histogram may not have a label named "le".
  void DeclareHistogram(std::string name, std::string help, std::vector<std::string> label_names,
                        std::vector<double> buckets);

  // Adds `v` to a counter or gauge series. For a counter, `v` must be >= 0
  // (NaN and negative values are ignored with a warning).
  void Inc(const std::string& name, const std::vector<std::string>& label_values, double v = 1);
  // Sets a gauge series to `v`.
  void Set(const std::string& name, const std::vector<std::string>& label_values, double v);
  // Sets a counter series to `v`: for collectors that mirror a total kept
  // elsewhere (a subsystem's own monotonic count), so the family is still
  // typed counter. `v` must be >= 0 (NaN and negative values are ignored with
  // a warning); the caller keeps it monotonic (a lower value reads as a
  // counter reset to Prometheus).
  void SetCounter(const std::string& name, const std::vector<std::string>& label_values, double v);
  // Records `v` in a histogram series: counts it in every bucket whose bound
  // is >= v (and +Inf), adds it to _sum and 1 to _count. NaN is ignored with
  // a warning.
  void Observe(const std::string& name, const std::vector<std::string>& label_values, double v);

  // Removes every series of a gauge family, so gauges refreshed at scrape
  // time (by a collector) drop label sets that vanished.
  void ClearGauge(const std::string& name);

  // Adds `fn`, run at the start of every Render(), in the order added and
  // outside the registry lock, to refresh gauges (e.g. per-namespace bytes
  // read from other subsystems). Renders are serialised, so one collector
  // never runs concurrently with itself or another collector. `fn` may call
  // any method but Render(); it must stay callable as long as the registry.
  void AddCollector(std::function<void(Registry&)> fn);

  // Which series a Render() shows.
  struct RenderFilter {
    // Every series (the default), or, when false, only the series whose
    // "namespace" label is one of `namespaces`: families without a
    // "namespace" label (server-wide ones) are left out, and so are the
    // overflow series (every label value "_other", which may sum up several
    // namespaces). A family none of whose series is shown has no HELP/TYPE
    // lines either.
    bool all = true;
    std::set<std::string> namespaces;

    static RenderFilter Everything() { return {}; }
    static RenderFilter Namespaces(std::set<std::string> namespaces) {
      return {false, std::move(namespaces)};
    }
  };

  // Runs the collectors, then returns every family that has at least one
  // series, in declaration order, in the Prometheus text exposition format
  // 0.0.4 (a family with no series yet has no HELP/TYPE lines either, so
  // every declared family has samples, as promtool wants):
  //   # HELP <name> <help, with \ and newline escaped>
  //   # TYPE <name> counter|gauge|histogram
  //   <name>{<label>="<value>",...} <value>
  // Series of a family are sorted by their label values (compared in
  // declaration order). Label values escape backslash, double quote and
  // newline. A histogram series renders <name>_bucket{...,le="<bound>"} with
  // cumulative counts, including le="+Inf", then <name>_sum and <name>_count.
  // Values: integers print without exponent or fraction (up to 2^53), other
  // values in the shortest form that round-trips, NaN, +Inf, -Inf.
  // Holds the registry lock while formatting (time linear in the series).
  std::string Render() { return Render(RenderFilter::Everything()); }
  // As above, restricted to what `filter` shows (families that show nothing
  // are omitted entirely, HELP and TYPE included).
  std::string Render(const RenderFilter& filter);

 private:
  enum class Type { kCounter, kGauge, kHistogram };

  struct Series {
    double value = 0;                     // counter, gauge
    std::vector<uint64_t> bucket_counts;  // histogram: per bucket, not cumulative; last is +Inf
    double sum = 0;                       // histogram
    uint64_t count = 0;                   // histogram
  };

  struct Family {
    std::string name;
    std::string help;
    Type type;
    std::vector<std::string> label_names;
    std::vector<double> buckets;  // histogram upper bounds, sorted, finite
    // Keyed by label values; the map order is the render order.
    std::map<std::vector<std::string>, Series> series;
    bool overflow_warned = false;
  };

  static const char* TypeName(Type type);
  void Declare(Type type, std::string name, std::string help, std::vector<std::string> label_names,
               std::vector<double> buckets);
  // The family `name` with `label_count` labels, or null (and a warning in
  // `*warning` the first time) when there is none or the count differs.
  Family* FindLocked(const std::string& name, size_t label_count, std::string* warning)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The series of `family` for `label_values` (truncated, or folded into the
  // "_other" series when the family is full), created when missing.
  Series& SeriesLocked(Family& family, const std::vector<std::string>& label_values,
                       std::string* warning) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets `*warning` to `message` unless `key` already warned.
  void WarnOnceLocked(std::string key, std::string message, std::string* warning)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  // Serialises Render() (collectors and formatting). Acquired before mu_.
  absl::Mutex render_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Family>> families_ ABSL_GUARDED_BY(mu_);  // declaration order
  std::map<std::string, Family*, std::less<>> by_name_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void(Registry&)>> collectors_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> warned_ ABSL_GUARDED_BY(mu_);  // keys of warnings logged, bounded
};

}  // namespace opjit::metrics
