// The three passes of a micro-batch: forward, loss, backward. Backward tells the gradient-ready
// hook about every layer in reverse order, then the embedding group, each exactly once.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/model/model.h"

namespace hp {
namespace {

ModelConfig dense_config() {
  ModelConfig c;
  c.vocab_size = 13;
  c.d_model = 8;
  c.n_layers = 3;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 4;
  c.ffn_dim = 10;
  c.init_std = 0.5;
  return c;
}

PackedBatch two_docs(int64_t vocab) {
  std::vector<int32_t> inputs, targets, positions;
  for (int i = 0; i < 12; ++i) {
    inputs.push_back(i % static_cast<int32_t>(vocab - 1));
    targets.push_back(i == 5 ? -1 : (i + 1) % static_cast<int32_t>(vocab - 1));
    positions.push_back(i < 6 ? i : i - 6);
  }
  return PackedBatch::from_tokens(inputs, targets, positions, 12);
}

struct Recorder : GradReadyHook {
  std::vector<int> layers;
  void layer_ready(int layer) override { layers.push_back(layer); }
};

TEST(ModelPasses, BackwardCallsTheHookPerLayerInReverseThenTheEmbeddingGroup) {
  auto be = make_cpu_backend(DType::kF32);
  ModelOptions opts;
  opts.max_positions = 16;
  Model model(dense_config(), opts, *be);
  model.init_params(3);
  BatchMeta meta = be->upload_batch(two_docs(13));
  Tensor lm = be->zeros({1}, DType::kF32), aux = be->zeros({1}, DType::kF32);
  Recorder hook;
  model.zero_grads();
  model.forward(meta, aux);
  model.loss(0.1, lm);
  model.backward(&hook);
  EXPECT_EQ(hook.layers, (std::vector<int>{2, 1, 0, -1}));
}

TEST(ModelPasses, TheSplitPassesComputeWhatEvaluateAndForwardBackwardDo) {
  auto be = make_cpu_backend(DType::kF64);
  ModelOptions opts;
  opts.max_positions = 16;
  opts.ce_chunk_tokens = 5;  // several chunks, one ragged
  Model model(dense_config(), opts, *be);
  model.init_params(4);
  BatchMeta meta = be->upload_batch(two_docs(13));
  const LossSums eval = model.evaluate(meta);
  model.zero_grads();
  const LossSums train = model.forward_backward(meta, 0.1);
  EXPECT_EQ(to_double_vector(eval.lm)[0], to_double_vector(train.lm)[0]);
  std::vector<double> g1;
  for (auto& p : model.params().all()) {
    auto v = to_double_vector(p->grad);
    g1.insert(g1.end(), v.begin(), v.end());
  }
  model.zero_grads();
  Tensor lm = be->zeros({1}, DType::kF64), aux = be->zeros({1}, DType::kF64);
  model.forward(meta, aux);
  model.loss(0.1, lm);
  model.backward(nullptr);
  std::vector<double> g2;
  for (auto& p : model.params().all()) {
    auto v = to_double_vector(p->grad);
    g2.insert(g2.end(), v.begin(), v.end());
  }
  EXPECT_EQ(g1, g2);
  EXPECT_EQ(to_double_vector(lm)[0], to_double_vector(train.lm)[0]);
}

TEST(ModelPasses, BackwardWithoutATrainingForwardIsAnError) {
  auto be = make_cpu_backend(DType::kF32);
  ModelOptions opts;
  opts.max_positions = 16;
  Model model(dense_config(), opts, *be);
  model.init_params(3);
  BatchMeta meta = be->upload_batch(two_docs(13));
  model.evaluate(meta);
  EXPECT_THROW(model.backward(nullptr), Error);
}

TEST(ModelPasses, RoutingSyncsAreForwardsOnlyAndLossAndBackwardHaveNone) {
  auto be = make_cpu_backend(DType::kF32);
  ModelConfig cfg = dense_config();
  cfg.n_experts = 4;
  cfg.top_k = 2;
  cfg.expert_ffn_dim = 6;
  ModelOptions opts;
  opts.max_positions = 16;
  opts.checkpoint_activations = true;  // backward recomputes each layer, reusing its plan
  Model model(cfg, opts, *be);
  model.init_params(3);
  BatchMeta meta = be->upload_batch(two_docs(13));
  Tensor lm = be->zeros({1}, DType::kF32), aux = be->zeros({1}, DType::kF32);
  model.zero_grads();
  be->syncs().reset();
  model.forward(meta, aux);
  EXPECT_EQ(be->syncs().get(SyncCause::kRouting), cfg.n_layers);
  EXPECT_EQ(be->syncs().total(), cfg.n_layers);
  be->syncs().reset();
  model.loss(0.1, lm);
  EXPECT_EQ(be->syncs().total(), 0);
  model.backward(nullptr);
  EXPECT_EQ(be->syncs().total(), 0);
}

// zero_grads defers the zeroing to the backward (the first product writes, adders zero-fill
// first, untouched gradients are filled at the end): what the gradient memory held before must
// not matter. Three tokens reach at most 6 of the 8 experts, so some get no rows at all; biases,
// sinks and q/k norms take the adding path; tied and untied embeddings both.
TEST(ModelPasses, ZeroGradsLeavesNothingOfWhatTheGradientMemoryHeld) {
  for (const bool tie : {false, true}) {
    SCOPED_TRACE(tie ? "tied embeddings" : "untied embeddings");
    auto be = make_cpu_backend(DType::kF64);
    ModelConfig cfg = dense_config();
    cfg.n_experts = 8;
    cfg.top_k = 2;
    cfg.expert_ffn_dim = 6;
    cfg.attn_bias = true;
    cfg.attn_sinks = true;
    cfg.qk_norm = true;
    cfg.tie_embeddings = tie;
    ModelOptions opts;
    opts.max_positions = 16;
    Model model(cfg, opts, *be);
    model.init_params(5);
    const BatchMeta meta =
        be->upload_batch(PackedBatch::from_tokens({1, 4, 7}, {4, 7, 2}, {0, 1, 2}, 3));
    auto grads = [&] {
      std::vector<double> g;
      for (auto& p : model.params().all()) {
        auto v = to_double_vector(p->grad);
        g.insert(g.end(), v.begin(), v.end());
      }
      return g;
    };
    model.zero_grads();
    model.forward_backward(meta, 0.5);
    const std::vector<double> clean = grads();
    int64_t nonzero = 0;
    for (double v : clean) nonzero += v != 0;
    EXPECT_GT(nonzero, 0);

    for (auto& p : model.params().all()) be->fill(p->grad, std::nan(""));
    model.zero_grads();
    model.forward_backward(meta, 0.5);
    EXPECT_EQ(grads(), clean) << "a gradient kept what its memory held before zero_grads";

    // A second micro-batch adds to the first.
    for (auto& p : model.params().all()) be->fill(p->grad, 1e30);
    model.zero_grads();
    model.forward_backward(meta, 0.5);
    model.forward_backward(meta, 0.5);
    const std::vector<double> twice = grads();
    ASSERT_EQ(twice.size(), clean.size());
    for (size_t i = 0; i < clean.size(); ++i)
      ASSERT_NEAR(twice[i], 2 * clean[i], 1e-12 * (1 + std::abs(clean[i]))) << "entry " << i;
  }
}

}  // namespace
}  // namespace hp
