// The checkpoints of a training run: saving, loading, resuming and init_from, through
// framework/checkpoint (which knows files, not runs: one HDF5 file per checkpoint, layout in
// docs/checkpoints.md).
//
// What a checkpoint holds: every parameter's fp32 master, AdamW m and v (global shapes), the
// step, tokens seen, the data loader's position (world-size independent), the seed (the key of
// every counter-based random stream) and the LR-schedule position, plus the config text and the
// saving layout. That is the whole state of a run: a resumed run computes bitwise what the
// uninterrupted run computes (CPU; same layout), and a checkpoint loads under any dp x ep layout.
//
// Collectives: save_checkpoint and resume_from_options are collective over the world of the
// run's RankContext (and a save without MPI over its tensor groups too): every rank calls them at
// the same step boundary.
//
// Writing: with an MPI world, every rank writes its own rows with collective parallel HDF5
// (dense tensors: their chunks split among the world ranks; expert tensors: each expert block
// written by one rank of the dp group that holds it; with optimizer_sharding=zero1 every rank
// writes the rows of its shard of masters and moments). Without MPI (launches that meet through
// the store, one process without mpirun), the shards and expert blocks are gathered over the
// run's tensor groups (RunState::tensor_groups: NCCL on CUDA, on the device and in the compute
// stream's order; never the store, which carries only the control messages of the save) and
// rank 0 writes the file alone. On CUDA the tensors (gathered ones: the whole tensor) are copied
// to host memory through two staging buffers; on load the bf16 working copies are regenerated
// from the fp32 masters.
//
// A save runs in three steps (run_checkpoint.cpp): the plan of the rows each rank writes and of
// the state datasets and attributes, the write, and the commit below.
//
// Reading: every rank opens the file on its own and reads the rows it holds; the ranks then
// agree (all-reduce MAX of a failure flag) so that they all load the same checkpoint or all
// fail.
//
// A checkpoint with non-finite values is never written: save_checkpoint first checks every
// tensor it would write (all ranks agree) and fails, naming the first such tensor, before it
// creates any file.
//
// Commit protocol: step_<N>.h5.tmp is written, closed and fsynced by every writer; barrier; rank
// 0 renames it to step_<N>.h5, fsyncs the directory, points `latest` at it (temp + rename),
// applies keep_last retention; barrier. A rank killed anywhere before the rename leaves only a
// .tmp file, which is never loaded.
//
// Fault injection for tests: HOTPATH_FAULT=kill-save-<point>:RANK:STEP (launch/train/
// fault_injection.h) makes RANK SIGKILL itself inside the save of step STEP, and
// fail-save-<point> makes the save fail as a full disk would.
//
// The files carry no HDF5 object times: two saves of the same state are the same bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "framework/backend/backend.h"
#include "framework/data/loader.h"
#include "framework/model/model.h"
#include "launch/options.h"
#include "launch/train/rank_context.h"
#include "optim/lr_schedule.h"

