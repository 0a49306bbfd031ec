// Optimizer-level checks: the LR schedule's shape, clipping, and that AdamW on the reference
// backend drives a tiny model to memorize one batch.
#include <gtest/gtest.h>

#include <cmath>

#include "framework/core/rng.h"
#include "framework/model/model.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"

namespace hp {
namespace {

TEST(LrSchedule, WarmupThenCosineToMin) {
  LrSchedule s;
  s.lr = 1.0;
  s.min_lr = 0.1;
  s.warmup_steps = 10;
  s.total_steps = 110;
  EXPECT_DOUBLE_EQ(s.at(1), 0.1);
  EXPECT_DOUBLE_EQ(s.at(5), 0.5);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(60), 0.55, 1e-12);  // halfway through the decay
  EXPECT_NEAR(s.at(110), 0.1, 1e-12);
  EXPECT_NEAR(s.at(500), 0.1, 1e-12);
  for (int64_t t = 11; t < 110; ++t) EXPECT_LE(s.at(t + 1), s.at(t));
}

TEST(Clip, CoefficientOnlyShrinks) {
  EXPECT_DOUBLE_EQ(clip_coefficient(0.5, 1.0), 1.0);
  EXPECT_NEAR(clip_coefficient(4.0, 1.0), 0.25, 1e-6);
  EXPECT_DOUBLE_EQ(clip_coefficient(100.0, 0.0), 1.0);
}

TEST(GradSumSquares, SplitsDenseAndExpertGroups) {
  auto be = make_cpu_backend(DType::kF64);
  ParamRegistry reg;
  Param a;
  a.name = "dense";
  a.shape = a.global_shape = {3};
  Param b;
  b.name = "expert";
  b.shape = b.global_shape = {2, 2};
  b.group = ParamGroup::kExpert;
  Param& pa = reg.add(a);
  Param& pb = reg.add(b);
  pa.grad = be->upload(Tensor::host_from<double>({1, -2, 3}, DType::kF64));
  pb.grad = be->upload(Tensor::host_from<double>({0.5, 0.5, -1, 2}, DType::kF64, {2, 2}));
  Tensor acc = be->zeros({2}, DType::kF64);
  grad_sum_squares(*be, reg, acc);
  auto v = to_double_vector(acc);
  EXPECT_DOUBLE_EQ(v[0], 14.0);
  EXPECT_DOUBLE_EQ(v[1], 5.5);
}

TEST(Overfit, TinyMoeMemorizesOneBatch) {
  auto be = make_cpu_backend(DType::kF32);
  ModelConfig c;
  c.vocab_size = 32;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 8;
  c.n_experts = 4;
  c.top_k = 2;
  c.expert_ffn_dim = 32;
  c.sliding_window = 8;
  c.window_layers = WindowLayers::kEven;
  c.attn_sinks = true;
  c.attn_bias = true;
  c.activation = Activation::kGptOss;
  ModelOptions opts;
  opts.max_positions = 32;
  Model model(c, opts, *be);
  model.init_params(3);
  // Two rows of 32 random tokens, one document each: nothing to learn but the batch itself.
  Philox rng(11, "test.overfit");
  std::vector<int32_t> in, tg, pos;
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 32; ++i) {
      in.push_back(static_cast<int32_t>(rng.below(r * 100 + i, 31)));
      tg.push_back(static_cast<int32_t>(rng.below(1000 + r * 100 + i, 31)));
      pos.push_back(i);
    }
  PackedBatch batch = PackedBatch::from_tokens(in, tg, pos, 32);
  BatchMeta meta = be->upload_batch(batch);
  AdamW opt(AdamWConfig{0.9, 0.95, 1e-8, 0.0});
  double first = 0, last = 0;
  for (int step = 1; step <= 150; ++step) {
    model.zero_grads();
    LossSums s = model.forward_backward(meta, 1.0 / batch.num_valid_targets);
    last = to_double_vector(s.lm)[0] / batch.num_valid_targets;
    if (step == 1) first = last;
    opt.step(*be, model.params(), step, 1e-2, 1.0);
  }
  EXPECT_NEAR(first, std::log(32.0), 0.3);  // starts near uniform
  EXPECT_LT(last, 0.1) << "did not memorize: first=" << first << " last=" << last;
}

}  // namespace
}  // namespace hp
