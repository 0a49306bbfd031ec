// The model under precision=fp8 on the CPU reference (docs/design.md, "FP8 training"): each class
// fp8_gemms names changes the results and the other classes' do not leak in, only forward and
// input-gradient products are FP8 (weight gradients are the products bf16 runs), FP8 steps are
// bitwise reproducible, the recompute of a checkpointed layer quantizes exactly as its forward
// did, and the loss and gradients stay close to the unquantized ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "framework/model/model.h"
#include "tests/common/fixtures.h"
#include "tests/framework/fp8_forwarding_backend.h"
#include "tests/common/one_thread.h"

namespace hp {
namespace {

// The runs here are small: each test runs on one OpenMP thread (tests/common/one_thread.h).
using test::OneThread;

// A 2-layer MoE whose projections cross the 128 blocks along K (d_model 160) and whose batch
// (192 tokens) has one full and one partial block of tokens for the weight gradients.
ModelConfig config() {
  ModelConfig c;
  c.vocab_size = 32;
  c.d_model = 160;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 40;
  c.ffn_dim = 96;
  return test::gptoss_like_moe(c, 4, 2, 96, 16);
}

struct Result {
  double loss = 0;
  std::vector<std::vector<char>> grads;  // every parameter's gradient bytes, in model order
  std::vector<double> grad_norms;
  std::vector<std::string> names;
};

Result step(GemmPrecision precision, Fp8GemmClasses classes, bool checkpoint = false) {
  auto be = make_cpu_backend(DType::kF32);
  const ModelConfig cfg = config();
  ModelOptions opts;
  opts.max_positions = 64;
  opts.precision = precision;
  opts.fp8_gemms = classes;
  opts.checkpoint_activations = checkpoint;
  Model model(cfg, opts, *be);
  model.init_params(11);
  const PackedBatch batch = test::synthetic_batch(cfg, 5, 64, 3, 20.0);
  BatchMeta meta = be->upload_batch(batch);
  model.zero_grads();
  const LossSums sums = model.forward_backward(meta, 1.0 / batch.num_doc_tokens);
  Result r;
  r.loss = sums.lm.data<float>()[0] / batch.num_doc_tokens;
  for (auto& p : model.params().all()) {
    const char* b = p->grad.data<char>();
    r.grads.emplace_back(b, b + p->grad.nbytes());
    double s = 0;
    for (int64_t i = 0; i < p->grad.numel(); ++i) s += std::pow(p->grad.data<float>()[i], 2);
    r.grad_norms.push_back(std::sqrt(s));
    r.names.push_back(p->name);
  }
  return r;
}

Fp8GemmClasses classes(bool dense, bool experts, bool unembedding = false, bool wgrad = false) {
  Fp8GemmClasses c;
  c.dense = dense;
  c.experts = experts;
  c.unembedding = unembedding;
  c.unembedding_wgrad = wgrad;
  return c;
}

TEST(Fp8Model, EachClassQuantizesItsOwnProducts) {
  OneThread one;
  const Result ref = step(GemmPrecision::kBF16, classes(true, true));
  const Result dense = step(GemmPrecision::kFP8, classes(true, false));
  const Result experts = step(GemmPrecision::kFP8, classes(false, true));
  const Result both = step(GemmPrecision::kFP8, classes(true, true));
  const Result head = step(GemmPrecision::kFP8, classes(false, false, true));
  const Result all = step(GemmPrecision::kFP8, classes(true, true, true));
  const Result wgrad = step(GemmPrecision::kFP8, classes(false, false, false, true));
  // precision=bf16 ignores fp8_gemms: its result is the classes-off one.
  const Result ref_off = step(GemmPrecision::kBF16, classes(false, false));
  const Result ref_all = step(GemmPrecision::kBF16, classes(true, true, true, true));
  EXPECT_EQ(ref.loss, ref_all.loss);
  EXPECT_EQ(ref.grads, ref_all.grads);
  EXPECT_EQ(ref.loss, ref_off.loss);
  EXPECT_EQ(ref.grads, ref_off.grads);
  // Each setting changes the loss, and both classes together differ from each alone.
  EXPECT_NE(dense.loss, ref.loss);
  EXPECT_NE(experts.loss, ref.loss);
  EXPECT_NE(both.loss, dense.loss);
  EXPECT_NE(both.loss, experts.loss);
  EXPECT_NE(head.loss, ref.loss);
  EXPECT_NE(all.loss, both.loss);
  // The unembedding's weight gradient comes after the loss and feeds nothing else: the loss and
  // every other gradient are bf16's bits, lm_head's gradient is not.
  EXPECT_EQ(wgrad.loss, ref.loss);
  ASSERT_EQ(wgrad.names, ref.names);
  int64_t heads = 0;
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    if (ref.names[i] == "lm_head") {
      ++heads;
      EXPECT_NE(wgrad.grads[i], ref.grads[i]);
    } else {
      EXPECT_EQ(wgrad.grads[i], ref.grads[i]) << ref.names[i];
    }
  }
  EXPECT_EQ(heads, 1);
  // Close to the unquantized step: the loss within 1%; the whole gradient within 10% of its norm
  // (E4M3 carries about 5% rms error per product), and each parameter's gradient norm within
  // 10% where that norm is at least 1% of the largest (the router biases' gradients are sums
  // that nearly cancel, a thousandth of the others, where a small change is a large ratio).
  const double max_norm = *std::max_element(ref.grad_norms.begin(), ref.grad_norms.end());
  for (const Result* r : {&dense, &experts, &both, &head, &all, &wgrad}) {
    EXPECT_LT(std::fabs(r->loss - ref.loss) / ref.loss, 0.01);
    double diff2 = 0, ref2 = 0;
    for (size_t i = 0; i < ref.grads.size(); ++i) {
      const auto* g = reinterpret_cast<const float*>(r->grads[i].data());
      const auto* g0 = reinterpret_cast<const float*>(ref.grads[i].data());
      for (size_t j = 0; j < ref.grads[i].size() / sizeof(float); ++j) {
        diff2 += std::pow(double(g[j]) - g0[j], 2);
        ref2 += std::pow(double(g0[j]), 2);
      }
      if (ref.grad_norms[i] < 0.01 * max_norm) continue;
      EXPECT_LT(std::fabs(r->grad_norms[i] - ref.grad_norms[i]) / ref.grad_norms[i], 0.1)
          << ref.names[i] << ": " << r->grad_norms[i] << " vs " << ref.grad_norms[i];
    }
    EXPECT_GT(diff2, 0.0);
    EXPECT_LT(std::sqrt(diff2 / ref2), 0.1);
  }
}

TEST(Fp8Model, StepsAreBitwiseReproducibleAndRecomputeMatchesForward) {
  OneThread one;
  const Result a = step(GemmPrecision::kFP8, classes(true, true));
  const Result b = step(GemmPrecision::kFP8, classes(true, true));
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.grads, b.grads);
  // With checkpointing each layer's forward runs again in backward; its FP8 products quantize
  // the same values, so every gradient is bitwise the one of the run that kept its activations.
  const Result ckpt = step(GemmPrecision::kFP8, classes(true, true), true);
  EXPECT_EQ(ckpt.loss, a.loss);
  EXPECT_EQ(ckpt.grads, a.grads);
}

