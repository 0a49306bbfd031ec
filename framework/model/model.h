// The decoder-only model of docs/architecture.md, "The model", with explicit forward and
// backward per layer.
//
// A Model owns its parameters (ParamRegistry) and computes through a Backend; it holds no
// global state. A micro-batch is three calls, in this order:
//   model.forward(meta, sums.aux);          // embedding, layers, final norm
//   model.loss(grad_scale, sums.lm);        // chunked unembedding + cross-entropy
//   model.backward(grad_sync);              // reverse layer order, into the params' grads
// forward() keeps what loss() and backward() need until the next forward(). The batch's
// metadata (BatchMeta) is read by every layer and never rebuilt, unless MetadataMode::kPerLayer
// asks for the baseline.
#pragma once

#include <memory>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/model/activation_store.h"
#include "framework/model/config.h"
#include "framework/model/expert_exchange.h"
#include "framework/model/grad_ready.h"
#include "framework/model/params.h"

namespace hp {

enum class MetadataMode { kCached, kPerLayer };

// precision=bf16|fp8 (docs/design.md, "FP8 training"): bf16 runs every GEMM in the backend's
// activation dtype (bf16 on CUDA, cpu_dtype on the CPU); fp8 runs the forward and input-gradient
// products of the classes fp8_gemms names through Backend::gemm_fp8 with the recipe fp8_recipe
// (the backend's: Backend::fp8_recipe). Their weight-gradient products (but the unembedding's
// under unembedding_wgrad), the router, attention and the classes fp8_gemms leaves out (by
// default the unembedding) stay in the activation dtype.
enum class GemmPrecision { kBF16, kFP8 };
// fp8_gemms: which classes of products precision=fp8 quantizes.
struct Fp8GemmClasses {
  bool dense = true;    // the attention projections (qkv, out) and the dense FFN
  bool experts = true;  // the experts' FFN products of a MoE layer
  // The unembedding's logits and the input gradient of the hidden states (the tied embedding's
  // or lm_head's products; their weight gradient is unembedding_wgrad's). Off by default: its
  // error reaches the logits directly (docs/design.md, "FP8 training").
  bool unembedding = false;
  // The unembedding's weight gradient (lm_head's, or the tied embedding's share), both operands
  // blocked 128 tokens at a time along the contraction. Off by default, and apart from
  // `unembedding`: the one weight gradient that runs faster in FP8 (docs/design.md, "FP8
  // training"); its error lands on that gradient alone.
  bool unembedding_wgrad = false;
};

struct ModelOptions {
  bool checkpoint_activations = false;  // keep only block inputs; recompute in backward
  // Where the block inputs live between forward and backward (mode != none implies
  // checkpoint_activations).
  OffloadOptions offload;
  MetadataMode metadata = MetadataMode::kCached;
  RoutingMode routing = RoutingMode::kBincount;
  int64_t ce_chunk_tokens = 4096;  // rows of logits materialized at once
  int64_t max_positions = 4096;    // RoPE table length (>= seq_len)
  GemmPrecision precision = GemmPrecision::kBF16;  // key precision
  Fp8GemmClasses fp8_gemms;                        // key fp8_gemms
  fp8::Recipe fp8_recipe = fp8::Recipe::kBlock128;  // the backend's (make_model_options)

  bool fp8_dense() const { return precision == GemmPrecision::kFP8 && fp8_gemms.dense; }
  bool fp8_experts() const { return precision == GemmPrecision::kFP8 && fp8_gemms.experts; }
  bool fp8_unembedding() const { return precision == GemmPrecision::kFP8 && fp8_gemms.unembedding; }
  bool fp8_unembedding_wgrad() const {
    return precision == GemmPrecision::kFP8 && fp8_gemms.unembedding_wgrad;
  }
};

// Scalars of one micro-batch, on the device (master dtype, shape [1]) until the trainer reads them.
struct LossSums {
  Tensor lm;   // sum over valid targets of -log p
  Tensor aux;  // sum over MoE layers of the load-balancing loss
};

// What forward() keeps: Pass::kTrain keeps everything backward() needs; Pass::kEval keeps only
// the final hidden states for loss().
enum class Pass { kTrain, kEval };

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
  // they differ). A sharded parameter's master holds its shard only: just those rows of the
  // working copy are written, the caller gathers the rest.
  void refresh_working_copies();
  void zero_grads();

