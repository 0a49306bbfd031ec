// What a training step reports (StepStats), and where it goes: one line in the log on rank 0,
// and one JSON object per step in the metrics file (metrics_path, JSON Lines).
//
// The JSON object: step, loss, aux_loss (MoE only), lr, grad_norm, tokens_per_s, mfu (GPU only),
// ms, tokens, positions, padding, flops (the step's model FLOPs, StepStats::model_flops), on
// evaluated steps eval_loss, eval_tokens and eval_ms (EvalStats), syncs {metadata, routing,
// offload, loss, other}, optimizer_state_bytes {dense, expert} (this
// rank's fp32 masters and AdamW moments, counted from their allocations: with
// optimizer_sharding=zero1 its shards), and with offload a `link` object (the link arbiter's
// stats, LinkArbiterStats), and a `checkpoints` array on the records that follow a committed save
// (CheckpointReport: step, async, stall_ms, wait_ms, write_ms, bytes, committed_after_step). A
// step whose loss or gradient norm is not finite is
// written with "finite":false and its non-finite numbers as null, so every line of the file
// stays valid JSON. Under nonfinite=skip such a step also has "skipped":true, and every line
// from the first skipped step on carries "skipped_steps" (the run's count so far).
#pragma once

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "framework/backend/link_arbiter.h"
#include "framework/core/sync_counter.h"

namespace hp {

// One checkpoint save of the run (launch/train/async_checkpoint.h), reported on the first step
// record after it committed; saves that commit after the last step (the final save, a
// preemption's) are in the log only.
struct CheckpointReport {
  int64_t step = 0;           // the checkpoint's step
  bool async = false;         // written in the background
  double stall_ms = 0;        // the step loop's wait: for the previous save, the snapshot (async)
                              // or the whole save (synchronous)
  double wait_ms = 0;         // of the stall, waiting for the previous save to finish
  double write_ms = 0;        // writing and committing the file (async: in the background)
  int64_t bytes = 0;          // file size
  int64_t committed_after_step = 0;  // steps the loop had finished when the file was committed
};

// One held-out evaluation (launch/train/evaluation.h).
struct EvalStats {
  double loss = 0;      // mean -log p over the valid targets of the held-out global batches
  int64_t tokens = 0;   // global document tokens evaluated
  int64_t targets = 0;  // global valid targets (the mean's denominator)
  double ms = 0;        // wall time of the evaluation
};

struct StepStats {
  int64_t step = 0;
  double loss = 0;      // mean cross-entropy over the global batch's valid targets
  double aux_loss = 0;  // load-balancing loss (MoE), reported separately
  double lr = 0;
  double grad_norm = 0;  // before clipping
  // Loss and gradient norm were finite on every rank. When false the step was not applied: no
  // parameter or optimizer state changed.
  bool finite = true;
  // nonfinite=skip: this step was not finite and was skipped (counted as done, nothing updated).
  bool skipped = false;
  int64_t skipped_steps = 0;  // skipped steps of the run so far, this one included
  double ms = 0;
  // Throughput counts document tokens: input positions that hold a document's token. Padding
  // is not work, so it is in `positions` and `padding` only.
  double tokens_per_s = 0;    // global document tokens per second
  int64_t tokens = 0;         // global document tokens in the step
  int64_t positions = 0;      // global input positions in the step, padding included
  double padding = 0;         // 1 - tokens / positions
  int64_t valid_targets = 0;  // global
  // Global: 6 * active params * document tokens + the causal attention FLOPs of the document
  // pieces (components.h, step_model_flops).
  double model_flops = 0;
  // CUDA: model FLOPs per GPU per second over the bf16 peak (kPeakBf16Flops); 0 on the CPU.
  double mfu = 0;
  SyncCounter syncs;
  // Bytes of fp32 masters and AdamW moments this rank holds (dense and expert parameters).
  int64_t optimizer_state_bytes_dense = 0;
  int64_t optimizer_state_bytes_expert = 0;
  // The offload copies of this rank through the link arbiter over the step (offload != none).
  std::optional<LinkArbiterStats> copies;
  // eval_data: the held-out loss of the parameters after this step's update, on the steps that
  // evaluate (eval_every, and the last step of the run). Its time is not in `ms`.
  std::optional<EvalStats> eval;
  // Checkpoint saves committed since the previous step's record (rank 0's view).
  std::vector<CheckpointReport> checkpoints;
};

// The step line of the log: "step=3 loss=... lr=... grad_norm=... tok/s=... pad=P% ms=...
// syncs=N" (tok/s: document tokens; + aux_loss for MoE, + mfu=P% on a GPU, + the link arbiter's
// compact fields with offload, + eval_loss=X on evaluated steps, last).
std::string step_log_line(const StepStats& s, bool moe);

// The JSON object of one step, on one line (no newline).
std::string step_json(const StepStats& s, bool moe);

// The metrics file, one step_json line per step, flushed after each. A fresh run (resumed_step
// 0) starts it anew; a resumed run keeps its history: the lines of steps <= resumed_step stay,
// later ones (steps that the run will compute again) and a torn last line are dropped, and the
// new steps are appended.
class MetricsWriter {
 public:
  // An empty path writes nothing. Throws UserError (kConfig, naming metrics_path) when the
  // file cannot be written.
  explicit MetricsWriter(const std::string& path, int64_t resumed_step = 0);
  void write(const StepStats& s, bool moe);
  // Lines dropped at open (steps after resumed_step, or not a complete JSON object).
  int64_t dropped() const { return dropped_; }
  int64_t kept() const { return kept_; }

 private:
  std::ofstream out_;
  int64_t dropped_ = 0;
  int64_t kept_ = 0;
};

// Formats v with `prec` significant digits, as the log lines do.
std::string fmt_sig(double v, int prec = 4);

}  // namespace hp