// Which op wrote each gradient of one step, and every FP8 product, through a backend that records
// them.
struct Recorded {
  // Per parameter: the ops of the products whose output lies in its gradient, in order.
  std::map<std::string, std::vector<std::string>> grad_ops;
  std::vector<test::Fp8ForwardingBackend::Gemm> fp8;  // every FP8 product
  int64_t other = 0;                                  // products into neither
  int64_t holds = 0, releases = 0, held_after = 0;    // hold_fp8_weights; held after the step
  int64_t glu_fp8 = 0, ce_fp8 = 0;                    // GLUs, losses handing their output on
  int64_t handed_taken = 0;                           // hand-ons the next product took
};

Recorded record_step(const ModelConfig& cfg, GemmPrecision precision, Fp8GemmClasses classes,
                     fp8::Recipe recipe, bool checkpoint = false) {
  auto cpu = make_cpu_backend(DType::kF32);
  test::Fp8ForwardingBackend be(*cpu);
  ModelOptions opts;
  opts.max_positions = 64;
  opts.precision = precision;
  opts.fp8_gemms = classes;
  opts.fp8_recipe = recipe;
  opts.checkpoint_activations = checkpoint;
  Model model(cfg, opts, be);
  model.init_params(11);
  const PackedBatch batch = test::synthetic_batch(cfg, 5, 64, 3, 20.0);
  BatchMeta meta = be.upload_batch(batch);
  model.zero_grads();
  model.forward_backward(meta, 1.0 / batch.num_doc_tokens);
  Recorded r;
  r.holds = be.holds;
  r.releases = be.releases;
  r.held_after = static_cast<int64_t>(be.held.size());
  r.glu_fp8 = be.glu_fp8;
  r.ce_fp8 = be.ce_fp8;
  r.handed_taken = be.handed_taken;
  for (const auto& g : be.gemms) {
    const Param* into = nullptr;
    for (auto& p : model.params().all()) {
      const char* b = p->grad.data<char>();
      if (g.c >= b && g.c < b + p->grad.nbytes()) into = p.get();
    }
    const bool fp8 = g.op == "gemm_fp8" || g.op == "gemm_fp8_group";
    if (fp8) r.fp8.push_back(g);
    if (into)
      r.grad_ops[into->name].push_back(g.op);
    else if (!fp8)
      ++r.other;
  }
  return r;
}