  // ---- one micro-batch: forward, loss, backward (in this order) ------------------------------
  // Embedding, the layers and the final norm of `meta`'s tokens. Adds the MoE load-balancing
  // loss into `aux_sum` ([1], master dtype). Pass::kTrain keeps every layer's activations for
  // backward (with checkpoint_activations only the block inputs, in the activation store, which
  // may offload them to host memory). Before reading a layer's weights it calls
  // param_ready->layer_needed(layer) (-1 first, for the embedding, final norm and unembedding).
  void forward(const BatchMeta& meta, const Tensor& aux_sum, Pass pass = Pass::kTrain,
               ParamReadyHook* param_ready = nullptr);
  // Unembedding + cross-entropy of the last forward's final hidden states, in chunks of
  // ce_chunk_tokens rows, so logits for the whole batch never exist. Adds the sum over valid
  // targets of -log p into `lm_sum`. After a Pass::kTrain forward it also computes, chunk by
  // chunk, the gradient of grad_scale * loss with respect to the final hidden states (kept for
  // backward) and accumulates the unembedding's weight gradient (grad_scale: 1 / the global
  // count of valid targets gives the mean).
  void loss(double grad_scale, const Tensor& lm_sum);
  // Backward of the last Pass::kTrain forward from loss()'s gradient, in reverse layer order,
  // accumulating into the parameters' grad tensors. After each layer's gradients are complete
  // it calls grad_ready->layer_ready(layer), so their reduction overlaps the backward of the
  // layers below; null: nothing to reduce (one rank). Releases what forward kept.
  // leave_unreached (only without grad_ready): the expert matrices' gradients of experts that no
  // row reached are left unwritten and flagged (Param::grad_zero_experts) instead of zero-filled,
  // for an optimizer that reads the flags; fill_unreached_grads writes the zeros.
  void backward(GradReadyHook* grad_ready = nullptr, bool leave_unreached = false);
  // Zero-fills the gradient slices that backward left flagged, and clears the flags.
  void fill_unreached_grads();

  // forward + loss + backward with no gradient reduction (tests, benchmarks). Returns the loss
  // sums, accumulated into `into` when its tensors are given.
  LossSums forward_backward(const BatchMeta& meta, double grad_scale, LossSums into = {});
  // forward(Pass::kEval) + loss (evaluation).
  LossSums evaluate(const BatchMeta& meta, LossSums into = {});
  // forward(Pass::kEval) and the unembedding of every position: [N, vocab] in the act dtype
  // (evaluation tools; the loss path never materializes these).
  Tensor logits(const BatchMeta& meta);

  int expert_begin() const { return expert_begin_; }
  int local_experts() const { return local_experts_; }

 private:
  struct Layer;
  struct LayerActs;
  struct PassState;  // what forward keeps for loss and backward

  void build_params();
  void layer_forward(int l, const BatchMeta& meta, LayerActs& a, bool recompute);
  void layer_backward(int l, LayerActs& a, Tensor& dx);
  void moe_forward(int l, LayerActs& a, bool recompute);
  void moe_backward(int l, LayerActs& a, const Tensor& dy, Tensor& dhn);
  // The gradient of p, under zero_grads' deferred zeroing: grad_beta is the beta for a GEMM that
  // writes all of it (0 the first time: nothing is read), grad_acc the tensor for an op that
  // adds to it (zero-filled first the first time). settle_grads fills what a backward left
  // unwritten, for the parameters of layer l (-1: those outside the layers; -2: all).
  double grad_beta(Param& p);
  Tensor& grad_acc(Param& p);
  void settle_grads(int l);
  // A dense projection's product c = op(a) op(b) (+ beta c) (+ bias) (+ r): FP8 under
  // precision=fp8 with the dense class unless weight_grad (the dW = X^T dY product), else gemm,
  // gemm_bias or gemm_add.
  void dense_gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, double beta,
                  const Tensor& bias, const Tensor& r, bool weight_grad);
  // The unembedding's logits and input-gradient products, c = op(a) op(b): FP8 under
  // precision=fp8 with the unembedding class, else gemm.
  void head_gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c);
  // The unembedding's weight gradient c (+)= aᵀ b (a, b: [tokens, ·]): FP8 with both operands in
  // the data role under precision=fp8 with the unembedding_wgrad class, else gemm.
  void head_weight_grad(const Tensor& a, const Tensor& b, Tensor& c, double beta);
  // gemm_group, or gemm_fp8_group under precision=fp8 with the experts class unless weight_grad.
  void expert_gemms(const std::vector<Backend::GemmProblem>& problems, bool ta, bool tb,
                    double beta, bool weight_grad);
  // Under precision=fp8: hands layer l's FP8-class weights to Backend::hold_fp8_weights, so that
  // each is quantized once for the step's forward, recomputation and input-gradient products;
  // the model releases them when its backward (or an eval forward) ends, before the optimizer
  // writes them.
  void hold_fp8_weights(int l);
  // The spec of the model's FP8 products: its recipe, data times weight.
  Backend::Fp8Gemm fp8_spec() const;
  Tensor new_act(Shape s);
  Tensor new_master(Shape s);

  ModelConfig cfg_;
  ModelOptions opts_;
  Backend& be_;
  std::shared_ptr<ExpertExchange> exchange_;
  ParamRegistry params_;
  std::vector<std::vector<Param*>> params_by_layer_;  // [layer + 1] (settle_grads)
  bool leave_unreached_ = false;                      // during backward(.., leave_unreached)
  std::vector<std::unique_ptr<Layer>> layers_;
  Param* embed_ = nullptr;
  Param* final_norm_ = nullptr;
  Param* lm_head_ = nullptr;  // null when tied
  RopeTable rope_;
  int expert_begin_ = 0;
  int local_experts_ = 0;
  GluParams glu_;                           // the FFN activation, from cfg_.activation
  Tensor aux_sum_;                          // the current micro-batch's aux-loss accumulator
  std::unique_ptr<PassState> pass_;         // set by forward, consumed by loss and backward
  std::unique_ptr<ActivationStore> store_;  // checkpointed block inputs (forward -> backward)
};

}  // namespace hp
