// Failure injection for the tests of the no-hang and crash-safety guarantees, from one
// environment variable parsed once:
//
//   HOTPATH_FAULT=KIND:RANK:STEP
//
// KIND, acting on rank RANK at step STEP:
//   throw              the step throws (an internal error)
//   kill               the process SIGKILLs itself at the start of the step
//   hang               the rank stops calling collectives (its peers must time out; it gives up
//                      after three collective timeouts)
//   nan                the rank's gradients of the step become NaN after backward (and after
//                      their all-reduce or, with optimizer_sharding=zero1, their reduce-scatter
//                      into this rank's shards), so only this rank sees a non-finite value
//   sigterm            the rank sends itself SIGTERM: STEP 0 at the very start of main (before
//                      the options are read), STEP >= 1 at the start of that step
//   kill-save-POINT    SIGKILL inside the checkpoint save of step STEP, at POINT: begin (file
//                      created, nothing written), data (half the tensors written), close (file
//                      complete and fsynced, before the commit) or rename (rank 0: renamed,
//                      `latest` not updated yet)
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace hp {

enum class FaultKind { kThrow, kKill, kHang, kKillInSave, kNan, kSigterm };

struct FaultSpec {
  FaultKind kind = FaultKind::kThrow;
  std::string save_point;  // kKillInSave: begin | data | close | rename
  int rank = -1;
  int64_t step = -1;
};

// Parses a HOTPATH_FAULT value; throws UserError (kConfig) naming the variable and the accepted
// forms on anything else.
FaultSpec parse_fault_spec(const std::string& text);

// The fault this process was asked for: HOTPATH_FAULT, parsed at the first call; nullopt when
// the variable is unset or empty.
const std::optional<FaultSpec>& injected_fault();

// At the start of step `step` on rank `rank`: acts out a throw, kill, hang or sigterm meant for
// them.
void maybe_inject_step_fault(int rank, int64_t step, double collective_timeout_s);

// First thing in main, before the options are read: raises SIGTERM when HOTPATH_FAULT is
// sigterm:RANK:0 and this process is RANK of its launch (a malformed value is left for the
// checks that report it later).
void maybe_inject_startup_signal();

// After backward of step `step` on rank `rank`: whether its gradients are to be made NaN.
bool nan_gradients_injected(int rank, int64_t step);

// Inside the checkpoint save of step `step`: SIGKILLs this process at `point` when asked to.
void maybe_inject_save_fault(const char* point, int rank, int64_t step);

}  // namespace hp
