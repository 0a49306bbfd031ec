// The decoder-only model of ARCHITECTURE §6 with explicit forward and backward per layer.
//
// A Model owns its parameters (ParamRegistry) and computes through a Backend; it holds no
// global state. One call of forward_backward() runs a whole micro-batch: embedding, layers,
// final norm, chunked unembedding + cross-entropy, then backward in reverse layer order,
// accumulating into the parameters' grad tensors. The batch's metadata (BatchMeta) is read by
// every layer and never rebuilt, unless MetadataMode::kPerLayer asks for the baseline.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/model/activation_store.h"
#include "framework/model/config.h"
#include "framework/model/expert_exchange.h"
#include "framework/model/params.h"

namespace hp {

enum class MetadataMode { kCached, kPerLayer };

struct ModelOptions {
  bool checkpoint_activations = false;  // keep only block inputs; recompute in backward
  // Where the block inputs live between forward and backward (mode != none implies
  // checkpoint_activations).
  OffloadOptions offload;
  MetadataMode metadata = MetadataMode::kCached;
  RoutingMode routing = RoutingMode::kBincount;
  int64_t ce_chunk_tokens = 4096;  // rows of logits materialized at once
  int64_t max_positions = 4096;    // RoPE table length (>= seq_len)
};

// Scalars of one micro-batch, on the device (master dtype, shape [1]) until the trainer reads them.
struct LossSums {
  Tensor lm;   // sum over valid targets of -log p
  Tensor aux;  // sum over MoE layers of the load-balancing loss
};

class Model {
 public:
  // `exchange` may be null: a LocalExpertExchange is used. ep_rank/ep_size pick this rank's
  // contiguous block of experts.
  Model(const ModelConfig& cfg, const ModelOptions& opts, Backend& be,
        std::shared_ptr<ExpertExchange> exchange = nullptr);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ModelOptions& options() const { return opts_; }
  // Switches between cached metadata and the per-layer rebuild baseline (benchmarks).
  void set_metadata_mode(MetadataMode m) { opts_.metadata = m; }
  // Replaces the activation store (benchmarks); mode != none turns checkpointing on.
  void set_offload(const OffloadOptions& o);
  const ActivationStore& activation_store() const { return *store_; }
  ParamRegistry& params() { return params_; }
  Backend& backend() { return be_; }

  // Deterministic init from (seed, parameter name), independent of world size and layout.
  void init_params(uint64_t seed);
  // Copies master -> working copies (after init, load or an optimizer step on backends where
  // they differ).
  void refresh_working_copies();
  void zero_grads();

  // Forward and backward of one micro-batch. grad_scale multiplies the loss gradient (1 / the
  // global count of valid targets gives the mean). Returns the unscaled loss sums, accumulated
  // into `into` when its tensors are given (e.g. views of one stats tensor read with one sync).
  LossSums forward_backward(const BatchMeta& meta, double grad_scale, LossSums into = {});
  // Forward only (evaluation).
  LossSums forward(const BatchMeta& meta, LossSums into = {});

  // Called after layer l's parameter gradients are complete in backward (for overlapped
  // gradient reduction); layer -1 means the embedding/unembedding/final-norm group.
  void set_grad_ready_hook(std::function<void(int layer)> hook) { grad_hook_ = std::move(hook); }

  int expert_begin() const { return expert_begin_; }
  int local_experts() const { return local_experts_; }

 private:
  struct Layer;
  struct LayerActs;

  void build_params();
  void layer_forward(int l, const BatchMeta& meta, LayerActs& a, bool recompute);
  void layer_backward(int l, LayerActs& a, Tensor& dx);
  void moe_forward(int l, LayerActs& a, bool recompute);
  void moe_backward(int l, LayerActs& a, const Tensor& dy, Tensor& dhn);
  LossSums run(const BatchMeta& meta, double grad_scale, bool backward, LossSums sums);
  Tensor new_act(Shape s);
  Tensor new_master(Shape s);

  ModelConfig cfg_;
  ModelOptions opts_;
  Backend& be_;
  std::shared_ptr<ExpertExchange> exchange_;
  ParamRegistry params_;
  std::vector<std::unique_ptr<Layer>> layers_;
  Param* embed_ = nullptr;
  Param* final_norm_ = nullptr;
  Param* lm_head_ = nullptr;  // null when tied
  RopeTable rope_;
  int expert_begin_ = 0;
  int local_experts_ = 0;
  std::function<void(int)> grad_hook_;
  Tensor aux_sum_;                          // the current micro-batch's aux-loss accumulator
  std::unique_ptr<ActivationStore> store_;  // checkpointed block inputs (forward -> backward)
};

}  // namespace hp
