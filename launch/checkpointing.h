// Checkpointing a Trainer: save and resume its whole state through framework/checkpoint (one
// HDF5 file per checkpoint, layout in docs/checkpoints.md), preemption signals, and the
// `inspect` and `eval` tools.
//
// What a checkpoint holds: every parameter's fp32 master, AdamW m and v (global shapes), the
// step, tokens seen, the data loader's position (world-size independent), the seed (the key of
// every counter-based random stream) and the LR-schedule position, plus the config text and the
// saving layout. That is the whole state of a run: a resumed run computes bitwise what the
// uninterrupted run computes (CPU; same layout), and a checkpoint loads under any dp x ep layout.
//
// Collectives: save_checkpoint, resume_from_options and preemption_agreed are collective over
// the world of the Trainer's RankContext: every rank calls them at the same step boundary.
//
// Writing: with an MPI world, every rank writes its own rows with collective parallel HDF5
// (dense tensors: their chunks split among the world ranks; expert tensors: each expert block
// written by one rank of the dp group that holds it). Without MPI (TCP launches, one process
// without mpirun), the expert shards are gathered over the ep group and rank 0 writes the file
// alone. On CUDA the tensors are copied to host memory first (one synchronization); on load the
// bf16 working copies are regenerated from the fp32 masters.
//
// Reading: every rank opens the file on its own and reads the rows it holds; the ranks then
// agree (all-reduce MAX of a failure flag) so that they all load the same checkpoint or all
// fail.
//
// Commit protocol: step_<N>.h5.tmp is written, closed and fsynced by every writer; barrier; rank
// 0 renames it to step_<N>.h5, fsyncs the directory, points `latest` at it (temp + rename),
// applies keep_last retention; barrier. A rank killed anywhere before the rename leaves only a
// .tmp file, which is never loaded.
//
// Fault injection for tests: HOTPATH_FAULT=kill-save-<point>:RANK:STEP makes RANK SIGKILL itself
// inside the save of step STEP, at <point>: begin (file created, nothing written), data (half
// the tensors written), close (file complete and fsynced, before the barrier and the commit) or
// rename (rank 0: renamed, `latest` not yet updated).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "launch/trainer.h"

namespace hp {

// Exit status of a run that stopped for preemption after saving a checkpoint (EX_TEMPFAIL): the
// job should be requeued and resumed with --resume=auto.
constexpr int kRequeueExitCode = 75;

// HOTPATH_FAULT kinds handled by save_checkpoint: kill-save-{begin,data,close,rename}.
bool is_save_fault_kind(const std::string& kind);

// ---- preemption -------------------------------------------------------------------------------
// Installs SIGUSR1 and SIGTERM handlers that only set a flag (async-signal-safe).
void install_preemption_handlers();
// This process has received SIGUSR1 or SIGTERM.
bool preemption_requested();
// Collective: true on every rank when any rank has received a preemption signal.
bool preemption_agreed(const RankContext& ctx);

// ---- save and resume --------------------------------------------------------------------------
struct SaveStats {
  std::string path;
  int64_t bytes = 0;  // file size
  double seconds = 0;
};

// Collective: saves the trainer's state after its current step as dir/step_<N>.h5 with the
// commit protocol above, then applies keep_last retention (<= 0: keep all).
SaveStats save_checkpoint(Trainer& trainer, const std::string& dir, int64_t keep_last);

// Loads a checkpoint into the trainer (any saving layout). Reads only the parameters when
// params_only (evaluation). Throws on any damage, naming the file and the dataset. Not
// collective; see resume_from_options for the agreement.
void load_checkpoint(Trainer& trainer, const std::string& path, bool params_only = false);

// Collective: applies options().resume: "none" (nothing), "auto" (the newest committed
// checkpoint of checkpoint_dir via `latest`, falling back to the committed files, newest first,
// when `latest` is missing or damaged or its checkpoint fails to load; nothing there: a log line
// and a fresh start) or a path (that checkpoint or an error). Returns the step resumed from
// (0: none).
int64_t resume_from_options(Trainer& trainer);

// A checkpoint argument: a file, or a directory meaning its newest committed checkpoint.
std::string resolve_checkpoint_arg(const std::string& path);

// ---- tools ------------------------------------------------------------------------------------
// hotpath inspect CHECKPOINT: step, layout, every dataset with shape, dtype, size and digest,
// and the checksum verification of every chunk. Returns 0 when all checks pass, 1 otherwise.
int inspect_main(const std::vector<std::string>& args);

// hotpath eval: mean loss of the checkpoint's model on `batches` global batches from the start
// of the data; prints "eval_loss=<float> tokens=<int>" on rank 0 (tokens: the valid targets the
// mean is over). Collective over the world.
int run_eval(const TrainOptions& o, const RankContext& ctx);

}  // namespace hp
