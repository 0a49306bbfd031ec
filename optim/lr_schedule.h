// Learning-rate schedule: linear warmup from 0 to lr over warmup_steps, then cosine decay to
// min_lr at total_steps (constant min_lr after). Steps are 1-based.
#pragma once

#include <cstdint>

namespace hp {

struct LrSchedule {
  double lr = 3e-4;
  double min_lr = 0.0;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;

  double at(int64_t step) const;
};

}  // namespace hp
