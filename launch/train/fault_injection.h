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
//   kill-save-POINT    SIGKILL inside the checkpoint save of step STEP, at POINT: snapshot (an
//                      asynchronous save's host snapshot taken, nothing written yet), begin (file
//                      created, nothing written), data (half the tensors written), close (file
//                      complete and fsynced, before the commit), rename (rank 0: renamed,
//                      `latest` not updated yet) or latest (rank 0: `latest` updated, keep_last
//                      not applied yet). With checkpoint_async the points after snapshot are
//                      reached on the background writer.
//   fail-save-POINT    the checkpoint save of step STEP fails at POINT as a full disk would: data
//                      (an ENOSPC-like I/O error half way through the tensors), close (after the
//                      file was closed, before the commit), or snapshot (an asynchronous save's
//                      host snapshot is damaged after its checksum was taken). RANK -1: every
//                      rank (a collective write that fails on one rank only would leave the
//                      others inside the collective).
//   slow-save          the background write of the checkpoint of step STEP starts 2 s late on
//                      RANK (-1: every rank), so that a test finds it still in flight
//   no-host-memory     when the run decides between background and synchronous saves (before
//                      step 1; STEP must be 0), RANK (-1: every rank) reads its host's available
//                      memory as 0 bytes, as on a host too full to hold the snapshot
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace hp {

enum class FaultKind {
  kThrow,
  kKill,
  kHang,
  kKillInSave,
  kFailSave,
  kSlowSave,
  kNoHostMemory,
  kNan,
  kSigterm
};

struct FaultSpec {
  FaultKind kind = FaultKind::kThrow;
  // kKillInSave: snapshot | begin | data | close | rename | latest; kFailSave: snapshot | data |
  // close
  std::string save_point;
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

// Inside the checkpoint save of step `step`, when fail-save-`point` is asked for this rank (or
// every rank): at data and close throws Error (kIo) as a full disk would; at snapshot returns
// true (the caller damages its snapshot). False when not asked.
bool maybe_inject_save_failure(const char* point, int rank, int64_t step);

// At the start of the background write of step `step`: sleeps 2 s when slow-save is asked for
// this rank (or every rank).
void maybe_delay_background_save(int rank, int64_t step);

// Whether no-host-memory is asked for this rank (or every rank): the host's available memory is
// then taken to be 0 bytes when the run decides on background saves.
bool host_memory_fault_injected(int rank);

}  // namespace hp