namespace hp {

// Where a run stands: optimizer steps done and global tokens seen.
struct RunPosition {
  int64_t step = 0;
  int64_t tokens_seen = 0;
  int64_t skipped_steps = 0;  // steps not applied under nonfinite=skip
};

// The parts of a run that a checkpoint holds or needs (the Trainer hands them out).
struct RunState {
  const TrainOptions& options;
  const RankContext& ctx;
  Backend& backend;
  Model& model;
  DataLoader& loader;
  const LrSchedule& schedule;
  RunPosition position;
  // Called after a load has refreshed the working copies from the masters this rank holds
  // (with sharded optimizer state, only its rows: this gathers the rest). May be empty.
  std::function<void()> params_loaded;
  // The groups that move the run's tensors, with ctx.groups' ranks and layout: the NCCL groups
  // of a CUDA run of several ranks, the host groups otherwise. A save without MPI gathers its
  // shards over them. Null: ctx.groups.
  const ProcessGroups* tensor_groups = nullptr;
  // The data position a save records when the loader has already loaded batches past the run's
  // position (the Trainer loads the next step's batch ahead). Null: loader.state().
  const LoaderState* loader_state = nullptr;
};

struct SaveStats {
  std::string path;
  int64_t bytes = 0;  // file size
  double seconds = 0;
};

// Collective: saves the run's state after step run.position.step as dir/step_<N>.h5 with the
// commit protocol above, then applies keep_last retention (<= 0: keep all). Throws UserError
// (kData) without writing anything when any tensor holds a non-finite value.
SaveStats save_checkpoint(const RunState& run, const std::string& dir, int64_t keep_last);

// ---- asynchronous saves (driven by launch/train/async_checkpoint.h) ----------------------------
//
// A save split in two: prepare_save, on the training thread at the step boundary, checks the
// values (non-finite: nothing is saved), plans the file and copies every tensor this rank writes
// into host memory it owns (a SnapshotArena; from a device through the backend's copies, in the
// compute stream's order, so after the step's update), with a CRC-32C of each copy.
// write_prepared, on any thread, verifies those checksums and writes the file from the copies
// with the commit protocol above: the same plan and the same calls as save_checkpoint, so the
// same file. Parallel (MPI) saves only, or a world of one: without MPI the shards of several
// ranks are gathered over the tensor groups, which belong to the training thread.

// Host memory holding snapshots, kept across saves: allocated at the first (page-locked where
// the backend can), reused by every later one of the same size.
class SnapshotArena {
 public:
  void reserve(Backend& be, size_t bytes);
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  size_t bytes() const { return bytes_; }
  bool pinned() const { return pinned_; }

 private:
  std::shared_ptr<Storage> storage_;
  size_t bytes_ = 0;
  bool pinned_ = false;
};

// A save taken by prepare_save and not yet written.
struct PreparedSave;
int64_t prepared_step(const PreparedSave& save);
int64_t prepared_bytes(const PreparedSave& save);  // snapshot bytes of this rank

// Host bytes a snapshot of this rank takes: the rows it writes (parallel), or every tensor.
int64_t snapshot_bytes(const RunState& run, bool parallel);

// Collective over run.ctx's world (the non-finite check): the snapshot of step
// run.position.step. `parallel`: the file is written with parallel HDF5 (MPI); otherwise the
// world must be one rank. Throws UserError (kData) when a value is not finite.
std::shared_ptr<PreparedSave> prepare_save(const RunState& run, const std::string& dir,
                                           SnapshotArena& arena, bool parallel);

// Collective over `comm` (the writer's communicator over the world's ranks; null for one rank):
// writes and commits a prepared save and applies keep_last. A damaged snapshot or a failed write
// on any rank fails it on every rank: the partial file is removed, the committed checkpoints and
// `latest` stay, and it throws Error (kIo). The stats' time is the write's.
SaveStats write_prepared(PreparedSave& save, Backend& be, Communicator* comm, int64_t keep_last);

// Loads a checkpoint into the run's model (any saving layout) and, unless params_only
// (evaluation), its optimizer state and data position; returns the position it was saved at.
// Throws on any damage, naming the file and the dataset. Not collective; see
// resume_from_options for the agreement.
RunPosition load_checkpoint(const RunState& run, const std::string& path, bool params_only = false);

// Loads on every rank, then agrees: true when every rank loaded `path`. A rank that failed has
// logged why and returns its message in *error. Collective.
bool load_checkpoint_agreed(const RunState& run, const std::string& path, bool params_only,
                            RunPosition* loaded, std::string* error);

// Collective: applies options.resume: "none" (nothing), "auto" (the newest committed checkpoint
// of checkpoint_dir via `latest`, falling back to the committed files, newest first, when
// `latest` is missing or damaged or its checkpoint fails to load; nothing there: a log line and
// a fresh start) or a path (that checkpoint or an error). Returns the position resumed at (step
// 0: a fresh start).
RunPosition resume_from_options(const RunState& run);

// Collective: applies options.checkpoint.init_from, when set: the parameters of a hotpath
// checkpoint (file, or directory: its newest) or of a Hugging Face checkpoint directory
// (config.json + safetensors, mapped as `hotpath import-hf` maps them), whose shapes must match
// this run's model. Optimizer state, step and data position stay fresh. Returns true when it
// loaded something.
bool init_from_options(const RunState& run);

// A checkpoint argument: a file, or a directory meaning its newest committed checkpoint.
std::string resolve_checkpoint_arg(const std::string& path);

}  // namespace hp