ModelConfig dense_config() {
  ModelConfig c = config();
  c.n_experts = 0;
  c.top_k = 0;
  c.expert_ffn_dim = 0;
  return c;
}

// Under fp8 the forward and input-gradient products of the FP8 classes are FP8 ({data, weight},
// the model's recipe): 2 per projection per layer, 4 per expert chunk (its gate_up and down,
// forward and input gradient; one weight-gradient product each into w1 and w2). Every weight
// gradient is the product bf16 runs, op for op, and no FP8 product writes a gradient.
TEST(Fp8Model, OnlyForwardAndInputGradientProductsAreFp8) {
  OneThread one;
  for (const bool moe : {true, false}) {
    const ModelConfig cfg = moe ? config() : dense_config();
    const Recorded bf16 =
        record_step(cfg, GemmPrecision::kBF16, classes(true, true), fp8::Recipe::kBlock128);
    const Recorded fp8 =
        record_step(cfg, GemmPrecision::kFP8, classes(true, true), fp8::Recipe::kMx32);
    EXPECT_TRUE(bf16.fp8.empty());
    EXPECT_EQ(fp8.grad_ops, bf16.grad_ops) << (moe ? "moe" : "dense");
    int64_t dense = 0, experts = 0;
    for (const auto& g : fp8.fp8) {
      EXPECT_EQ(g.spec.a, fp8::Role::kData);
      EXPECT_EQ(g.spec.b, fp8::Role::kWeight);
      EXPECT_EQ(g.spec.recipe, fp8::Recipe::kMx32);
      (g.op == "gemm_fp8" ? dense : experts) += 1;
    }
    const int64_t layers = cfg.n_layers;
    // Dense: qkv and out per layer, and the FFN's gate_up and down without experts.
    EXPECT_EQ(dense, layers * 2 * (moe ? 2 : 4)) << (moe ? "moe" : "dense");
    if (moe) {
      int64_t chunks = 0;
      for (int l = 0; l < layers; ++l) {
        const auto& w1 = fp8.grad_ops.at("layers." + std::to_string(l) + ".moe.w1");
        chunks += static_cast<int64_t>(std::count(w1.begin(), w1.end(), "gemm_group"));
      }
      EXPECT_GE(chunks, layers);
      EXPECT_EQ(experts, 4 * chunks);
    } else {
      EXPECT_EQ(experts, 0);
    }
    // The FP8-class weights' gradients come from products that exist (the comparison above
    // would also hold if none did).
    for (const char* w : moe ? std::vector<const char*>{"attn.wqkv", "attn.wo", "moe.w1", "moe.w2"}
                             : std::vector<const char*>{"attn.wqkv", "attn.wo", "mlp.w_gate_up",
                                                        "mlp.w_down"}) {
      const auto it = fp8.grad_ops.find(std::string("layers.0.") + w);
      ASSERT_NE(it, fp8.grad_ops.end()) << w;
      EXPECT_FALSE(it->second.empty()) << w;
    }
    // Everything else (router, attention, unembedding) is a product in the activation dtype.
    EXPECT_EQ(fp8.other + static_cast<int64_t>(fp8.fp8.size()), bf16.other);
  }
}

