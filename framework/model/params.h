// The parameter registry: every trainable tensor with its hierarchical name
// ("layers.3.attn.wqkv", "layers.3.moe.w1"), its role, and its buffers.
//
// Expert parameters are stored stacked, [E, ...] globally; a rank holds the contiguous block of
// experts [expert_begin, expert_begin + E_local) of its ep group. Everything else is replicated.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "framework/core/tensor.h"

namespace hp {

enum class ParamGroup { kDense, kExpert };

struct Param {
  std::string name;
  Shape shape;         // local shape (experts: [E_local, ...])
  Shape global_shape;  // experts: [E, ...]; otherwise == shape
  int64_t expert_begin = 0;
  ParamGroup group = ParamGroup::kDense;
  double init_std = 0.0;  // > 0: N(0, init_std); else constant init_value
  double init_value = 0.0;
  bool weight_decay = true;  // matrices decay; biases, norms and sinks do not

  Tensor master;  // master dtype (fp32; fp64 in gradient checks)
  Tensor work;    // act dtype copy the model computes with (aliases master when dtypes match)
  Tensor grad;    // master dtype, accumulated by backward
  // Set by Model::zero_grads: the gradient is zero but its memory is not (the first op of the
  // backward that touches it writes instead of accumulating; see Model::grad_beta / grad_acc).
  bool grad_zero = false;
  // Expert matrices (w1, w2) after a backward that was allowed to leave zeros unwritten
  // (Model::backward's leave_unreached): one flag per local expert, set where no row reached the
  // expert, so that its slice of grad is zero but its memory was not written. Empty: none. The
  // optimizer reads such slices as zeros (grad_sum_squares, AdamW::step); anything else that
  // reads grad calls Model::fill_unreached_grads first.
  std::vector<char> grad_zero_experts;
  // Whether the local expert le's slice of grad is zero without its memory saying so.
  bool expert_grad_unwritten(int64_t le) const {
    return !grad_zero_experts.empty() && grad_zero_experts[static_cast<size_t>(le)] != 0;
  }
  Tensor m, v;  // AdamW moments, master dtype

  // Optimizer-state sharding (optimizer_sharding=zero1): when sharded(), master, m and v hold
  // only the leading-axis rows [shard_begin, shard_begin + shard_rows) of the local tensor, and
  // work and grad stay whole (work no longer aliases master). Set by the sharded optimizer
  // (parallel/zero1.h) after init.
  int64_t shard_begin = 0;
  int64_t shard_rows = -1;  // < 0: not sharded
  bool sharded() const { return shard_rows >= 0; }
  // Leading-axis rows of the local tensor that master, m and v hold.
  int64_t state_row_begin() const { return sharded() ? shard_begin : 0; }
  int64_t state_rows() const { return sharded() ? shard_rows : shape[0]; }

  int64_t numel() const { return shape_numel(shape); }
  int64_t global_numel() const { return shape_numel(global_shape); }
};

// The layer a parameter belongs to: "layers.12.attn.wo" -> 12; anything else (embedding, final
// norm, unembedding) -> -1.
int param_layer(const std::string& name);

class ParamRegistry {
 public:
  Param& add(Param p);
  Param& get(const std::string& name);
  const Param* find(const std::string& name) const;
  std::vector<std::unique_ptr<Param>>& all() { return params_; }
  const std::vector<std::unique_ptr<Param>>& all() const { return params_; }

 private:
  std::vector<std::unique_ptr<Param>> params_;
};

}  // namespace hp
