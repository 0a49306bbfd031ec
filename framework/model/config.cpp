#include "framework/model/config.h"

#include <cmath>
#include <cstdint>
#include <utility>

#include "framework/core/error.h"

namespace hp {

int ModelConfig::window_for_layer(int layer) const {
  switch (window_layers) {
    case WindowLayers::kNone:
      return 0;
    case WindowLayers::kAll:
      return sliding_window;
    case WindowLayers::kEven:
      return layer % 2 == 0 ? sliding_window : 0;
  }
  return 0;
}

namespace {
void require(bool ok, const char* key, const std::string& rule) {
  if (!ok) HP_USER_ERROR(ErrorKind::kConfig, "config key '", key, "': ", rule);
}
constexpr int kMaxDim = 1 << 20;
constexpr double kMaxParams = 1e15;
// A real number that must be finite and > 0 (inf and nan never pass).
void require_positive(double v, const char* key) {
  require(std::isfinite(v) && v > 0, key, str_cat("must be finite and > 0, got ", v));
}
}  // namespace

void ModelConfig::validate() const {
  require(vocab_size >= 2, "vocab_size", str_cat("must be >= 2, got ", vocab_size));
  require(d_model > 0, "d_model", str_cat("must be > 0, got ", d_model));
  require(n_layers > 0, "n_layers", str_cat("must be > 0, got ", n_layers));
  require(n_heads > 0, "n_heads", str_cat("must be > 0, got ", n_heads));
  require(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "n_kv_heads",
          str_cat("must divide n_heads=", n_heads, ", got ", n_kv_heads));
  require(head_dim > 0 && head_dim % 2 == 0, "head_dim",
          str_cat("must be a positive even number (RoPE rotates pairs), got ", head_dim));
  if (is_moe()) {
    require(top_k >= 1 && top_k <= n_experts, "top_k",
            str_cat("must be in [1, n_experts=", n_experts, "], got ", top_k));
    require(expert_ffn_dim > 0, "expert_ffn_dim",
            str_cat("must be > 0 with n_experts > 0, got ", expert_ffn_dim));
  } else {
    require(n_experts == 0, "n_experts", "must be >= 0");
    require(ffn_dim > 0, "ffn_dim", str_cat("must be > 0 for a dense model, got ", ffn_dim));
  }
  require(sliding_window >= 0, "sliding_window", str_cat("must be >= 0, got ", sliding_window));
  require(window_layers == WindowLayers::kNone || sliding_window > 0, "sliding_window",
          "must be > 0 when window_layers is 'even' or 'all'");
  // Token ids are int32 everywhere (batches, shards); no dimension may overflow an int either.
  require(vocab_size <= INT32_MAX, "vocab_size",
          str_cat("must be <= 2147483647 (token ids are int32), got ", vocab_size));
  require_positive(swiglu_alpha, "swiglu_alpha");
  require_positive(swiglu_limit, "swiglu_limit");
  require_positive(rope_theta, "rope_theta");
  require(std::isfinite(rope_scaling_factor) && rope_scaling_factor >= 1.0, "rope_scaling_factor",
          str_cat("must be finite and >= 1 (1 disables YaRN), got ", rope_scaling_factor));
  if (rope_scaling_factor > 1.0) {
    require(std::isfinite(rope_original_max_positions) && rope_original_max_positions >= 1,
            "rope_original_max_positions",
            str_cat("must be >= 1 with rope_scaling_factor > 1 (YaRN: the context length the "
                    "model was trained with), got ",
                    rope_original_max_positions));
    require_positive(rope_beta_fast, "rope_beta_fast");
    require_positive(rope_beta_slow, "rope_beta_slow");
  }
  require_positive(norm_eps, "norm_eps");
  require(std::isfinite(moe_aux_coef) && moe_aux_coef >= 0, "moe_aux_coef",
          str_cat("must be finite and >= 0, got ", moe_aux_coef));
  require_positive(init_std, "init_std");
  // Sizes whose parameter count would overflow the int64 arithmetic of the model and its
  // buffers are refused here (in doubles, which cannot overflow at these sizes).
  for (const auto& kv :
       {std::make_pair("d_model", d_model), std::make_pair("ffn_dim", ffn_dim),
        std::make_pair("expert_ffn_dim", expert_ffn_dim), std::make_pair("head_dim", head_dim),
        std::make_pair("n_heads", n_heads), std::make_pair("n_layers", n_layers),
        std::make_pair("n_experts", n_experts)})
    require(kv.second <= kMaxDim, kv.first, str_cat("must be <= ", kMaxDim, ", got ", kv.second));
  const double d = d_model, hd = head_dim;
  const double ffn = is_moe() ? double(n_experts) * 3 * d * expert_ffn_dim : 3 * d * ffn_dim;
  const double params =
      double(n_layers) * (d * (n_heads + 2.0 * n_kv_heads) * hd + n_heads * hd * d + ffn) +
      2 * double(vocab_size) * d;
  require(params <= kMaxParams, "d_model",
          str_cat("the model would have about ", params, " parameters, more than ", kMaxParams,
                  " (check vocab_size, d_model, n_layers, n_experts and the FFN sizes)"));
}

ParamCounts count_params(const ModelConfig& c) {
  const int64_t d = c.d_model, hd = c.head_dim, hq = c.n_heads, hkv = c.n_kv_heads;
  const int64_t qkv_out = (hq + 2 * hkv) * hd;
  int64_t attn = d * qkv_out + hq * hd * d;
  if (c.attn_bias) attn += qkv_out + d;
  if (c.attn_sinks) attn += hq;
  if (c.qk_norm) attn += 2 * hd;
  const int64_t norms = 2 * d;
  int64_t ffn_total = 0, ffn_active = 0;
  if (c.is_moe()) {
    const int64_t f = c.expert_ffn_dim, e = c.n_experts;
    const int64_t router = d * e + e;
    const int64_t per_expert = d * 2 * f + 2 * f + f * d + d;
    ffn_total = router + e * per_expert;
    ffn_active = router + c.top_k * per_expert;
  } else {
    ffn_total = ffn_active = d * 2 * c.ffn_dim + c.ffn_dim * d;
  }
  const int64_t embed = c.vocab_size * d;
  const int64_t unembed = c.tie_embeddings ? 0 : c.vocab_size * d;
  ParamCounts pc;
  pc.total = c.n_layers * (attn + norms + ffn_total) + d + embed + unembed;
  if (c.is_moe())
    pc.expert = static_cast<int64_t>(c.n_layers) * c.n_experts *
                (d * 2 * c.expert_ffn_dim + 2 * c.expert_ffn_dim + c.expert_ffn_dim * d + d);
  // A tied table still multiplies every token at the output, so it counts as active once.
  pc.active = c.n_layers * (attn + norms + ffn_active) + d + c.vocab_size * d;
  return pc;
}

std::vector<ParamTensor> param_tensors(const ModelConfig& c) {
  const int64_t d = c.d_model, hd = c.head_dim, hq = c.n_heads, hkv = c.n_kv_heads;
  const int64_t qkv_out = (hq + 2 * hkv) * hd;
  std::vector<ParamTensor> t;
  auto dense = [&](int64_t rows, int64_t cols) { t.push_back({rows * cols, rows, 0}); };
  dense(c.vocab_size, d);  // tok_embeddings
  for (int l = 0; l < c.n_layers; ++l) {
    dense(d, 1);  // attn_norm
    dense(d, qkv_out);
    if (c.attn_bias) dense(qkv_out, 1);
    if (c.qk_norm) {
      dense(hd, 1);
      dense(hd, 1);
    }
    dense(hq * hd, d);
    if (c.attn_bias) dense(d, 1);
    if (c.attn_sinks) dense(hq, 1);
    dense(d, 1);  // ffn_norm
    if (c.is_moe()) {
      const int64_t e = c.n_experts, f = c.expert_ffn_dim;
      dense(d, e);
      dense(e, 1);
      for (const int64_t per_expert : {d * 2 * f, 2 * f, f * d, d})
        t.push_back({e * per_expert, e, e});
    } else {
      dense(d, 2 * static_cast<int64_t>(c.ffn_dim));
      dense(c.ffn_dim, d);
    }
  }
  dense(d, 1);  // final_norm
  if (!c.tie_embeddings) dense(d, c.vocab_size);
  return t;
}

}  // namespace hp