// Under fp8 every FP8 product's weight was held when it ran (each FP8 class's weights of a layer
// are handed to hold_fp8_weights once, as the layer's forward begins), with and without
// recomputation in backward, and nothing is held once the step's backward is done (the optimizer
// writes them next); a dense FFN's GLU output goes straight to the product after it. Under bf16
// nothing is held or handed on.
TEST(Fp8Model, WeightsAreHeldAndGluOutputsHandedOnToTheirProducts) {
  OneThread one;
  for (const bool moe : {true, false})
    for (const bool ckpt : {false, true}) {
      const std::string what = std::string(moe ? "moe" : "dense") + (ckpt ? " ckpt" : "");
      const ModelConfig cfg = moe ? config() : dense_config();
      const Recorded bf16 =
          record_step(cfg, GemmPrecision::kBF16, classes(true, true), fp8::Recipe::kBlock128, ckpt);
      EXPECT_EQ(bf16.holds, 0) << what;
      const Recorded fp8 =
          record_step(cfg, GemmPrecision::kFP8, classes(true, true), fp8::Recipe::kBlock128, ckpt);
      // One hold per class per layer: the attention (and dense FFN) weights, then the experts'.
      EXPECT_EQ(fp8.holds, cfg.n_layers * (moe ? 2 : 1)) << what;
      EXPECT_GE(fp8.releases, 1) << what;
      EXPECT_EQ(fp8.held_after, 0) << what;
      ASSERT_FALSE(fp8.fp8.empty()) << what;
      int64_t held = 0;
      for (const auto& g : fp8.fp8) held += g.b_held;
      EXPECT_EQ(held, static_cast<int64_t>(fp8.fp8.size())) << what;
      // A dense FFN's GLU hands its output on to the FP8 product that takes it next: once in
      // forward (not again when recomputed) and once in backward, per layer, every time taken.
      EXPECT_EQ(bf16.glu_fp8, 0) << what;
      EXPECT_EQ(fp8.glu_fp8, moe ? 0 : 2 * cfg.n_layers) << what;
      EXPECT_EQ(fp8.handed_taken, fp8.glu_fp8) << what;
    }
  // One class: only its weights are held, and the other class's products are bf16 ones.
  const Recorded experts =
      record_step(config(), GemmPrecision::kFP8, classes(false, true), fp8::Recipe::kBlock128);
  ASSERT_FALSE(experts.fp8.empty());
  for (const auto& g : experts.fp8) {
    EXPECT_EQ(g.op, "gemm_fp8_group");
    EXPECT_TRUE(g.b_held);
  }
}

