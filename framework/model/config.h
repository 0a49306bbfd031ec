// ModelConfig: one typed description for the whole model family — GPT-OSS 20b/120b (MoE, sinks,
// sliding window on even layers, biases, clamped SwiGLU), Llama-3.2 and Qwen3 (dense SwiGLU,
// Qwen3's per-head q/k RMSNorm). The math is docs/architecture.md, "The model".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hp {

enum class WindowLayers { kNone, kEven, kAll };

// The FFN activation: SwiGLU (Llama, Qwen) or GPT-OSS's clamped SwiGLU (swiglu_alpha, _limit).
enum class Activation { kSwiGLU, kGptOss };

struct ModelConfig {
  int64_t vocab_size = 0;
  int d_model = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int ffn_dim = 0;    // dense FFN hidden size (unused when n_experts > 0)
  int n_experts = 0;  // > 0: every layer's FFN is a mixture of experts
  int top_k = 0;
  int expert_ffn_dim = 0;
  int sliding_window = 0;  // W; applies on the layers picked by window_layers
  WindowLayers window_layers = WindowLayers::kNone;
  bool attn_sinks = false;
  bool attn_bias = false;
  bool qk_norm = false;
  bool tie_embeddings = false;
  Activation activation = Activation::kSwiGLU;  // key `activation`: swiglu | gptoss
  double swiglu_alpha = 1.702;
  double swiglu_limit = 7.0;
  double rope_theta = 10000.0;
  double rope_scaling_factor = 1.0;  // YaRN when > 1
  double rope_original_max_positions = 4096;
  double rope_beta_fast = 32;
  double rope_beta_slow = 1;
  // YaRN: round the ramp's ends outward to whole pairs (Hugging Face's default; GPT-OSS: false).
  bool rope_truncate = false;
  double norm_eps = 1e-5;
  double moe_aux_coef = 0.0;
  double init_std = 0.02;

  bool is_moe() const { return n_experts > 0; }
  int window_for_layer(int layer) const;
  // Throws UserError(kConfig) naming the key and the rule broken.
  void validate() const;
};

struct ParamCounts {
  int64_t total = 0;   // every parameter
  int64_t active = 0;  // what one token multiplies: attention, router, top-k experts or dense FFN,
                       // norms, unembedding (not the embedding table)
  int64_t expert = 0;  // the stacked expert weights (split over the ep group); the rest is dense
};
ParamCounts count_params(const ModelConfig& c);

// The parameter tensors of a model by global element count, in the order the model allocates
// them, for plans that count bytes tensor by tensor (allocators round each one).
struct ParamTensor {
  int64_t numel = 0;    // global
  int64_t rows = 0;     // global leading dimension (experts: the expert count)
  int64_t experts = 0;  // > 0: stacked [experts, ...], split over the ep group
};
std::vector<ParamTensor> param_tensors(const ModelConfig& c);

}  // namespace hp
