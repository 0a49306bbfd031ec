// The three passes of a micro-batch: forward, loss, backward. Backward tells the gradient-ready
// hook about every layer in reverse order, then the embedding group, each exactly once.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace hp