// fp8_gemms=unembedding: each cross-entropy chunk's logits and the input gradient of its hidden
// states are FP8 products ({data, weight}) whose weight (lm_head, or the tied embedding) is held,
// once for the whole loss; the weight gradient stays the product bf16 runs, and nothing is held
// once backward, or an evaluation, is done. Alone or beside the other classes, tied or not.
TEST(Fp8Model, UnembeddingClassQuantizesTheLogitsAndTheirInputGradient) {
  OneThread one;
  for (const bool moe : {true, false})
    for (const bool tied : {false, true}) {
      const std::string what = std::string(moe ? "moe" : "dense") + (tied ? " tied" : "");
      ModelConfig cfg = moe ? config() : dense_config();
      cfg.tie_embeddings = tied;
      const Recorded bf16 = record_step(cfg, GemmPrecision::kBF16, classes(false, false, true),
                                        fp8::Recipe::kBlock128);
      EXPECT_TRUE(bf16.fp8.empty()) << what;
      const Recorded head = record_step(cfg, GemmPrecision::kFP8, classes(false, false, true),
                                        fp8::Recipe::kBlock128);
      EXPECT_EQ(head.grad_ops, bf16.grad_ops) << what;
      // One chunk (320 tokens, ce_chunk_tokens 4096): its logits and its input gradient.
      ASSERT_EQ(head.fp8.size(), 2u) << what;
      for (const auto& g : head.fp8) {
        EXPECT_EQ(g.op, "gemm_fp8") << what;
        EXPECT_EQ(g.spec.a, fp8::Role::kData) << what;
        EXPECT_EQ(g.spec.b, fp8::Role::kWeight) << what;
        EXPECT_TRUE(g.b_held) << what;
      }
      EXPECT_EQ(head.other + 2, bf16.other) << what;
      EXPECT_EQ(head.holds, 1) << what;
      EXPECT_EQ(head.held_after, 0) << what;
      // The loss hands its gradient on to the input-gradient product, which takes it.
      EXPECT_EQ(bf16.ce_fp8, 0) << what;
      EXPECT_EQ(head.ce_fp8, 1) << what;
      EXPECT_EQ(head.handed_taken, 1) << what;
      // With every class: each layer's holds, the head's, and every FP8 product's weight held.
      const Recorded all =
          record_step(cfg, GemmPrecision::kFP8, classes(true, true, true), fp8::Recipe::kBlock128);
      const Recorded layers =
          record_step(cfg, GemmPrecision::kFP8, classes(true, true), fp8::Recipe::kBlock128);
      EXPECT_EQ(all.holds, layers.holds + 1) << what;
      EXPECT_EQ(all.fp8.size(), layers.fp8.size() + 2) << what;
      for (const auto& g : all.fp8) EXPECT_TRUE(g.b_held) << what;
      EXPECT_EQ(all.held_after, 0) << what;
      EXPECT_EQ(all.handed_taken, all.glu_fp8 + all.ce_fp8) << what;
      EXPECT_EQ(all.ce_fp8, 1) << what;
    }
  // An evaluation's loss and Model::logits quantize the same way and release the head after.
  auto cpu = make_cpu_backend(DType::kF32);
  test::Fp8ForwardingBackend be(*cpu);
  ModelOptions opts;
  opts.max_positions = 64;
  opts.precision = GemmPrecision::kFP8;
  opts.fp8_gemms = classes(false, false, true);
  Model model(config(), opts, be);
  model.init_params(11);
  const PackedBatch batch = test::synthetic_batch(config(), 5, 64, 3, 20.0);
  const BatchMeta meta = be.upload_batch(batch);
  model.evaluate(meta);
  int64_t fp8_products = 0;
  for (const auto& g : be.gemms) fp8_products += g.op == "gemm_fp8" && g.b_held;
  EXPECT_EQ(fp8_products, 1);
  EXPECT_EQ(be.held.size(), 0u);
  EXPECT_EQ(be.ce_fp8, 0);  // no product follows an evaluation's loss
  const Tensor logits = model.logits(meta);
  fp8_products = 0;
  for (const auto& g : be.gemms) fp8_products += g.op == "gemm_fp8" && g.b_held;
  EXPECT_EQ(fp8_products, 2);
  EXPECT_EQ(be.held.size(), 0u);
  EXPECT_EQ(be.holds, 2);
  // Those logits are the FP8 product's: close to the unquantized ones, not equal to them.
  ModelOptions bf16_opts = opts;
  bf16_opts.precision = GemmPrecision::kBF16;
  Model ref(config(), bf16_opts, *cpu);
  ref.init_params(11);
  const Tensor ref_logits = ref.logits(meta);
  ASSERT_EQ(logits.numel(), ref_logits.numel());
  double diff2 = 0, ref2 = 0;
  for (int64_t i = 0; i < logits.numel(); ++i) {
    diff2 += std::pow(double(logits.data<float>()[i]) - ref_logits.data<float>()[i], 2);
    ref2 += std::pow(double(ref_logits.data<float>()[i]), 2);
  }
  EXPECT_GT(diff2, 0.0);
  EXPECT_LT(std::sqrt(diff2 / ref2), 0.1);
}

