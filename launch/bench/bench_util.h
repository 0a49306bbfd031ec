// What every benchmark measures with: medians, and host-clock times from a drained backend.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

#include "framework/backend/backend.h"

namespace hp {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Milliseconds of fn(), measured from a drained backend to a drained backend.
template <typename Fn>
double time_ms(Backend& be, Fn fn) {
  be.synchronize(SyncCause::kOther);
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  be.synchronize(SyncCause::kOther);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace hp
