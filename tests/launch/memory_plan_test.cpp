// The memory plan: parameter, gradient and optimizer bytes against a count by hand of the
// GPT-OSS shapes, the sharding factor, the tensor list against a built model, device sizes, and
// the refusal of a layout that does not fit with one that does.
#include "launch/train/memory_plan.h"

#include <gtest/gtest.h>

#include <string>

#include "framework/backend/backend.h"
#include "framework/model/model.h"

namespace hp {
namespace {

TrainOptions load(const std::string& ini, std::vector<std::string> extra = {}) {
  TrainOptions o;
  extra.insert(extra.begin(), "--config=" HP_SOURCE_DIR "/examples/configs/" + ini);
  EXPECT_TRUE(parse_train_options(extra, "train", o));
  return o;
}

// GPT-OSS-20b counted by hand from its published shape: 24 layers, d=2880, 64 q / 8 kv heads of
// 64, 32 experts of 2880 with biases, sinks, untied 201088-token embeddings.
struct HandCount {
  int64_t dense = 0, expert = 0;
};
HandCount gptoss20b_by_hand() {
  const int64_t V = 201088, d = 2880, L = 24, E = 32, F = 2880, qkv = (64 + 2 * 8) * 64;
  const int64_t attn = d * qkv + qkv + 64 * 64 * d + d + 64;  // wqkv, bqkv, wo, bo, sinks
  const int64_t per_layer_dense = attn + 2 * d + d * E + E;   // + norms + router
  const int64_t per_layer_expert = E * (d * 2 * F + 2 * F + F * d + d);
  return {2 * V * d + d + L * per_layer_dense, L * per_layer_expert};
}

TEST(MemoryPlan, ParamGradOptimizerBytesMatchAHandCount) {
  const TrainOptions o = load("gptoss-20b.ini");
  const HandCount h = gptoss20b_by_hand();
  ASSERT_EQ(h.dense + h.expert, count_params(o.model).total);
  ASSERT_EQ(h.expert, count_params(o.model).expert);

  PlanLayout none;
  none.world = 8;
  none.ep = 4;  // dp=2 replicas of each expert block
  const MemoryPlan p = plan_memory(o, none, /*cuda=*/true);
  const int64_t local = h.dense + h.expert / 4;
  EXPECT_EQ(p.dense_numel, h.dense);
  EXPECT_EQ(p.expert_numel_local, h.expert / 4);
  EXPECT_EQ(p.params, 2 * local);      // bf16 working copies
  EXPECT_EQ(p.grads, 4 * local);       // fp32 gradients
  EXPECT_EQ(p.optimizer, 12 * local);  // fp32 master + two moments

  PlanLayout zero1 = none;
  zero1.sharding = OptimizerSharding::kZero1;
  const MemoryPlan z = plan_memory(o, zero1, true);
  // Dense state over the 8 ranks, expert state over the 2 that hold the same experts (every
  // GPT-OSS-20b tensor divides evenly).
  EXPECT_EQ(z.shard_numel, h.dense / 8 + h.expert / 4 / 2);
  EXPECT_EQ(z.optimizer, 12 * (h.dense / 8 + h.expert / 8));
  EXPECT_EQ(z.params, p.params);
  EXPECT_EQ(z.grads, p.grads);
  EXPECT_LT(z.total, p.total);

  // The CPU backend computes with its fp32 master, a separate whole copy only once zero1 splits
  // the master.
  const MemoryPlan c = plan_memory(o, zero1, /*cuda=*/false);
  EXPECT_EQ(c.params, 4 * local);
  EXPECT_EQ(c.optimizer, 12 * (h.dense / 8 + h.expert / 8));
  EXPECT_EQ(plan_memory(o, none, false).params, 0);
  EXPECT_EQ(plan_memory(o, none, false).optimizer, 12 * local);
  EXPECT_EQ(c.rounding, 0);
  EXPECT_EQ(c.reserve, 0);
}

TEST(MemoryPlan, OptimizerStateFallsByTheShardingFactor) {
  const TrainOptions o = load("tiny-dense.ini");
  for (const int world : {2, 4}) {
    PlanLayout l;
    l.world = world;
    const int64_t full = plan_memory(o, l, false).optimizer;
    l.sharding = OptimizerSharding::kZero1;
    const int64_t sharded = plan_memory(o, l, false).optimizer;
    // Every tiny-dense tensor's rows divide by 2 and 4.
    EXPECT_EQ(sharded * world, full);
  }
}

TEST(MemoryPlan, TensorListIsWhatTheModelAllocates) {
  for (const char* ini : {"tiny-moe.ini", "tiny-dense.ini"}) {
    TrainOptions o = load(ini);
    o.model.qk_norm = !o.model.is_moe();  // Qwen3's q/k norms on the dense one
    auto be = make_cpu_backend(DType::kF32);
    ModelOptions mo;
    mo.max_positions = 64;
    Model model(o.model, mo, *be);
    const std::vector<ParamTensor> list = param_tensors(o.model);
    ASSERT_EQ(list.size(), model.params().all().size()) << ini;
    for (size_t i = 0; i < list.size(); ++i) {
      const Param& p = *model.params().all()[i];
      EXPECT_EQ(list[i].numel, p.global_numel()) << ini << " " << p.name;
      EXPECT_EQ(list[i].rows, p.global_shape[0]) << ini << " " << p.name;
      EXPECT_EQ(list[i].experts > 0, p.group == ParamGroup::kExpert) << ini << " " << p.name;
    }
  }
}

TEST(MemoryPlan, DeviceSizesByNumberNameOrOff) {
  TrainOptions o = load("tiny-moe.ini");
  const double gib = 1024.0 * 1024 * 1024;
  EXPECT_EQ(planned_device_bytes(o, 123), 123);  // auto: the visible GPU's
  o.device.memory = parse_device_memory("off");
  EXPECT_EQ(planned_device_bytes(o, 123), 0);
  o.device.memory = parse_device_memory("80");
  EXPECT_EQ(planned_device_bytes(o, 123), static_cast<int64_t>(80 * gib));
  o.device.memory = parse_device_memory("H200");
  EXPECT_EQ(planned_device_bytes(o, 0), static_cast<int64_t>(140.4 * gib));
  for (const char* bad : {"lots", "-3", "0", "nan", "12GB"}) {
    try {
      parse_device_memory(bad);
      ADD_FAILURE() << bad << " accepted";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("device_memory_gib"), std::string::npos) << e.what();
    }
  }
}

TEST(MemoryPlan, ALayoutThatDoesNotFitIsRefusedWithOneThatDoes) {
  const TrainOptions o = load("gptoss-20b.ini", {"--batch_tokens=131072"});
  const int64_t h200 = static_cast<int64_t>(140.4 * 1024 * 1024 * 1024);
  const PlanLayout one = layout_of(o, 1);
  const MemoryPlan p = plan_memory(o, one, true);
  ASSERT_GT(p.total, h200);
  const PlanLayout fit = smallest_fitting_layout(o, one, h200, true);
  ASSERT_GT(fit.world, 1);
  EXPECT_LE(plan_memory(o, fit, true).total, h200);
  // Half as many ranks do not fit, even with every saving at once.
  for (int ep = 1; ep <= fit.world / 2; ep *= 2) {
    PlanLayout half;
    half.world = fit.world / 2;
    half.ep = ep;
    half.sharding = OptimizerSharding::kZero1;
    half.checkpoint_activations = true;
    half.offload = OffloadMode::kDouble;
    EXPECT_GT(plan_memory(o, half, true).total, h200) << half.describe();
  }
  try {
    require_plan_fits(o, p, h200);
    ADD_FAILURE() << "a 1-rank GPT-OSS-20b was accepted on one H200";
  } catch (const UserError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("smallest layout that fits: " + fit.describe()), std::string::npos) << what;
    EXPECT_NE(what.find("optimizer state"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(require_plan_fits(o, plan_memory(o, fit, true), h200));
  EXPECT_NO_THROW(require_plan_fits(o, p, 0));  // off: no check
}

}  // namespace
}  // namespace hp
