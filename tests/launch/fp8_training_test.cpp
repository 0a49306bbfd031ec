// precision=fp8 on the CPU backend (docs/design.md, "FP8 training"): the options' parse and
// validation, training of a small dense and a small MoE model whose chosen GEMMs run through the
// emulated FP8 products, compared with precision=bf16 from the same seed and data, and a resume
// across a precision switch in both directions (precision is not part of the model config a
// checkpoint is compared by); the model's recipe taken from the backend, and the memory plan's FP8
// scratch.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "launch/options.h"
#include "launch/train/memory_plan.h"
#include "launch/train/trainer.h"
#include "tests/common/launch_fixtures.h"
#include "tests/common/one_thread.h"
#include "tests/framework/fp8_forwarding_backend.h"

namespace fs = std::filesystem;

namespace hp {
namespace {

// The runs here are small: each test runs on one OpenMP thread (tests/common/one_thread.h).
using test::OneThread;

// Width 64 so the weight tiles and K blocks of 128 are partial and the blocks along the tokens
// (256 a step) full; lr and warmup as examples/configs/tiny-dense.ini.
TrainOptions small_run(bool moe) {
  TrainOptions o = test::small_dense_options();
  o.model.d_model = 64;
  o.model.n_heads = 4;
  o.model.n_kv_heads = 2;
  o.model.head_dim = 16;
  o.model.ffn_dim = 128;
  if (moe) {
    o.model.n_experts = 4;
    o.model.top_k = 2;
    o.model.expert_ffn_dim = 64;
    o.model.moe_aux_coef = 0.01;
  }
  o.data.seq_len = 64;
  o.data.batch_tokens = 256;
  o.data.synthetic_vocab = 8;
  o.data.synthetic_zipf = 2.0;
  o.data.synthetic_mean_doc_len = 64;
  o.optimizer.lr = 3e-3;
  o.optimizer.min_lr = 3e-4;
  o.optimizer.warmup_steps = 10;
  o.run.steps = 60;
  o.run.log_every = 1000;
  return o;
}

std::vector<double> losses_of(const fs::path& metrics) {
  std::ifstream f(metrics);
  std::vector<double> out;
  for (std::string l; std::getline(f, l);) out.push_back(nlohmann::json::parse(l)["loss"]);
  return out;
}

std::vector<double> train(TrainOptions o, const std::string& name) {
  const fs::path dir = test::fresh_temp_dir("fp8_" + name);
  o.run.metrics_path = (dir / "metrics.jsonl").string();
  EXPECT_EQ(test::validation_message(o), "");
  EXPECT_EQ(run_train(o, single_rank_context()), 0) << name;
  return losses_of(o.run.metrics_path);
}

double mean_last(const std::vector<double>& v, size_t n) {
  return std::accumulate(v.end() - static_cast<std::ptrdiff_t>(n), v.end(), 0.0) / n;
}

// fp8 against bf16 (fp32 on this backend) from the same init and data: both fall well below the
// first step's loss, the FP8 products really ran (the curves are not bitwise equal), and the mean
// of the last 10 steps agrees within 2%. The bound: E4M3 with per-block scales carries about 5%
// rms relative error per product (Fp8Gemm.MatchesTheProductOfDequantizedOperands), which at this
// size moves a 60-step run's loss by a fraction of a percent (measured: 0.01% dense, 0.3% MoE,
// from 2.80 at step 1 to about 1.88; the entropy floor is 1.23). 2% still catches a wrong
// gradient product, which leaves the loss tens of percent behind.
// With `unembedding` the FP8 run also quantizes the logits' products (fp8_gemms=...,unembedding),
// with `wgrad` the unembedding's weight gradient (...,unembedding_wgrad).
void expect_fp8_trains_like_bf16(bool moe, const std::string& name, bool unembedding = false,
                                 bool wgrad = false) {
  TrainOptions o = small_run(moe);
  const std::vector<double> bf16 = train(o, name + "_bf16");
  o.compute.precision = GemmPrecision::kFP8;
  o.compute.fp8_gemms.unembedding = unembedding;
  o.compute.fp8_gemms.unembedding_wgrad = wgrad;
  const std::vector<double> fp8 = train(o, name + "_fp8");
  ASSERT_EQ(bf16.size(), 60u);
  ASSERT_EQ(fp8.size(), 60u);
  EXPECT_NE(bf16, fp8);
  const double b = mean_last(bf16, 10), f = mean_last(fp8, 10);
  EXPECT_LT(b, 0.8 * bf16.front()) << name;
  EXPECT_LT(f, 0.8 * fp8.front()) << name;
  EXPECT_LT(std::fabs(f - b) / b, 0.02) << name << ": bf16 " << b << ", fp8 " << f;
  for (double l : fp8) EXPECT_TRUE(std::isfinite(l));
}

TEST(Fp8Training, DenseTrainsLikeBf16) {
  OneThread one;
  expect_fp8_trains_like_bf16(false, "dense");
}

TEST(Fp8Training, MoeTrainsLikeBf16) {
  OneThread one;
  expect_fp8_trains_like_bf16(true, "moe");
}

TEST(Fp8Training, WithTheUnembeddingTrainsLikeBf16) {
  OneThread one;
  expect_fp8_trains_like_bf16(true, "moe_unembedding", true);
}

TEST(Fp8Training, WithTheUnembeddingsWeightGradientTrainsLikeBf16) {
  OneThread one;
  expect_fp8_trains_like_bf16(true, "moe_unembedding_wgrad", true, true);
}

// A run saved under one precision resumes under the other: the checkpoint (fp32 masters and
// moments) loads, the run goes on from the saved step and keeps training.
TEST(Fp8Training, ResumesAcrossAPrecisionSwitch) {
  OneThread one;
  for (const bool to_fp8 : {true, false}) {
    const std::string name = to_fp8 ? "switch_to_fp8" : "switch_to_bf16";
    const fs::path dir = test::fresh_temp_dir("fp8_" + name);
    TrainOptions o = small_run(true);
    o.run.steps = 20;
    o.run.stop_at_step = 10;
    o.checkpoint.dir = (dir / "ckpt").string();
    o.checkpoint.every = 10;
    o.compute.precision = to_fp8 ? GemmPrecision::kBF16 : GemmPrecision::kFP8;
    o.run.metrics_path = (dir / "first.jsonl").string();
    ASSERT_EQ(run_train(o, single_rank_context()), 0);
    const std::vector<double> first = losses_of(o.run.metrics_path);
    ASSERT_EQ(first.size(), 10u);
    ASSERT_TRUE(fs::exists(dir / "ckpt" / "step_00000010.h5"));

    o.run.stop_at_step = 0;
    o.checkpoint.resume.kind = ResumeSpec::Kind::kAuto;
    o.compute.precision = to_fp8 ? GemmPrecision::kFP8 : GemmPrecision::kBF16;
    o.run.metrics_path = (dir / "second.jsonl").string();
    ASSERT_EQ(run_train(o, single_rank_context()), 0) << name;
    const std::vector<double> second = losses_of(o.run.metrics_path);
    ASSERT_EQ(second.size(), 10u) << name << ": steps 11..20 after the resume";
    // It continues where the first part stopped (no restart from a fresh init: the first resumed
    // loss is near the last saved one, far below step 1's) and keeps falling.
    EXPECT_LT(second.front(), 0.9 * first.front()) << name;
    EXPECT_LT(std::fabs(second.front() - first.back()) / first.back(), 0.1) << name;
    EXPECT_LT(mean_last(second, 5), mean_last(first, 5)) << name;
    EXPECT_TRUE(fs::exists(dir / "ckpt" / "step_00000020.h5"));
  }
}

// ---- the options ------------------------------------------------------------------------------

TrainOptions parsed(const std::vector<std::string>& args) {
  TrainOptions o;
  parse_train_options(args, "train", o);
  return o;
}

std::string parse_error(const std::vector<std::string>& args) {
  try {
    parsed(args);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(Fp8Options, ParsedTypedAndValidated) {
  const TrainOptions d = parsed({});
  EXPECT_EQ(d.compute.precision, GemmPrecision::kBF16);
  EXPECT_TRUE(d.compute.fp8_gemms.dense && d.compute.fp8_gemms.experts);
  EXPECT_FALSE(d.compute.fp8_gemms.unembedding);
  EXPECT_FALSE(make_model_options(d).fp8_dense());
  const TrainOptions f = parsed({"--precision=fp8", "--fp8_gemms=experts"});
  EXPECT_EQ(f.compute.precision, GemmPrecision::kFP8);
  EXPECT_FALSE(f.compute.fp8_gemms.dense);
  EXPECT_TRUE(f.compute.fp8_gemms.experts);
  EXPECT_TRUE(make_model_options(f).fp8_experts());
  EXPECT_FALSE(make_model_options(f).fp8_dense());
  EXPECT_FALSE(make_model_options(f).fp8_unembedding());
  const TrainOptions u = parsed({"--precision=fp8", "--fp8_gemms=dense,experts,unembedding"});
  EXPECT_TRUE(u.compute.fp8_gemms.dense && u.compute.fp8_gemms.experts);
  EXPECT_TRUE(make_model_options(u).fp8_unembedding());
  EXPECT_FALSE(make_model_options(u).fp8_unembedding_wgrad());
  EXPECT_FALSE(make_model_options(parsed({"--fp8_gemms=unembedding"})).fp8_unembedding());
  const TrainOptions w = parsed({"--precision=fp8", "--fp8_gemms=unembedding_wgrad"});
  EXPECT_FALSE(w.compute.fp8_gemms.dense || w.compute.fp8_gemms.experts ||
               w.compute.fp8_gemms.unembedding);
  EXPECT_TRUE(make_model_options(w).fp8_unembedding_wgrad());
  EXPECT_FALSE(
      make_model_options(parsed({"--fp8_gemms=unembedding_wgrad"})).fp8_unembedding_wgrad());

  EXPECT_NE(parse_error({"--precision=fp16"}).find("config key 'precision': must be bf16 or fp8"),
            std::string::npos);
  EXPECT_NE(parse_error({"--fp8_gemms=dense,router"}).find("config key 'fp8_gemms'"),
            std::string::npos);
  EXPECT_NE(parse_error({"--fp8_gemms=,"}).find("config key 'fp8_gemms'"), std::string::npos);

  // Validation: fp8 is taken on either device (a GPU without block-scaled FP8 GEMMs is refused
  // where the model is built: Backend::has_fp8_gemms); a dense model needs the dense class.
  TrainOptions o = small_run(true);
  o.compute.precision = GemmPrecision::kFP8;
  o.compute.fp8_gemms.dense = false;
  EXPECT_EQ(test::validation_message(o), "");
  o.device.kind = DeviceKind::kCuda;
  EXPECT_EQ(test::validation_message(o), "");
  TrainOptions dense = small_run(false);
  dense.compute.precision = GemmPrecision::kFP8;
  dense.compute.fp8_gemms.dense = false;
  EXPECT_NE(test::validation_message(dense).find("config key 'fp8_gemms'"), std::string::npos);
  dense.compute.fp8_gemms.unembedding = true;  // a class a dense model has
  EXPECT_EQ(test::validation_message(dense), "");
  dense.compute.fp8_gemms.unembedding = false;
  dense.compute.fp8_gemms.unembedding_wgrad = true;  // so is this one
  EXPECT_EQ(test::validation_message(dense), "");
  dense.compute.fp8_gemms.unembedding_wgrad = false;
  dense.compute.precision = GemmPrecision::kBF16;  // fp8_gemms is read only under fp8
  EXPECT_EQ(test::validation_message(dense), "");
}

// The model's FP8 recipe is the backend's under fp8 (a compute capability 10.x GPU reports mxfp8),
// kBlock128 without a backend, and never asked of a backend without FP8 GEMMs or under bf16.
TEST(Fp8Options, TheRecipeIsTheBackends) {
  TrainOptions o = small_run(true);
  o.compute.precision = GemmPrecision::kFP8;
  auto cpu = make_cpu_backend(DType::kF32);
  EXPECT_EQ(cpu->fp8_recipe(), fp8::Recipe::kBlock128);
  test::Fp8ForwardingBackend mx(*cpu);
  mx.set_fp8_recipe(fp8::Recipe::kMx32);
  EXPECT_EQ(make_model_options(o, &mx).fp8_recipe, fp8::Recipe::kMx32);
  EXPECT_EQ(make_model_options(o, cpu.get()).fp8_recipe, fp8::Recipe::kBlock128);
  EXPECT_EQ(make_model_options(o).fp8_recipe, fp8::Recipe::kBlock128);
  o.compute.precision = GemmPrecision::kBF16;
  EXPECT_EQ(make_model_options(o, &mx).fp8_recipe, fp8::Recipe::kBlock128);
}

// The plan's FP8 lines, only under fp8: the scratch of the largest forward or input-gradient
// FP8 product (both operands quantized, the fp32 output) and the held weights of the FP8
// classes, counted in a CUDA plan's total and shown, not counted, in a CPU plan's. The weight
// gradients run in bf16 and add nothing.
TEST(Fp8Options, MemoryPlanCountsTheLargestProductsScratch) {
  TrainOptions o = small_run(true);
  const MemoryPlan bf16 = plan_memory(o, layout_of(o, 1), true);
  EXPECT_EQ(bf16.fp8_scratch, 0);
  EXPECT_EQ(format_plan(bf16, 0).find("fp8"), std::string::npos);
  o.compute.precision = GemmPrecision::kFP8;
  const MemoryPlan fp8 = plan_memory(o, layout_of(o, 1), true);
  // 256 tokens, d_model 64, qkv 128 wide, attention 64, experts' gate_up 128 and down 64 wide;
  // the experts' rows are counted as 256 x top_k 2 + 3 x 4 experts (each expert's rows padded
  // to 4) = 524. The largest product is an expert's gate_up forward [524, 64] x [64, 128]: data
  // codes of 528 rows (padded to 8) x 64 and scales mxfp8's 5 tiles x 4 x 128 bytes (more than
  // block128's 528 x 1 block x 4), weight codes 128 x 64 and scales mxfp8's 1 tile x 4 x 128
  // bytes (block128's 4 fp32), output 524 x 128 fp32.
  const int64_t experts = 528 * 64 + 5 * 4 * 128 + 128 * 64 + 512 + 524 * 128 * 4;
  EXPECT_EQ(fp8.fp8_scratch, experts);
  // The held weights, both forms of each (X = W, X = W^T): codes of rows x K, scales the larger
  // of block128's and mxfp8's (1 tile x 4 x 128 bytes here). wqkv [64, 128]: 2 x (64 x 128 +
  // 512); wo [64, 64]: 2 x (64 x 64 + 512); per expert w1 [64, 128] as wqkv, w2 [64, 64] as wo.
  const int64_t layers = o.model.n_layers;
  const int64_t wqkv = 2 * (64 * 128 + 512), wo = 2 * (64 * 64 + 512);
  EXPECT_EQ(fp8.fp8_weights, layers * (wqkv + wo + 4 * (wqkv + wo)));
  // Every piece is a multiple of 512 bytes: the allocator adds no rounding.
  EXPECT_EQ(fp8.rounding, bf16.rounding);
  EXPECT_EQ(fp8.total, bf16.total + fp8.fp8_scratch + fp8.fp8_weights);
  const std::string text = format_plan(fp8, 0);
  EXPECT_NE(text.find("fp8 scratch"), std::string::npos) << text;
  EXPECT_NE(text.find("fp8 weights"), std::string::npos) << text;
  const nlohmann::ordered_json j = plan_json(fp8, 0);
  EXPECT_EQ(j["fp8_scratch_bytes"], experts);
  EXPECT_EQ(j["fp8_weights_bytes"], fp8.fp8_weights);

  // The dense class alone: qkv's forward [256, 64] x [64, 128] is the largest.
  o.compute.fp8_gemms.experts = false;
  EXPECT_EQ(plan_memory(o, layout_of(o, 1), true).fp8_scratch,
            256 * 64 + 256 * 4 + 128 * 64 + 512 + 256 * 128 * 4);
  EXPECT_EQ(plan_memory(o, layout_of(o, 1), true).fp8_weights, layers * (wqkv + wo));
  // The experts class alone gives the experts' product again.
  o.compute.fp8_gemms.experts = true;
  o.compute.fp8_gemms.dense = false;
  EXPECT_EQ(plan_memory(o, layout_of(o, 1), true).fp8_scratch, experts);
  EXPECT_EQ(plan_memory(o, layout_of(o, 1), true).fp8_weights, layers * 4 * (wqkv + wo));

  // The unembedding class alone: the logits' forward [256, 64] x [64, 16] is its largest product
  // and goes straight into the logits (256 rows, 16 columns: no fp32 scratch); lm_head [64, 16]
  // is held in both forms.
  o.compute.fp8_gemms.experts = false;
  o.compute.fp8_gemms.unembedding = true;
  EXPECT_EQ(plan_memory(o, layout_of(o, 1), true).fp8_scratch, 256 * 64 + 256 * 4 + 16 * 64 + 512);
  EXPECT_EQ(plan_memory(o, layout_of(o, 1), true).fp8_weights, 2 * (64 * 16 + 512));
  // A vocabulary of 20 (not a multiple of 8) writes its logits through the fp32 scratch; the
  // weight's 20 rows are padded to 24.
  o.model.vocab_size = 20;
  EXPECT_EQ(plan_memory(o, layout_of(o, 1), true).fp8_scratch,
            256 * 64 + 256 * 4 + 24 * 64 + 512 + 256 * 20 * 4);
  o.model.vocab_size = 16;
  o.compute.fp8_gemms.unembedding = false;

  // The unembedding_wgrad class alone: lm_head's weight gradient [64, 256] x [256, 16], both
  // operands blocked along the 256 tokens: hᵀ as 64 rows (codes 64 x 256; scales mxfp8's 1 tile
  // x 8 x 128 bytes, more than block128's 2 blocks x 64 rows x 4) and dlogitsᵀ as 16 rows (codes
  // 16 x 256, scales the same 1,024 bytes), straight into the fp32 gradient (64 rows, 16
  // columns); nothing held.
  o.compute.fp8_gemms.unembedding_wgrad = true;
  EXPECT_EQ(plan_memory(o, layout_of(o, 1), true).fp8_scratch, 64 * 256 + 1024 + 16 * 256 + 1024);
  EXPECT_EQ(plan_memory(o, layout_of(o, 1), true).fp8_weights, 0);
  // Tied, with a vocabulary of 18: the gradient [18, 64] takes the fp32 scratch (18 rows are no
  // multiple of 4); dlogitsᵀ's 18 rows are counted padded to 24.
  o.model.tie_embeddings = true;
  o.model.vocab_size = 18;
  EXPECT_EQ(plan_memory(o, layout_of(o, 1), true).fp8_scratch,
            24 * 256 + 1024 + 64 * 256 + 1024 + 18 * 64 * 4);
  // With 20 words the gradient's rows are whole multiples of 4 again: no scratch.
  o.model.vocab_size = 20;
  EXPECT_EQ(plan_memory(o, layout_of(o, 1), true).fp8_scratch, 24 * 256 + 1024 + 64 * 256 + 1024);
  o.model.tie_embeddings = false;
  o.model.vocab_size = 16;
  o.compute.fp8_gemms.unembedding_wgrad = false;
  o.compute.fp8_gemms.experts = true;

  // A CPU plan shows it but holds none of it.
  o.compute.fp8_gemms.dense = true;
  TrainOptions cpu_bf16 = small_run(true);
  const MemoryPlan cpu_ref = plan_memory(cpu_bf16, layout_of(cpu_bf16, 1), false);
  const MemoryPlan cpu = plan_memory(o, layout_of(o, 1), false);
  EXPECT_EQ(cpu.fp8_scratch, experts);
  EXPECT_EQ(cpu.total, cpu_ref.total);
  EXPECT_NE(format_plan(cpu, 0).find("not in the total"), std::string::npos);
}

}  // namespace
}  // namespace hp
