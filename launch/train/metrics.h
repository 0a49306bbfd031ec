// What a training step reports (StepStats), and where it goes: one line in the log on rank 0,
// and one JSON object per step in the metrics file (metrics_path, JSON Lines).
//
// The JSON object: step, loss, aux_loss (MoE only), lr, grad_norm, tokens_per_s, ms, tokens,
// syncs {metadata, routing, offload, loss, other}, optimizer_state_bytes {dense, expert} (this
// rank's fp32 masters and AdamW moments, counted from their allocations: with
// optimizer_sharding=zero1 its shards), and with offload a `lane` object (the copy arbiter's
// stats, CopyArbiterStats). A step whose loss or gradient norm is not finite is
// written with "finite":false and its non-finite numbers as null, so every line of the file
// stays valid JSON.
#pragma once

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>

#include "framework/backend/copy_arbiter.h"
#include "framework/core/sync_counter.h"

namespace hp {

struct StepStats {
  int64_t step = 0;
  double loss = 0;      // mean cross-entropy over the global batch's valid targets
  double aux_loss = 0;  // load-balancing loss (MoE), reported separately
  double lr = 0;
  double grad_norm = 0;  // before clipping
  // Loss and gradient norm were finite on every rank. When false the step was not applied: no
  // parameter or optimizer state changed.
  bool finite = true;
  double ms = 0;
  double tokens_per_s = 0;
  int64_t tokens = 0;         // global tokens in the step
  int64_t valid_targets = 0;  // global
  double model_flops = 0;     // global: 6 * active params * tokens + causal attention FLOPs
  SyncCounter syncs;
  // Bytes of fp32 masters and AdamW moments this rank holds (dense and expert parameters).
  int64_t optimizer_state_bytes_dense = 0;
  int64_t optimizer_state_bytes_expert = 0;
  // The offload copies of this rank through the copy arbiter over the step (offload != none).
  std::optional<CopyArbiterStats> copies;
};

// The step line of the log: "step=3 loss=... lr=... grad_norm=... tok/s=... ms=... syncs=N"
// (+ aux_loss for MoE, + the copy arbiter's compact fields with offload).
std::string step_log_line(const StepStats& s, bool moe);

// The JSON object of one step, on one line (no newline).
std::string step_json(const StepStats& s, bool moe);

// The metrics file: truncated at open, one step_json line per step, flushed after each.
class MetricsWriter {
 public:
  // An empty path writes nothing. Throws UserError (kConfig, naming metrics_path) when the
  // file cannot be written.
  explicit MetricsWriter(const std::string& path);
  void write(const StepStats& s, bool moe);

 private:
  std::ofstream out_;
};

// Formats v with `prec` significant digits, as the log lines do.
std::string fmt_sig(double v, int prec = 4);

}  // namespace hp
