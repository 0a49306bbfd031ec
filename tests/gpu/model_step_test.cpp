// Whole-model checks of the CUDA backend against the CPU reference: one forward+backward of a
// GPT-OSS-style MoE model (sliding window, sinks, biases, clamped SwiGLU, head_dim 64) from the
// same parameters and batch, the sync budget on the GPU, and a short training run whose loss
// must fall. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "framework/backend/cuda/cuda_backend.h"
#include "framework/data/loader.h"
#include "framework/model/model.h"
#include "launch/train/trainer.h"
#include "tests/common/unreached_experts.h"
#include "tests/gpu/gpu_fixtures.h"

namespace hp {
namespace {

ModelConfig gpu_moe_config() {
  ModelConfig c;
  c.vocab_size = 97;
  c.d_model = 128;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 64;
  c.n_experts = 4;
  c.top_k = 2;
  c.expert_ffn_dim = 96;
  c.sliding_window = 16;
  c.window_layers = WindowLayers::kEven;
  c.attn_sinks = true;
  c.attn_bias = true;
  c.activation = Activation::kGptOss;
  c.moe_aux_coef = 0.01;
  return c;
}

PackedBatch synthetic_batch(int64_t vocab, int64_t rows, int64_t seq_len) {
  DataConfig d;
  d.vocab_size = vocab;
  d.eot_token = static_cast<int32_t>(vocab - 1);
  d.seq_len = seq_len;
  d.rows_per_batch = rows;
  d.seed = 17;
  d.synthetic_vocab = vocab - 1;
  d.synthetic_mean_doc_len = 40;
  return DataLoader::open(d)->next();
}

std::vector<double> host_values(Backend& be, const Tensor& t) {
  return to_double_vector(test::host_f32(be, t));
}

double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// An expert-parallel rank's place in its group, for building (not running) a sharded model.
class ShardOnly final : public ExpertExchange {
 public:
  ShardOnly(int rank, int size) : rank_(rank), size_(size) {}
  int ep_size() const override { return size_; }
  int ep_rank() const override { return rank_; }
  ExchangePlan plan(Backend&, const Tensor&, int, RoutingMode) override { return unused(); }
  Tensor dispatch(Backend&, const ExchangePlan&, const Tensor&) override {
    return unused(), Tensor();
  }
  Tensor combine(Backend&, const ExchangePlan&, const Tensor&) override {
    return unused(), Tensor();
  }
  int data_ranks() const override { return size_; }
  void sum_over_data_ranks(Backend&, Tensor&) override { unused(); }

