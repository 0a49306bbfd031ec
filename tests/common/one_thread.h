// One OpenMP thread for the lifetime of a test's scope, the setting before restored after.
// For small CPU runs whose results do not depend on the thread count (the CPU backend's
// reductions run in a fixed order), where idle threads only add their start and wait costs.
#pragma once

#include <omp.h>

namespace hp::test {

class OneThread {
 public:
  OneThread() : before_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(before_); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int before_;
};

}  // namespace hp::test
