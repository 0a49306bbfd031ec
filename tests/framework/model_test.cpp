// Whole-model checks on the CPU reference: finite-difference gradients of every parameter
// (double precision) for dense and MoE models with sinks and sliding windows, overfitting one
// batch, and the sync budget of the hot-path rules.
#include "framework/model/model.h"

#include <gtest/gtest.h>

#include <cmath>

#include "framework/core/rng.h"

namespace hp {
namespace {

// Three rows of T = 12 tokens: documents of several lengths, a single-token document, padding.
PackedBatch tiny_batch(int64_t vocab, uint64_t seed) {
  const int64_t T = 12;
  Philox rng(seed, "test.batch");
  std::vector<int32_t> inputs, targets, positions;
  const std::vector<std::vector<int>> docs_per_row = {{5, 7}, {1, 4, 7}, {12}};
  uint64_t ctr = 0;
  for (const auto& row : docs_per_row) {
    std::vector<int32_t> toks;
    std::vector<int32_t> pos;
    std::vector<bool> last;
    for (int len : row) {
      for (int i = 0; i < len; ++i) {
        toks.push_back(static_cast<int32_t>(rng.below(ctr++, vocab - 1)));
        pos.push_back(i);
        last.push_back(i == len - 1);
      }
    }
    for (int64_t i = 0; i < T; ++i) {
      inputs.push_back(toks[i]);
      positions.push_back(pos[i]);
      targets.push_back(last[i] ? -1 : static_cast<int32_t>(rng.below(ctr++, vocab)));
    }
  }
  return PackedBatch::from_tokens(inputs, targets, positions, T);
}

ModelConfig tiny_moe_config() {
  ModelConfig c;
  c.vocab_size = 11;
  c.d_model = 8;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 4;
  c.n_experts = 4;
  c.top_k = 2;
  c.expert_ffn_dim = 6;
  c.sliding_window = 3;
  c.window_layers = WindowLayers::kEven;
  c.attn_sinks = true;
  c.attn_bias = true;
  c.activation = Activation::kGptOss;
  c.swiglu_limit = 1.0;  // small enough that the clamps are active at this init scale
  c.moe_aux_coef = 0.05;
  c.init_std = 0.5;
  return c;
}

ModelConfig tiny_dense_config() {
  ModelConfig c;
  c.vocab_size = 13;
  c.d_model = 8;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 4;
  c.ffn_dim = 10;
  c.tie_embeddings = true;
  c.init_std = 0.5;
  return c;
}

// The scalar the trainer minimizes: mean cross-entropy plus the aux loss.
double objective(Model& model, const BatchMeta& meta, int64_t valid) {
  LossSums s = model.evaluate(meta);
  Tensor h = Tensor::host({1}, DType::kF64);
  Backend& be = model.backend();
  be.copy(s.lm, h);
  double lm = h.data<double>()[0];
  be.copy(s.aux, h);
  return lm / static_cast<double>(valid) + h.data<double>()[0];
}

void check_model_gradients(const ModelConfig& cfg, bool checkpoint) {
  auto be = make_cpu_backend(DType::kF64);
  ModelOptions opts;
  opts.checkpoint_activations = checkpoint;
  opts.ce_chunk_tokens = 7;  // several chunks, one ragged
  opts.max_positions = 16;
  Model model(cfg, opts, *be);
  model.init_params(42);
  PackedBatch batch = tiny_batch(cfg.vocab_size, 7);
  BatchMeta meta = be->upload_batch(batch);
  const int64_t valid = batch.num_valid_targets;
  ASSERT_GT(valid, 0);

  model.zero_grads();
  model.forward_backward(meta, 1.0 / static_cast<double>(valid));
  const double h = 1e-6;
  for (auto& p : model.params().all()) {
    double* w = p->master.data<double>();
    const double* g = p->grad.data<double>();
    double num2 = 0, ana2 = 0, diff2 = 0;
    for (int64_t i = 0; i < p->numel(); ++i) {
      const double orig = w[i];
      w[i] = orig + h;
      const double lp = objective(model, meta, valid);
      w[i] = orig - h;
      const double lm = objective(model, meta, valid);
      w[i] = orig;
      const double num = (lp - lm) / (2 * h);
      num2 += num * num;
      ana2 += g[i] * g[i];
      diff2 += (num - g[i]) * (num - g[i]);
    }
    const double scale = std::max({std::sqrt(num2), std::sqrt(ana2), 1e-8});
    EXPECT_LE(std::sqrt(diff2) / scale, 1e-4)
        << p->name << ": |analytic|=" << std::sqrt(ana2) << " |numeric|=" << std::sqrt(num2);
    // A parameter whose gradient is identically zero would make this check vacuous.
    EXPECT_GT(std::sqrt(ana2), 0.0) << p->name << " received no gradient";
  }
}

TEST(ModelGrad, MoeWithSinksWindowBiasesMatchesFiniteDifferences) {
  check_model_gradients(tiny_moe_config(), false);
}

TEST(ModelGrad, MoeWithActivationCheckpointingMatchesFiniteDifferences) {
  check_model_gradients(tiny_moe_config(), true);
}

TEST(ModelGrad, DenseTiedMatchesFiniteDifferences) {
  check_model_gradients(tiny_dense_config(), false);
}

// Qwen3's q/k norms, fused with rope both ways (qk_norm_rope_fwd, qk_norm_rope_bwd in place).
TEST(ModelGrad, DenseQkNormMatchesFiniteDifferences) {
  ModelConfig cfg = tiny_dense_config();
  cfg.qk_norm = true;
  check_model_gradients(cfg, false);
}

TEST(ModelSyncs, CachedMetadataNeedsNoSyncAndRoutingOnePerMoeLayer) {
  auto be = make_cpu_backend(DType::kF32);
  ModelConfig cfg = tiny_moe_config();
  ModelOptions opts;
  opts.max_positions = 16;
  Model model(cfg, opts, *be);
  model.init_params(1);
  PackedBatch batch = tiny_batch(cfg.vocab_size, 3);
  BatchMeta meta = be->upload_batch(batch);
  be->syncs().reset();
  model.forward_backward(meta, 1.0);
  EXPECT_EQ(be->syncs().get(SyncCause::kMetadata), 0);
  EXPECT_EQ(be->syncs().get(SyncCause::kRouting), cfg.n_layers);  // forward only; 0 in backward
  EXPECT_EQ(be->syncs().get(SyncCause::kOther), 0);
}

TEST(ModelSyncs, CheckpointedRecomputeReusesTheRoutingPlan) {
  auto be = make_cpu_backend(DType::kF32);
  ModelConfig cfg = tiny_moe_config();
  ModelOptions opts;
  opts.max_positions = 16;
  opts.checkpoint_activations = true;
  Model model(cfg, opts, *be);
  model.init_params(1);
  PackedBatch batch = tiny_batch(cfg.vocab_size, 3);
  BatchMeta meta = be->upload_batch(batch);
  be->syncs().reset();
  model.forward_backward(meta, 1.0);
  EXPECT_EQ(be->syncs().get(SyncCause::kRouting), cfg.n_layers);
}

TEST(ModelSyncs, BaselinesCostOneSyncPerLayerAndPerExpert) {
  auto be = make_cpu_backend(DType::kF32);
  ModelConfig cfg = tiny_moe_config();
  ModelOptions opts;
  opts.max_positions = 16;
  opts.metadata = MetadataMode::kPerLayer;
  opts.routing = RoutingMode::kPerExpert;
  Model model(cfg, opts, *be);
  model.init_params(1);
  PackedBatch batch = tiny_batch(cfg.vocab_size, 3);
  BatchMeta meta = be->upload_batch(batch);
  be->syncs().reset();
  model.forward_backward(meta, 1.0);
  EXPECT_EQ(be->syncs().get(SyncCause::kMetadata), cfg.n_layers);
  EXPECT_EQ(be->syncs().get(SyncCause::kRouting), cfg.n_layers * cfg.n_experts);
}

TEST(ModelGrad, BaselineModesComputeTheSameLossAndGradients) {
  // per-layer metadata and per-expert routing are slower paths to the same numbers.
  ModelConfig cfg = tiny_moe_config();
  std::vector<std::vector<double>> grads;
  std::vector<double> losses;
  for (int variant = 0; variant < 2; ++variant) {
    auto be = make_cpu_backend(DType::kF64);
    ModelOptions opts;
    opts.max_positions = 16;
    if (variant == 1) {
      opts.metadata = MetadataMode::kPerLayer;
      opts.routing = RoutingMode::kPerExpert;
    }
    Model model(cfg, opts, *be);
    model.init_params(5);
    PackedBatch batch = tiny_batch(cfg.vocab_size, 9);
    BatchMeta meta = be->upload_batch(batch);
    model.zero_grads();
    LossSums s = model.forward_backward(meta, 0.1);
    losses.push_back(to_double_vector(s.lm)[0]);
    std::vector<double> g;
    for (auto& p : model.params().all()) {
      auto v = to_double_vector(p->grad);
      g.insert(g.end(), v.begin(), v.end());
    }
    grads.push_back(g);
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(grads[0], grads[1]);
}

}  // namespace
}  // namespace hp