 private:
  static ExchangePlan unused() {
    HP_CHECK(false, "ShardOnly exchanges nothing");
    return {};
  }
  int rank_, size_;
};

// Every parameter is born on the device with the CPU backend's bits, for the whole model and
// for an expert-parallel shard (whose draws start mid-tensor).
TEST(CudaModel, InitOnDeviceBitwiseEqualsCpu) {
  HP_REQUIRE_GPU();
  const ModelConfig cfg = gpu_moe_config();
  ModelOptions opts;
  opts.max_positions = 128;
  auto cpu = make_cpu_backend(DType::kF32);
  auto gpu = make_cuda_backend(0);
  for (const int ep_rank : {0, 1}) {
    auto xc = std::make_shared<ShardOnly>(ep_rank, 2), xg = std::make_shared<ShardOnly>(ep_rank, 2);
    Model mc(cfg, opts, *cpu, xc), mg(cfg, opts, *gpu, xg);
    mc.init_params(77);
    mg.init_params(77);
    ASSERT_EQ(mc.params().all().size(), mg.params().all().size());
    for (size_t i = 0; i < mc.params().all().size(); ++i) {
      const Param& pc = *mc.params().all()[i];
      const Tensor& gm = mg.params().all()[i]->master;
      Tensor h = Tensor::host(gm.shape(), gm.dtype());
      gpu->read_to_host(gm, h, SyncCause::kOther);
      EXPECT_EQ(std::memcmp(h.raw(), pc.master.raw(), static_cast<size_t>(h.nbytes())), 0)
          << pc.name << " (ep rank " << ep_rank << ")";
    }
  }
}

// One forward and backward of the same weights on the CPU reference and on the GPU under
// `opts`; the loss and every gradient agree within the bounds. Returns the GPU's loss.
struct Agreement {
  double loss = 1e-2;  // relative
  double grad = 0.15;  // relative L2 error of one parameter's gradient
  double cancelling_grad = 0.3;
  double all = 5e-2;  // of the whole model's gradient
};

double forward_backward_matches_cpu(const ModelOptions& opts, const Agreement& tol,
                                    const ModelConfig& cfg = gpu_moe_config(),
                                    int64_t* fp8_handed = nullptr) {
  PackedBatch batch = synthetic_batch(cfg.vocab_size, 4, 128);
  const double scale = 1.0 / static_cast<double>(batch.num_valid_targets);

  auto cpu = make_cpu_backend(DType::kF32);
  auto gpu = make_cuda_backend(0);
  Model mc(cfg, opts, *cpu), mg(cfg, opts, *gpu);
  mc.init_params(5);
  mg.init_params(5);
  // The reference computes with the same bf16-rounded weights the GPU uses.
  for (size_t i = 0; i < mc.params().all().size(); ++i) {
    Param& pc = *mc.params().all()[i];
    std::vector<double> w = host_values(*gpu, mg.params().all()[i]->work);
    std::vector<float> wf(w.begin(), w.end());
    cpu->copy(Tensor::host_from(wf, DType::kF32, pc.shape), pc.master);
  }
  BatchMeta metc = cpu->upload_batch(batch), metg = gpu->upload_batch(batch);
  mc.zero_grads();
  mg.zero_grads();
  LossSums sc = mc.forward_backward(metc, scale);
  LossSums sg = mg.forward_backward(metg, scale);
  if (fp8_handed) *fp8_handed = cuda_fp8_handed_uses(*gpu);
  const double lc = to_double_vector(sc.lm)[0] * scale;
  const double lg = host_values(*gpu, sg.lm)[0] * scale;
  EXPECT_NEAR(lg, lc, tol.loss * lc) << "loss cpu=" << lc << " gpu=" << lg;
  EXPECT_NEAR(host_values(*gpu, sg.aux)[0], to_double_vector(sc.aux)[0],
              2e-2 * to_double_vector(sc.aux)[0]);

  // Gradients of the whole model: bf16 activations through two layers, and a few tokens whose
  // top-k choice flips under bf16 rounding, bound the agreement; a real bug is O(1).
  std::vector<double> all_c, all_g;
  for (size_t i = 0; i < mc.params().all().size(); ++i) {
    Param& pc = *mc.params().all()[i];
    std::vector<double> gc = to_double_vector(pc.grad);
    std::vector<double> gg = host_values(*gpu, mg.params().all()[i]->grad);
    // A router bias gradient is a column sum of dlogits whose terms largely cancel (the top-k
    // softmax gradient sums to zero per token), so bf16 rounding weighs more in it; so is an
    // attention sink's (one per head: a sum over the queries of -p_sink (dO . O), terms of
    // both signs).
    const bool cancelling = pc.name.find("moe.br") != std::string::npos ||
                            pc.name.find("attn.sinks") != std::string::npos;
    EXPECT_LT(rel_err(gg, gc), cancelling ? tol.cancelling_grad : tol.grad) << pc.name;
    all_c.insert(all_c.end(), gc.begin(), gc.end());
    all_g.insert(all_g.end(), gg.begin(), gg.end());
  }
  EXPECT_LT(rel_err(all_g, all_c), tol.all);
  return lg;
}

TEST(CudaModel, ForwardBackwardMatchesCpuReference) {
  HP_REQUIRE_GPU();
  ModelOptions opts;
  opts.max_positions = 128;
  opts.ce_chunk_tokens = 300;
  forward_backward_matches_cpu(opts, Agreement{});
}

// precision=fp8 on the GPU (cuBLASLt block-scaled GEMMs) against the CPU backend's FP8
// emulation: the operands quantize from bf16 on the GPU and from f32 on the CPU, so a code can
// round to its neighbour (1/16 apart) where the two differ; the bounds allow for that, and the
// FP8 loss must differ from the bf16 one (the FP8 products ran).
Agreement fp8_agreement() {
  Agreement tol;
  tol.loss = 2e-2;
  tol.grad = 0.25;
  tol.cancelling_grad = 0.5;
  tol.all = 0.1;
  return tol;
}

// The device's FP8 recipe (the CPU emulates it), or false where it has no block-scaled FP8 GEMMs.
bool device_fp8_recipe(fp8::Recipe* recipe) {
  auto gpu = make_cuda_backend(0);
  if (!gpu->has_fp8_gemms()) return false;
  *recipe = gpu->fp8_recipe();
  return true;
}

TEST(CudaModel, Fp8ForwardBackwardMatchesCpuFp8Reference) {
  HP_REQUIRE_GPU();
  fp8::Recipe recipe;
  if (!device_fp8_recipe(&recipe)) GTEST_SKIP() << "this GPU has no block-scaled FP8 GEMMs";
  ModelOptions opts;
  opts.max_positions = 128;
  opts.ce_chunk_tokens = 300;
  const double bf16 = forward_backward_matches_cpu(opts, Agreement{});
  opts.precision = GemmPrecision::kFP8;
  opts.fp8_recipe = recipe;
  const double fp8 = forward_backward_matches_cpu(opts, fp8_agreement());
  EXPECT_NE(fp8, bf16) << "precision=fp8 gave the bf16 loss bit for bit";
  EXPECT_NEAR(fp8, bf16, 2e-2 * bf16);
}

// The same for a dense model whose FFN width (256) takes the GLUs that hand their quantized
// output on to the products after them: each of the 2 layers' down projection (forward) and
// gate_up input gradient (backward) takes it.
TEST(CudaModel, Fp8DenseForwardBackwardMatchesCpuFp8Reference) {
  HP_REQUIRE_GPU();
  fp8::Recipe recipe;
  if (!device_fp8_recipe(&recipe)) GTEST_SKIP() << "this GPU has no block-scaled FP8 GEMMs";
  ModelConfig cfg = gpu_moe_config();
  cfg.n_experts = 0;
  cfg.top_k = 0;
  cfg.expert_ffn_dim = 0;
  cfg.moe_aux_coef = 0;
  cfg.ffn_dim = 256;
  cfg.activation = Activation::kSwiGLU;
  ModelOptions opts;
  opts.max_positions = 128;
  opts.ce_chunk_tokens = 300;
  const double bf16 = forward_backward_matches_cpu(opts, Agreement{}, cfg);
  opts.precision = GemmPrecision::kFP8;
  opts.fp8_recipe = recipe;
  int64_t handed = -1;
  const double fp8 = forward_backward_matches_cpu(opts, fp8_agreement(), cfg, &handed);
  EXPECT_NE(fp8, bf16) << "precision=fp8 gave the bf16 loss bit for bit";
  EXPECT_NEAR(fp8, bf16, 2e-2 * bf16);
  EXPECT_EQ(handed, recipe == fp8::Recipe::kBlock128 ? 2 * cfg.n_layers : 0);
}

// fp8_gemms=unembedding on the GPU against the CPU emulation: the logits and their input gradient
// as FP8 products, alone and with every class, for lm_head (a 97-word vocabulary, whose padded
// rows take the fp32 scratch) and for a tied embedding of 128 words (straight into the logits);
// and with unembedding_wgrad, the weight gradient too (its operands blocked along the tokens:
// 97 rows of dlogitsᵀ take the general quantization kernel, 128 rows and the hidden states the
// transposed data kernel).
TEST(CudaModel, Fp8UnembeddingMatchesCpuFp8Reference) {
  HP_REQUIRE_GPU();
  fp8::Recipe recipe;
  if (!device_fp8_recipe(&recipe)) GTEST_SKIP() << "this GPU has no block-scaled FP8 GEMMs";
  for (const bool tied : {false, true}) {
    ModelConfig cfg = gpu_moe_config();
    cfg.tie_embeddings = tied;
    if (tied) cfg.vocab_size = 128;
    ModelOptions opts;
    opts.max_positions = 128;
    opts.ce_chunk_tokens = 300;
    const double bf16 = forward_backward_matches_cpu(opts, Agreement{}, cfg);
    opts.precision = GemmPrecision::kFP8;
    opts.fp8_recipe = recipe;
    for (const bool others : {false, true})
      for (const bool wgrad : {false, true}) {
        opts.fp8_gemms.dense = opts.fp8_gemms.experts = others;
        opts.fp8_gemms.unembedding = true;
        opts.fp8_gemms.unembedding_wgrad = wgrad;
        const double fp8 = forward_backward_matches_cpu(opts, fp8_agreement(), cfg);
        const std::string what = "tied=" + std::to_string(tied) +
                                 " others=" + std::to_string(others) +
                                 " wgrad=" + std::to_string(wgrad);
        EXPECT_NE(fp8, bf16) << what;
        EXPECT_NEAR(fp8, bf16, 2e-2 * bf16) << what;
      }
  }
}

// Unreached experts' gradients left unwritten on the GPU: the optimizer's bits are those of the
// zero-filling backward (deterministic: the same bits for the same work twice).
TEST(CudaModel, UnreachedExpertsLeftUnwrittenGiveTheBitsOfZeroFills) {
  HP_REQUIRE_GPU();
  CudaBackendOptions o;
  o.deterministic = true;
  auto be = make_cuda_backend(0, o);
  ModelConfig c = gpu_moe_config();
  c.n_experts = 32;
  // 6 tokens a micro-batch, 2 experts each: at most 24 of 32 experts reached in a layer.
  test::check_unreached_experts(*be, c, 6);
}

TEST(CudaModel, SyncBudgetCachedAndBaselines) {
  HP_REQUIRE_GPU();
  const ModelConfig cfg = gpu_moe_config();
  PackedBatch batch = synthetic_batch(cfg.vocab_size, 4, 128);
  for (int variant = 0; variant < 2; ++variant) {
    auto gpu = make_cuda_backend(0);
    ModelOptions opts;
    opts.max_positions = 128;
    if (variant == 1) {
      opts.metadata = MetadataMode::kPerLayer;
      opts.routing = RoutingMode::kPerExpert;
    }
    Model m(cfg, opts, *gpu);
    m.init_params(1);
    BatchMeta meta = gpu->upload_batch(batch);
    gpu->syncs().reset();
    m.zero_grads();
    m.forward_backward(meta, 1e-3);
    const int64_t layers = cfg.n_layers;
    EXPECT_EQ(gpu->syncs().get(SyncCause::kMetadata), variant == 0 ? 0 : layers);
    EXPECT_EQ(gpu->syncs().get(SyncCause::kRouting),
              variant == 0 ? layers : layers * cfg.n_experts);
    EXPECT_EQ(gpu->syncs().get(SyncCause::kOther), 0);
  }
}

TEST(CudaModel, TinyMoeTrainsWithFallingLoss) {
  HP_REQUIRE_GPU();
  TrainOptions o;
  o.model = gpu_moe_config();
  o.device.kind = DeviceKind::kCuda;
  o.data.seq_len = 128;
  o.data.batch_tokens = 2048;
  o.run.steps = 40;
  o.optimizer.lr = 3e-3;
  o.optimizer.min_lr = 3e-4;
  o.optimizer.warmup_steps = 5;
  o.optimizer.weight_decay = 0;
  o.data.synthetic_vocab = 16;
  RankContext ctx = single_rank_context();
  Trainer t(o, ctx);
  double first = 0, last = 0;
  for (int i = 0; i < o.run.steps; ++i) {
    StepStats s = t.step();
    if (i < 3) first += s.loss / 3;
    if (i >= o.run.steps - 3) last += s.loss / 3;
    EXPECT_EQ(s.syncs.get(SyncCause::kMetadata), 0);
    EXPECT_EQ(s.syncs.get(SyncCause::kLoss), 1);
    // On a GPU every step carries its MFU, in the log line and the metrics too.
    EXPECT_GT(s.mfu, 0) << "step " << s.step;
    EXPECT_LT(s.mfu, 1) << "step " << s.step;
    EXPECT_NE(step_log_line(s, true).find(" mfu="), std::string::npos);
    EXPECT_NE(step_json(s, true).find("\"mfu\":"), std::string::npos);
  }
  EXPECT_LT(last, first - 0.5) << "first=" << first << " last=" << last;
}

}  // namespace
}  // namespace hp
