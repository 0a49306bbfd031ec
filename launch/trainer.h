// The training loop's parts: a Trainer owns the backend, model, data loader and optimizer of
// one rank, and step() runs one optimizer step. run_train() is the loop around it; read it top
// to bottom to follow a step.
#pragma once

#include <memory>
#include <string>

#include "framework/backend/backend.h"
#include "framework/data/loader.h"
#include "framework/model/copy_arbiter.h"
#include "framework/model/model.h"
#include "launch/options.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"
#include "parallel/grad_sync.h"
#include "parallel/launch_env.h"
#include "parallel/process_groups.h"

namespace hp {

struct StepStats {
  int64_t step = 0;
  double loss = 0;      // mean cross-entropy over the global batch's valid targets
  double aux_loss = 0;  // load-balancing loss (MoE), reported separately
  double lr = 0;
  double grad_norm = 0;  // before clipping
  double ms = 0;
  double tokens_per_s = 0;
  int64_t tokens = 0;         // global tokens in the step
  int64_t valid_targets = 0;  // global
  double model_flops = 0;     // global: 6 * active params * tokens + causal attention FLOPs
  SyncCounter syncs;
  // Offload copies through the copy arbiter (offload != none), this rank's, over the step.
  bool lane = false;
  CopyArbiterStats lane_copies;
  // lane_arbiter=on: bytes each rank of this rank's host link released over the step (both
  // directions, in link_ranks order), and Jain's fairness index over them; else empty and 1.
  std::vector<int> link_ranks;
  std::vector<int64_t> link_bytes;
  double lane_jain = 1.0;
};

// The copy arbiter's part of the step line (compact) and of the JSONL metrics (full); both
// empty when the step had no arbiter.
std::string lane_log_fields(const StepStats& s);
std::string lane_json_fields(const StepStats& s);

// Picks the backend for options.device ("auto": CUDA when a GPU is present).
std::unique_ptr<Backend> make_backend(const TrainOptions& o, int local_rank);

// One rank's place in the job: how it was launched and its process groups.
struct RankContext {
  LaunchInfo launch;
  ProcessGroups groups;
  int rank() const { return groups.world ? groups.world->rank() : 0; }
  int world() const { return groups.world ? groups.world->size() : 1; }
};

// A context for one process without any launcher (tests, tools).
RankContext single_rank_context();

class Trainer {
 public:
  Trainer(const TrainOptions& o, const RankContext& ctx);
  StepStats step();
  Model& model() { return *model_; }
  Backend& backend() { return *be_; }
  DataLoader& loader() { return *loader_; }
  // The arbiter of the offload copies (null with offload=none).
  CopyArbiter* copy_arbiter() { return lane_.get(); }
  int64_t steps_done() const { return step_; }
  // Checkpointing (launch/checkpointing.h) reads and restores the run's position through these.
  const TrainOptions& options() const { return o_; }
  const RankContext& context() const { return ctx_; }
  const LrSchedule& schedule() const { return sched_; }
  int64_t tokens_seen() const { return tokens_seen_; }
  void set_position(int64_t step, int64_t tokens_seen) {
    step_ = step;
    tokens_seen_ = tokens_seen;
  }

 private:
  TrainOptions o_;
  // Declared before be_: the backend keeps a pointer to it until the backend is gone.
  std::unique_ptr<CopyArbiter> lane_;
  std::vector<int64_t> link_bytes_;  // at the start of the step
  std::unique_ptr<Backend> be_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<DataLoader> loader_;
  RankContext ctx_;
  std::unique_ptr<GradSync> grad_sync_;
  AdamW opt_;
  LrSchedule sched_;
  int64_t step_ = 0;
  int64_t tokens_seen_ = 0;  // global tokens of all steps so far
  Tensor stats_;
  // Failure injection for tests of the no-hang guarantee: HOTPATH_FAULT=KIND:RANK:STEP with KIND
  // throw (an exception), kill (SIGKILL itself) or hang (stop calling collectives); kill-save-*
  // kinds act inside a checkpoint save (launch/checkpointing.h).
  std::string fault_kind_;
  int fault_rank_ = -1;
  int64_t fault_step_ = -1;
  void maybe_inject_fault();  // [4]: lm loss sum, aux loss sum, dense grad sumsq, expert grad sumsq
};

// Training FLOPs of one step on this batch (ARCHITECTURE §8): 6 * N_active * tokens plus the
// attention score and value products of the packed documents, forward and backward (3x).
double step_model_flops(const ModelConfig& c, const PackedBatch& batch);
// Dense bf16 peak of the H100/H200 that MFU is quoted against.
constexpr double kPeakBf16Flops = 989e12;

DataConfig make_data_config(const TrainOptions& o, int rank, int world);
ModelOptions make_model_options(const TrainOptions& o);

int run_train(const TrainOptions& o, const RankContext& ctx);

}  // namespace hp
