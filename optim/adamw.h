// AdamW over a ParamRegistry: fp32 (master dtype) weights and moments, decoupled weight decay,
// bias correction, global-norm clipping. The backend's fused adamw op does the per-tensor work
// and refreshes the working copy in the same pass; step() hands every parameter to one
// adamw_many call (a few launches on the GPU, the bits of adamw per tensor).
#pragma once

#include "framework/backend/backend.h"
#include "framework/core/clip.h"
#include "framework/model/params.h"

namespace hp {

// The defaults are those of the keys beta1, beta2, adam_eps and weight_decay.
struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // matrices only
};

// Sums of squared gradients, split by how the parameters are laid out across ranks: dense
// gradients are identical on every rank after their all-reduce; expert gradients differ per ep
// rank and must be summed over the ep group. Written into acc[2] = {dense, expert} (master dtype,
// on the device): no sync. One sum_squares_many per group.
void grad_sum_squares(Backend& be, ParamRegistry& params, Tensor& acc);

// clip_coefficient(grad_norm, clip): framework/core/clip.h.

class AdamW {
 public:
  explicit AdamW(AdamWConfig cfg) : cfg_(cfg) {}
  // One update of every parameter at `step` (1-based) with learning rate lr; gradients are
  // multiplied by grad_scale first.
  void step(Backend& be, ParamRegistry& params, int64_t step, double lr, double grad_scale);
  // The same update, gated on the device (AdamWParams::gate): the gate's scale replaces
  // grad_scale, and nothing changes where the gate is closed. Issued before the host knows the
  // gradient norm; the bits of step() with the scale the host would compute.
  void step_gated(Backend& be, ParamRegistry& params, int64_t step, double lr, const Tensor& gate);
  // One update of one tensor: master, grad, m and v of the same numel (a parameter or a shard
  // of its rows); `working`, when defined, receives master in its dtype.
  void update(Backend& be, Tensor& master, const Tensor& grad, Tensor& m, Tensor& v,
              bool weight_decay, int64_t step, double lr, double grad_scale, Tensor& working) const;
  // The same update computed without writing anything (the backend op's check-only mode):
  // flag[0] (master dtype, on the device, cleared by the caller) becomes 1 when a new master, m
  // or v value, or the master in working's dtype (only its dtype is read), would not be finite.
  void check_update(Backend& be, Tensor& master, const Tensor& grad, Tensor& m, Tensor& v,
                    bool weight_decay, int64_t step, double lr, double grad_scale, Tensor& working,
                    Tensor& flag) const;

 private:
  // adamw_many over every parameter with p (p.weight_decay where the parameter decays).
  void step_all(Backend& be, ParamRegistry& params, const AdamWParams& p) const;
  AdamWConfig cfg_;
};

}  // namespace hp
