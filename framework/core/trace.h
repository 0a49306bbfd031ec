// Named ranges around layers and phases for profilers (NVTX in CUDA builds: visible in Nsight
// Systems timelines; nothing in CPU-only builds).
//
//   { TraceRange r("layer 3 fwd"); ... }
#pragma once

#if HOTPATH_HAVE_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

namespace hp {

class TraceRange {
 public:
  explicit TraceRange(const char* name) {
#if HOTPATH_HAVE_CUDA
    nvtxRangePushA(name);
#else
    (void)name;
#endif
  }
  ~TraceRange() {
#if HOTPATH_HAVE_CUDA
    nvtxRangePop();
#endif
  }
  TraceRange(const TraceRange&) = delete;
  TraceRange& operator=(const TraceRange&) = delete;
};

}  // namespace hp
