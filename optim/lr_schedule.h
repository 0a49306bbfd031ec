// Learning-rate schedule: linear warmup from 0 to lr over warmup_steps, then cosine decay to
// min_lr at total_steps (constant min_lr after). Steps are 1-based.
#pragma once

#include <cstdint>

namespace hp {

struct LrSchedule {
  double lr = 3e-4;           // key `lr`
  double min_lr = 3e-5;       // key `min_lr`
  int64_t warmup_steps = 10;  // key `warmup_steps`
  int64_t total_steps = 1;    // the run's `steps`

  double at(int64_t step) const;
};

}  // namespace hp
