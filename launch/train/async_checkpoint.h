// The checkpoint saves of a training run, synchronous or in the background
// (checkpoint_async=true, docs/checkpoints.md "Asynchronous saves").
//
// A background save: at the step boundary the training thread checks the values (all ranks
// agree; a non-finite value is never saved), plans the file and copies every tensor this rank
// writes into host memory the saver owns (prepare_save, run_checkpoint.h), then starts a writer
// thread and goes on training. The writer verifies the copies' checksums and writes and commits
// the file exactly as a synchronous save does (write_prepared): same plan, same calls, same file.
// At most one save is in flight: the next save first waits for it (that wait is part of the
// save's stall, logged and in the metrics).
//
// Threads and MPI: the HDF5 library is not thread-safe, so every HDF5 call of the process runs
// under one lock (framework/core/hdf5_util.h, H5Lock), the data loader's too. With an MPI world
// the writer's collectives (parallel HDF5, the checksum reduction, the commit's agreements and
// barriers) run on its own communicator, a duplicate of the world made on the training thread at
// start-up, which needs MPI_THREAD_MULTIPLE. Saves stay synchronous, with a log line before step
// 1 saying why, when: the library gives a lower thread level; a launch of several ranks has no
// MPI (the shards are gathered over the tensor groups, on the training thread); or this host's
// available memory (MemAvailable) cannot hold the snapshots of its ranks.
//
// Failure of a background write (I/O error, disk full, a snapshot whose checksum no longer
// matches) is agreed by the writers before anything is committed: the partial file is removed,
// `latest` and the committed checkpoints stay. Each rank's training thread learns of it in the
// host collective of its next step (Trainer folds background_save_failed() into it), or at the
// next save, whichever comes first; there every rank logs the error and the run stops with exit
// status 1.
//
// Preemption and the end of the run (save_now): the save in flight is waited for, then the
// current step is saved synchronously unless it is already committed.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "launch/train/metrics.h"
#include "launch/train/run_checkpoint.h"

namespace hp {

// Whether a background checkpoint write of this process has failed (set by the writer thread).
bool background_save_failed();

// Host bytes available for new allocations on this machine (MemAvailable of /proc/meminfo); -1
// when it cannot be read.
int64_t host_available_bytes();

class CheckpointSaver {
 public:
  // Decides between background and synchronous saves for this run (every rank the same way;
  // collective over the world: the writer's communicator is duplicated here) and allocates the
  // snapshot memory; logs the choice on rank 0. `run` is the Trainer's state at start-up.
  CheckpointSaver(const TrainOptions& o, const RunState& run);
  // Waits for the save in flight.
  ~CheckpointSaver();
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  bool async() const { return async_; }
  int64_t snapshot_bytes() const { return snapshot_bytes_; }

  // A periodic save of run.position.step, collective: waits for the save in flight, stops the
  // run (Error kIo, exit 1) when any rank's background write failed, then snapshots and starts
  // the writer (async) or saves synchronously.
  void save(const RunState& run);
  // Preemption and the end of the run, collective: waits for the save in flight, stops the run
  // when a background write failed, and saves run.position.step synchronously unless it is
  // committed already.
  void save_now(const RunState& run);
  // Where the run stands (steps done), for the report of a save that commits in the background.
  void set_steps_done(int64_t steps) { steps_done_ = steps; }
  // Reports of the saves finished since the last call (training thread).
  std::vector<CheckpointReport> take_reports();
  // After the step's host collective agreed that a background write failed somewhere: every rank
  // logs the error (its own, or that another rank failed) and throws Error (kIo).
  [[noreturn]] void stop_for_failure();

 private:
  void wait(double* waited_ms);
  void check_failure(const RankContext& ctx);
  void report(CheckpointReport r);
  // Saves run.position.step on this thread and reports it (r: its step and wait so far; the
  // stall counts from t0).
  void save_synchronously(const RunState& run, std::chrono::steady_clock::time_point t0,
                          CheckpointReport r);

  const TrainOptions& o_;
  Backend& be_;
  int rank_ = 0;
  bool async_ = false;
  bool parallel_ = false;
  std::shared_ptr<Communicator> writer_comm_;  // MPI: the writer's own duplicate of the world
  SnapshotArena arena_;
  int64_t snapshot_bytes_ = 0;
  std::thread writer_;
  std::atomic<int64_t> steps_done_{0};
  int64_t committed_step_ = -1;  // the newest step this run committed (training thread's view)
  std::mutex mu_;                // guards the fields below, shared with the writer
  std::vector<CheckpointReport> reports_;
  std::string error_;  // this rank's background failure
  int64_t writer_committed_ = -1;
};

}  // namespace hp
