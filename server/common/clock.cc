#include "server/common/clock.h"

namespace opjit {
namespace {

class Steady final : public Clock {
 public:
  time_point Now() const override { return std::chrono::steady_clock::now(); }
};

}  // namespace

const Clock* SteadyClock() {
  static const Steady* const clock = new Steady();
  return clock;
}

}  // namespace opjit
