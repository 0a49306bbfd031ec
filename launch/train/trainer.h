// Training: a Trainer owns the backend, model, data loader, optimizer and gradient sync of one
// rank, and step() runs one optimizer step; run_train() is the loop around it (resume,
// logging, checkpoint cadence, preemption). Both are in trainer.cpp, to be read top to bottom.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/backend/link_arbiter.h"
#include "framework/data/loader.h"
#include "framework/model/model.h"
#include "launch/options.h"
#include "launch/train/components.h"
#include "launch/train/metrics.h"
#include "launch/train/rank_context.h"
#include "launch/train/run_checkpoint.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"
#include "parallel/grad_sync.h"
#include "parallel/zero1.h"

namespace hp {

class Trainer {
 public:
  Trainer(const TrainOptions& o, const RankContext& ctx);
  // One optimizer step on the next global batch. When the loss or the gradient norm is not
  // finite on any rank, no parameter or moment changes (every rank agrees) and the stats say
  // finite=false; the data loader has still moved past the batch. nonfinite=abort: the step
  // count does not move either (the run should stop); skip: the step counts as done and as
  // skipped (stats.skipped).
  StepStats step();

  Model& model() { return *model_; }
  Backend& backend() { return *be_; }
  DataLoader& loader() { return *loader_; }
  // The arbiter of the offload copies (null with offload=none).
  LinkArbiter* link_arbiter() { return link_arbiter_.get(); }
  int64_t steps_done() const { return step_; }
  // This rank's fp32 masters and AdamW moments (shards with optimizer_sharding=zero1).
  const OptimizerStateBytes& optimizer_state_bytes() const { return state_bytes_; }
  // Where gradient reductions and zero1's all-gathers run: "comm" (a stream of their own,
  // overlapping compute), "compute" (in the compute stream's order) or "none" (one rank).
  const char* reduction_stream() const;
  // Steps not applied under nonfinite=skip, over the whole run (restored on resume).
  int64_t skipped_steps() const { return skipped_; }
  // nonfinite=skip: the last step was skipped because its loss and gradients were finite but its
  // update would have made a parameter or an AdamW moment non-finite.
  bool last_update_overflowed() const { return update_overflowed_; }
  const TrainOptions& options() const { return o_; }
  const RankContext& context() const { return ctx_; }
  // Orders compute after the all-gathers of updated parameters still in flight (zero1; nothing
  // otherwise): a forward outside step(), an evaluation's, calls it first.
  void wait_params();
  // What a checkpoint saves and restores (launch/train/run_checkpoint.h).
  RunState run_state();
  // Also drops the batch loaded ahead (the loader has been restored: it is no longer next).
  void set_position(const RunPosition& p);
  // A preemption signal reached some rank before the last step's host collective, which agreed
  // on it (several ranks); one rank: whether this process has received one.
  bool preempted() const;
  // A background checkpoint write failed on some rank before the last step's host collective,
  // which agreed on it (several ranks); one rank: whether this process's writer failed.
  bool save_failed() const;

 private:
  // nonfinite=skip: runs this rank's AdamW update (its shards under zero1) in check-only mode,
  // reads the flag (one sync) and agrees over the world: true when no rank's update would make a
  // parameter or a moment non-finite.
  bool update_is_finite(int64_t step, double lr, double clip);

  TrainOptions o_;
  RankContext ctx_;
  // Declared before be_: the backend keeps a pointer to it until the backend is gone.
  std::unique_ptr<LinkArbiter> link_arbiter_;
  std::unique_ptr<Backend> be_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<DataLoader> loader_;
  // optimizer_sharding=zero1 on several ranks: the sharded masters and moments (before
  // grad_sync_, which points at it).
  std::unique_ptr<Zero1> zero1_;
  // Multi-rank only: reduces each layer's gradients as backward finishes it.
  std::unique_ptr<GradSync> grad_sync_;
  OptimizerStateBytes state_bytes_;
  ProcessGroups grad_groups_;  // the communicators of the gradient reductions
  // The communicators of the run's tensors (NCCL on CUDA; ctx_.groups on the CPU): the expert
  // exchange and a checkpoint's gathers.
  ProcessGroups tensor_groups_;
  AdamW opt_;
  LrSchedule sched_;
  int64_t step_ = 0;
  int64_t tokens_seen_ = 0;  // global document tokens of all steps so far
  int64_t skipped_ = 0;      // non-finite steps skipped (nonfinite=skip)
  // [4] on the device: lm loss sum, aux loss sum, dense grad sumsq, expert grad sumsq.
  Tensor scalars_;
  // [1] on the device (nonfinite=skip): the flag of update_is_finite's check.
  Tensor check_flag_;
  // One rank, nonfinite=abort (gate_ defined): the update is issued before the step's blocking
  // read, gated on the device (Backend::update_gate) by gate_ (f64 [2] on the device);
  // scalars_host_ (page-locked where the backend has it) receives scalars_ by a stream-ordered
  // copy issued before the update, and the host waits for that copy alone.
  Tensor gate_;
  Tensor scalars_host_;
  bool update_overflowed_ = false;
  // The next step's batch, loaded during this step while the device works (on several ranks
  // its global counts - valid targets, document tokens, FLOPs; needed before its loss - ride in
  // this step's one host collective). next_counts_ are those counts (summed over the ranks);
  // ahead_state_ is the loader's position before the batch was loaded, which is what a
  // checkpoint records. Empty at the start and after a load.
  std::optional<PackedBatch> next_batch_;
  std::vector<double> next_counts_;
  LoaderState ahead_state_;
  bool preempted_ = false;  // agreed in the last step's host collective
  bool save_failed_ = false;  // likewise: a background checkpoint write failed
};

// `hotpath train`: the whole run. Collective over the world. Returns the exit status (0, or
// kRequeueExitCode after a preemption). With eval_data, the held-out loss is evaluated after the
// update of every eval_every-th step and of the run's last step (launch/train/evaluation.h),
// before that step's record and checkpoint.
int run_train(const TrainOptions& o, const RankContext& ctx);

// Seconds since this process started (static initialization), for start-up times in logs.
double seconds_since_process_start();

}  // namespace hp
