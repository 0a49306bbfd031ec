// Device-time step profiles for the CUDA backend, from CUPTI's activity records.
//
// While a profile is collected, every kernel, copy and fill the process runs is recorded with its
// device start and end. The work issued by the driving thread carries the phase/op-family mark
// that was current at issue (pushed as a CUPTI external correlation id); collectives and copies
// are recognised by their kind and name. The result splits each instant of device activity evenly
// among the work running then, so by_phase and by_family sum to busy_ms exactly.
//
// One profiler per process (CUPTI's activity buffers are process-wide); not thread safe: the
// thread that drives the backend calls begin/mark/end.
#pragma once

#include "framework/backend/profile.h"

namespace hp::cuda {

// Starts recording; `phase`/`family` are the marks current now.
void profile_begin(StepPhase phase, OpFamily family);
// The marks changed: work issued from now on belongs to the new ones.
void profile_mark(StepPhase phase, OpFamily family);
// The caller has waited for all issued work; stops recording and returns the profile of the
// stretch since profile_begin.
StepProfile profile_end();

}  // namespace hp::cuda
