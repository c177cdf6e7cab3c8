#include "common/clock.h"

namespace hsdp {
namespace {

class RealClock : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};

}  // namespace

Clock* Clock::Real() {
  // Leaked on purpose: usable during static destruction of other objects.
  static Clock* const clock = new RealClock();
  return clock;
}

}  // namespace hsdp