// fp8_gemms=unembedding_wgrad: the unembedding's weight gradient (lm_head's, or the tied
// embedding's share) is an FP8 product with both operands in the data role (blocked along the
// tokens), one per cross-entropy chunk, with no weight held for it; every other gradient comes
// from the op bf16 runs, and the logits' products stay what the unembedding class says. Alone
// and beside every other class, tied or not; an evaluation runs no weight gradient.
TEST(Fp8Model, UnembeddingWgradClassQuantizesTheHeadsWeightGradient) {
  OneThread one;
  for (const bool tied : {false, true})
    for (const bool others : {false, true}) {
      const std::string what = std::string(tied ? "tied" : "lm_head") + (others ? " all" : "");
      ModelConfig cfg = config();
      cfg.tie_embeddings = tied;
      const std::string head = tied ? "tok_embeddings" : "lm_head";
      const Recorded without = record_step(cfg, GemmPrecision::kFP8,
                                           classes(others, others, others), fp8::Recipe::kBlock128);
      const Recorded with = record_step(
          cfg, GemmPrecision::kFP8, classes(others, others, others, true), fp8::Recipe::kBlock128);
      // One product more in FP8: the head's weight gradient, which the run without the class
      // ran as gemm.
      ASSERT_EQ(with.fp8.size(), without.fp8.size() + 1) << what;
      EXPECT_EQ(with.other, without.other) << what;
      EXPECT_EQ(with.holds, without.holds) << what;
      EXPECT_EQ(with.held_after, 0) << what;
      int64_t data_data = 0;
      for (const auto& g : with.fp8) {
        if (g.spec.b != fp8::Role::kData) continue;
        ++data_data;
        EXPECT_EQ(g.op, "gemm_fp8") << what;
        EXPECT_EQ(g.spec.a, fp8::Role::kData) << what;
        EXPECT_EQ(g.spec.recipe, fp8::Recipe::kBlock128) << what;
        EXPECT_FALSE(g.b_held) << what;
      }
      EXPECT_EQ(data_data, 1) << what;
      for (const auto& [name, ops] : without.grad_ops) {
        const auto it = with.grad_ops.find(name);
        ASSERT_NE(it, with.grad_ops.end()) << what << ": " << name;
        if (name != head) {
          EXPECT_EQ(it->second, ops) << what << ": " << name;
          continue;
        }
        // The head's gradient: the same ops but its weight-gradient gemm, which is gemm_fp8.
        std::vector<std::string> want = ops;
        const auto gemm = std::find(want.begin(), want.end(), "gemm");
        ASSERT_NE(gemm, want.end()) << what << ": " << name;
        *gemm = "gemm_fp8";
        EXPECT_EQ(it->second, want) << what << ": " << name;
      }
      EXPECT_EQ(with.grad_ops.size(), without.grad_ops.size()) << what;
    }
  // Under bf16 the class changes nothing.
  const Recorded bf16 = record_step(config(), GemmPrecision::kBF16,
                                    classes(false, false, false, true), fp8::Recipe::kBlock128);
  EXPECT_TRUE(bf16.fp8.empty());
  // An evaluation computes no gradient: no FP8 product under the class alone.
  auto cpu = make_cpu_backend(DType::kF32);
  test::Fp8ForwardingBackend be(*cpu);
  ModelOptions opts;
  opts.max_positions = 64;
  opts.precision = GemmPrecision::kFP8;
  opts.fp8_gemms = classes(false, false, false, true);
  Model model(config(), opts, be);
  model.init_params(11);
  const PackedBatch batch = test::synthetic_batch(config(), 5, 64, 3, 20.0);
  model.evaluate(be.upload_batch(batch));
  for (const auto& g : be.gemms) EXPECT_NE(g.op, "gemm_fp8");
}

}  // namespace
}  // namespace hp
