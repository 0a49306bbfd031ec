#include "framework/model/model.h"

#include <array>
#include <cmath>
#include <type_traits>

#include "framework/core/log.h"
#include "framework/core/rng.h"
#include "framework/core/trace.h"
#include "framework/model/rope_table.h"

namespace hp {

struct Model::Layer {
  Param* attn_norm = nullptr;
  Param* wqkv = nullptr;
  Param* bqkv = nullptr;
  Param* wo = nullptr;
  Param* bo = nullptr;
  Param* sinks = nullptr;
  Param* q_norm = nullptr;
  Param* k_norm = nullptr;
  Param* ffn_norm = nullptr;
  // dense
  Param* w_gate_up = nullptr;
  Param* w_down = nullptr;
  // MoE
  Param* wr = nullptr;
  Param* br = nullptr;
  Param* w1 = nullptr;
  Param* b1 = nullptr;
  Param* w2 = nullptr;
  Param* b2 = nullptr;
  AttentionShape attn;
};

// What forward keeps for backward. With checkpointing only `x` and the routing plan survive
// forward; the rest is recomputed at the start of the layer's backward.
struct Model::LayerActs {
  Tensor x;  // block input [N, d]
  BatchMeta meta;
  Tensor xn, rstd1;
  Tensor qkv_pre, qk_rstd;  // before q/k norm (only with qk_norm)
  Tensor qkv, attn, lse;
  Tensor h, hn, rstd2;
  Tensor gu, act;  // dense FFN
  // MoE
  Tensor logits, idx, w, counts, offsets, s2a, a2s, xs, xe, he, ae, ye, ys, daux;
  bool have_plan = false;
  ExchangePlan plan;

  void drop_intermediates() {
    Tensor keep = x;
    BatchMeta m = meta;
    ExchangePlan p = plan;
    bool hp = have_plan;
    *this = LayerActs();
    x = keep;
    meta = m;
    plan = p;
    have_plan = hp;
  }
};

// What forward keeps for loss and backward (one micro-batch).
struct Model::PassState {
  Pass pass = Pass::kTrain;
  BatchMeta meta;
  std::vector<LayerActs> acts;       // per layer (kTrain)
  ActivationStore* store = nullptr;  // holds the block inputs in between (checkpointing)
  Tensor x_last;                     // input of the final norm
  Tensor rstd_final;                 // final norm's 1/rms per row
  Tensor hidden;                     // final hidden states: the unembedding's input [N, d]
  Tensor d_hidden;                   // loss(): d(grad_scale * loss) / d(hidden) (kTrain)
};

namespace {
// Static range names (profilers keep the pointer); layers past the table share the last name.
constexpr int kMaxNamedLayers = 9;
const char* const kLayerFwd[kMaxNamedLayers] = {"layer 0 fwd", "layer 1 fwd", "layer 2 fwd",
                                                "layer 3 fwd", "layer 4 fwd", "layer 5 fwd",
                                                "layer 6 fwd", "layer 7 fwd", "layer 8+ fwd"};
const char* const kLayerBwd[kMaxNamedLayers] = {"layer 0 bwd", "layer 1 bwd", "layer 2 bwd",
                                                "layer 3 bwd", "layer 4 bwd", "layer 5 bwd",
                                                "layer 6 bwd", "layer 7 bwd", "layer 8+ bwd"};

// C += or = A @ B with 2-D views, the one matmul shape the model needs most.
// Names the op family of the work issued next, for step profiles (framework/backend/profile.h).
void family(Backend& be, OpFamily f) { be.mark(be.phase(), f); }

void matmul(Backend& be, const Tensor& a, const Tensor& b, Tensor& c, bool ta = false,
            bool tb = false, double beta = 0.0) {
  be.gemm(a, ta, b, tb, c, 1.0, beta);
}
}  // namespace

Model::Model(const ModelConfig& cfg, const ModelOptions& opts, Backend& be,
             std::shared_ptr<ExpertExchange> exchange)
    : cfg_(cfg), opts_(opts), be_(be), exchange_(std::move(exchange)) {
  cfg_.validate();
  glu_.kind = cfg_.activation == Activation::kGptOss ? GluKind::kGptOss : GluKind::kSwiGLU;
  glu_.alpha = cfg_.swiglu_alpha;
  glu_.limit = cfg_.swiglu_limit;
  if (!exchange_) exchange_ = std::make_shared<LocalExpertExchange>();
  // precision=fp8 needs a backend with FP8 GEMMs (docs/design.md, "FP8 training"): one without
  // them (a GPU of another compute capability) is refused before any work, never run in bf16.
  if ((opts_.fp8_dense() || opts_.fp8_experts() || opts_.fp8_unembedding() ||
       opts_.fp8_unembedding_wgrad()) &&
      !be_.has_fp8_gemms())
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'precision': fp8 needs block-scaled FP8 GEMMs "
                  "(the CPU backend's emulation, or a CUDA device of compute capability 9.x or "
                  "10.x); backend ", be_.name(), " has none; use precision=bf16");
  if (cfg_.is_moe()) {
    const int ep = exchange_->ep_size();
    if (cfg_.n_experts % ep != 0)
      HP_USER_ERROR(ErrorKind::kConfig, "config key 'ep_size': n_experts=", cfg_.n_experts,
                    " must be divisible by ep_size=", ep);
    local_experts_ = cfg_.n_experts / ep;
    expert_begin_ = exchange_->ep_rank() * local_experts_;
  }
  build_params();
  YarnParams yarn;
  yarn.factor = cfg_.rope_scaling_factor;
  yarn.original_max_positions = cfg_.rope_original_max_positions;
  yarn.beta_fast = cfg_.rope_beta_fast;
  yarn.beta_slow = cfg_.rope_beta_slow;
  yarn.truncate = cfg_.rope_truncate;
  rope_ = make_rope_table(be_, cfg_.head_dim, opts_.max_positions, cfg_.rope_theta, yarn);
  set_offload(opts_.offload);
}

Model::~Model() = default;

void Model::set_offload(const OffloadOptions& o) {
  store_.reset();  // the old store finishes its copies before the new one allocates
  opts_.offload = o;
  if (o.mode != OffloadMode::kNone) opts_.checkpoint_activations = true;
  store_ = make_activation_store(be_, o);
}

void Model::build_params() {
  const int64_t d = cfg_.d_model, hd = cfg_.head_dim, hq = cfg_.n_heads, hkv = cfg_.n_kv_heads;
  const int64_t htot = hq + 2 * hkv;
  const double std = cfg_.init_std;
  const double out_std = cfg_.init_std / std::sqrt(2.0 * cfg_.n_layers);
  auto add = [&](const std::string& name, Shape shape, double init_std, double init_value,
                 bool decay, ParamGroup group = ParamGroup::kDense) -> Param* {
    Param p;
    p.name = name;
    p.global_shape = shape;
    p.shape = shape;
    if (group == ParamGroup::kExpert) {
      p.shape[0] = local_experts_;
      p.expert_begin = expert_begin_;
    }
    p.group = group;
    p.init_std = init_std;
    p.init_value = init_value;
    p.weight_decay = decay;
    return &params_.add(std::move(p));
  };
  embed_ = add("tok_embeddings", {cfg_.vocab_size, d}, std, 0, true);
  for (int l = 0; l < cfg_.n_layers; ++l) {
    auto L = std::make_unique<Layer>();
    const std::string pre = "layers." + std::to_string(l) + ".";
    L->attn_norm = add(pre + "attn_norm", {d}, 0, 1.0, false);
    L->wqkv = add(pre + "attn.wqkv", {d, htot * hd}, std, 0, true);
    if (cfg_.attn_bias) L->bqkv = add(pre + "attn.bqkv", {htot * hd}, 0, 0, false);
    if (cfg_.qk_norm) {
      L->q_norm = add(pre + "attn.q_norm", {hd}, 0, 1.0, false);
      L->k_norm = add(pre + "attn.k_norm", {hd}, 0, 1.0, false);
    }
    L->wo = add(pre + "attn.wo", {hq * hd, d}, out_std, 0, true);
    if (cfg_.attn_bias) L->bo = add(pre + "attn.bo", {d}, 0, 0, false);
    if (cfg_.attn_sinks) L->sinks = add(pre + "attn.sinks", {hq}, 0, 0, false);
    L->ffn_norm = add(pre + "ffn_norm", {d}, 0, 1.0, false);
    if (cfg_.is_moe()) {
      const int64_t e = cfg_.n_experts, f = cfg_.expert_ffn_dim;
      L->wr = add(pre + "moe.wr", {d, e}, std, 0, true);
      L->br = add(pre + "moe.br", {e}, 0, 0, false);
      L->w1 = add(pre + "moe.w1", {e, d, 2 * f}, std, 0, true, ParamGroup::kExpert);
      L->b1 = add(pre + "moe.b1", {e, 2 * f}, 0, 0, false, ParamGroup::kExpert);
      L->w2 = add(pre + "moe.w2", {e, f, d}, out_std, 0, true, ParamGroup::kExpert);
      L->b2 = add(pre + "moe.b2", {e, d}, 0, 0, false, ParamGroup::kExpert);
    } else {
      const int64_t f = cfg_.ffn_dim;
      L->w_gate_up = add(pre + "mlp.w_gate_up", {d, 2 * f}, std, 0, true);
      L->w_down = add(pre + "mlp.w_down", {f, d}, out_std, 0, true);
    }
    L->attn.n_heads = cfg_.n_heads;
    L->attn.n_kv_heads = cfg_.n_kv_heads;
    L->attn.head_dim = cfg_.head_dim;
    L->attn.window = cfg_.window_for_layer(l);
    L->attn.scale = 1.0 / std::sqrt(static_cast<double>(hd));
    layers_.push_back(std::move(L));
  }
  final_norm_ = add("final_norm", {d}, 0, 1.0, false);
  if (!cfg_.tie_embeddings) lm_head_ = add("lm_head", {d, cfg_.vocab_size}, std, 0, true);

  const DType md = be_.master_dtype(), ad = be_.act_dtype();
  for (auto& p : params_.all()) {
    p->master = be_.zeros(p->shape, md);
    p->grad = be_.zeros(p->shape, md);
    p->m = be_.zeros(p->shape, md);
    p->v = be_.zeros(p->shape, md);
    p->work = ad == md ? p->master : be_.zeros(p->shape, ad);
  }
}

void Model::init_params(uint64_t seed) {
  const DType md = be_.master_dtype();
  HP_CHECK(md == DType::kF32 || md == DType::kF64, "init_params: master dtype ", dtype_name(md));
  for (auto& p : params_.all()) {
    // Element i of the local shard is element (offset + i) of the global tensor, so every layout
    // draws the same numbers; counter-based draws make the order irrelevant, and the backend
    // draws them where the parameter lives (bitwise the same on every backend).
    const int64_t offset = p->group == ParamGroup::kExpert
                               ? p->expert_begin * (p->global_numel() / p->global_shape[0])
                               : 0;
    if (p->init_std > 0)
      be_.fill_normal(p->master, Philox(seed, "init." + p->name).key(), offset, p->init_std);
    else
      be_.fill(p->master, p->init_value);
  }
  refresh_working_copies();
}

void Model::refresh_working_copies() {
  for (auto& p : params_.all()) {
    if (p->sharded()) {
      // Only this rank's rows; the caller gathers the others (parallel/zero1.h).
      Tensor rows = p->work.slice(p->shard_begin, p->shard_begin + p->shard_rows);
      be_.convert(p->master, rows);
    } else if (p->work.storage() != p->master.storage()) {
      be_.convert(p->master, p->work);
    }
  }
}

// Zeroing is deferred to the backward: the GEMMs that produce most of the gradient bytes then
// write them (beta 0) instead of reading zeros back, and no fill pass runs over them.
void Model::zero_grads() {
  for (auto& p : params_.all()) {
    p->grad_zero = true;
    p->grad_zero_experts.clear();
  }
}

void Model::fill_unreached_grads() {
  FamilyScope scope(be_, OpFamily::kExpertGemm);
  for (auto& p : params_.all()) {
    for (size_t le = 0; le < p->grad_zero_experts.size(); ++le) {
      if (!p->grad_zero_experts[le]) continue;
      Tensor g = p->grad[static_cast<int64_t>(le)];
      be_.fill(g, 0.0);
    }
    p->grad_zero_experts.clear();
  }
}

double Model::grad_beta(Param& p) {
  const bool zero = p.grad_zero;
  p.grad_zero = false;
  return zero ? 0.0 : 1.0;
}

Tensor& Model::grad_acc(Param& p) {
  if (p.grad_zero) {
    be_.fill(p.grad, 0.0);
    p.grad_zero = false;
  }
  return p.grad;
}

void Model::settle_grads(int l) {
  if (params_by_layer_.empty()) {
    params_by_layer_.resize(static_cast<size_t>(cfg_.n_layers) + 1);
    for (auto& p : params_.all())
      params_by_layer_[static_cast<size_t>(param_layer(p->name) + 1)].push_back(p.get());
  }
  FamilyScope scope(be_, OpFamily::kElementwise);
  for (size_t i = 0; i < params_by_layer_.size(); ++i) {
    if (l != -2 && static_cast<int>(i) != l + 1) continue;
    for (Param* p : params_by_layer_[i])
      if (p->grad_zero) grad_acc(*p);
  }
}

void Model::dense_gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c,
                       double beta, const Tensor& bias, const Tensor& r, bool weight_grad) {
  // Weight gradients (dW = X^T dY, contracted over the tokens) stay in the activation dtype under
  // precision=fp8 as well (docs/design.md, "FP8 training").
  if (opts_.fp8_dense() && !weight_grad) {
    be_.gemm_fp8(a, ta, b, tb, c, beta, bias, r, fp8_spec());
  } else if (r.defined()) {
    be_.gemm_add(a, ta, b, tb, r, c, bias);
  } else if (bias.defined()) {
    be_.gemm_bias(a, ta, b, tb, c, bias);
  } else {
    be_.gemm(a, ta, b, tb, c, 1.0, beta);
  }
}

void Model::head_gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c) {
  if (opts_.fp8_unembedding())
    be_.gemm_fp8(a, ta, b, tb, c, 0.0, Tensor(), Tensor(), fp8_spec());
  else
    be_.gemm(a, ta, b, tb, c, 1.0, 0.0);
}

void Model::head_weight_grad(const Tensor& a, const Tensor& b, Tensor& c, double beta) {
  if (!opts_.fp8_unembedding_wgrad()) {
    matmul(be_, a, b, c, true, false, beta);
    return;
  }
  // Both operands blocked along the tokens, the contraction (Backend::gemm_fp8's weight-gradient
  // form); neither is a weight.
  Backend::Fp8Gemm spec = fp8_spec();
  spec.a = spec.b = fp8::Role::kData;
  be_.gemm_fp8(a, true, b, false, c, beta, Tensor(), Tensor(), spec);
}

void Model::expert_gemms(const std::vector<Backend::GemmProblem>& problems, bool ta, bool tb,
                         double beta, bool weight_grad) {
  if (opts_.fp8_experts() && !weight_grad) {
    be_.gemm_fp8_group(problems, ta, tb, beta, fp8_spec());
  } else {
    be_.gemm_group(problems, ta, tb, beta);
  }
}

Backend::Fp8Gemm Model::fp8_spec() const {
  Backend::Fp8Gemm spec;
  spec.recipe = opts_.fp8_recipe;
  return spec;
}

void Model::hold_fp8_weights(int l) {
  const Layer& L = *layers_[static_cast<size_t>(l)];
  // Each class under its GEMM family, so that a profile counts the quantization with its products.
  if (opts_.fp8_dense()) {
    std::vector<Tensor> w = {L.wqkv->work, L.wo->work};
    if (!cfg_.is_moe()) {
      w.push_back(L.w_gate_up->work);
      w.push_back(L.w_down->work);
    }
    FamilyScope scope(be_, OpFamily::kDenseGemm);
    be_.hold_fp8_weights(w, fp8_spec());
  }
  if (opts_.fp8_experts() && cfg_.is_moe()) {
    std::vector<Tensor> w;
    for (int le = 0; le < local_experts_; ++le) {
      w.push_back(L.w1->work[le]);
      w.push_back(L.w2->work[le]);
    }
    FamilyScope scope(be_, OpFamily::kExpertGemm);
    be_.hold_fp8_weights(w, fp8_spec());
  }
}

Tensor Model::new_act(Shape s) { return be_.empty(std::move(s), be_.act_dtype()); }
Tensor Model::new_master(Shape s) { return be_.empty(std::move(s), be_.master_dtype()); }

void Model::layer_forward(int l, const BatchMeta& meta_in, LayerActs& a, bool recompute) {
  Layer& L = *layers_[static_cast<size_t>(l)];
  const int64_t n = a.x.dim(0), d = cfg_.d_model, hd = cfg_.head_dim;
  const int64_t hq = cfg_.n_heads, hkv = cfg_.n_kv_heads, htot = hq + 2 * hkv;
  if (!recompute) {
    a.meta = meta_in;
    if (opts_.metadata == MetadataMode::kPerLayer) be_.rebuild_metadata(a.meta);
    hold_fp8_weights(l);  // after the weights are ready (Model::forward's param_ready)
  }
  // Attention block.
  a.xn = new_act({n, d});
  a.rstd1 = new_master({n});
  family(be_, OpFamily::kElementwise);
  be_.rmsnorm_fwd(a.x, L.attn_norm->work, cfg_.norm_eps, a.xn, a.rstd1);
  family(be_, OpFamily::kDenseGemm);
  Tensor qkv_flat = new_act({n, htot * hd});
  dense_gemm(a.xn, false, L.wqkv->work, false, qkv_flat, 0.0, L.bqkv ? L.bqkv->work : Tensor(),
             Tensor(), false);
  a.qkv = qkv_flat.reshape({n, htot, hd});
  family(be_, OpFamily::kElementwise);
  if (cfg_.qk_norm) {
    a.qkv_pre = a.qkv;
    a.qkv = new_act({n, htot, hd});
    a.qk_rstd = new_master({n, hq + hkv});
    be_.qk_norm_rope_fwd(a.qkv_pre, L.q_norm->work, L.k_norm->work, hq, hkv, cfg_.norm_eps,
                         a.meta.positions, rope_, a.qkv, a.qk_rstd);
  } else {
    be_.rope(a.qkv, static_cast<int>(hq + hkv), a.meta.positions, rope_, false);
  }
  a.attn = new_act({n, hq, hd});
  a.lse = new_master({n, hq});
  Tensor no_sinks;
  family(be_, OpFamily::kAttention);
  be_.attention_fwd(a.qkv, L.sinks ? L.sinks->work : no_sinks, a.meta, L.attn, a.attn, a.lse);
  // h = x + attn Wo (+ bo): the product lands on the residual.
  a.h = new_act({n, d});
  family(be_, OpFamily::kDenseGemm);
  const Tensor attn_flat = a.attn.reshape({n, hq * hd});
  dense_gemm(attn_flat, false, L.wo->work, false, a.h, 0.0, L.bo ? L.bo->work : Tensor(), a.x,
             false);
  family(be_, OpFamily::kElementwise);
  // FFN block.
  a.hn = new_act({n, d});
  a.rstd2 = new_master({n});
  be_.rmsnorm_fwd(a.h, L.ffn_norm->work, cfg_.norm_eps, a.hn, a.rstd2);
  if (cfg_.is_moe()) {
    moe_forward(l, a, recompute);
  } else {
    const int64_t f = cfg_.ffn_dim;
    a.gu = new_act({n, 2 * f});
    family(be_, OpFamily::kDenseGemm);
    dense_gemm(a.hn, false, L.w_gate_up->work, false, a.gu, 0.0, Tensor(), Tensor(), false);
    family(be_, OpFamily::kElementwise);
    a.act = new_act({n, f});
    // Under fp8 the down projection (Model::forward, next) takes act's codes from the GLU; a
    // recomputed forward has no down projection after it.
    if (opts_.fp8_dense() && !recompute)
      be_.glu_fwd_fp8(a.gu, glu_, a.act, fp8_spec());
    else
      be_.glu_fwd(a.gu, glu_, a.act);
  }
}

void Model::moe_forward(int l, LayerActs& a, bool recompute) {
  Layer& L = *layers_[static_cast<size_t>(l)];
  const int64_t n = a.hn.dim(0), d = cfg_.d_model, e = cfg_.n_experts, k = cfg_.top_k;
  const int64_t f = cfg_.expert_ffn_dim;
  a.logits = new_act({n, e});
  family(be_, OpFamily::kRouting);
  be_.gemm_bias(a.hn, false, L.wr->work, false, a.logits, L.br->work);
  a.idx = be_.empty({n, k}, DType::kI32);
  a.w = new_act({n, k});
  be_.router_topk(a.logits, static_cast<int>(k), a.idx, a.w);
  Tensor ids = a.idx.reshape({n * k});
  a.counts = be_.empty({e}, DType::kI32);
  be_.histogram(ids, static_cast<int>(e), a.counts);
  a.offsets = be_.empty({e + 1}, DType::kI32);
  be_.exclusive_scan(a.counts, a.offsets);
  a.s2a = be_.empty({n * k}, DType::kI32);
  a.a2s = be_.empty({n * k}, DType::kI32);
  be_.sort_by_id(ids, a.offsets, a.s2a, a.a2s);
  // The one host sync of the layer: counts become the exchange sizes and the GEMM sizes.
  // Recompute in backward reuses the plan from forward.
  if (!recompute || !a.have_plan) {
    a.plan = exchange_->plan(be_, a.counts, static_cast<int>(e), opts_.routing);
    a.have_plan = true;
  }
  a.xs = new_act({n * k, d});
  be_.permute_rows(a.hn, a.s2a, static_cast<int>(k), a.xs);
  a.xe = exchange_->dispatch(be_, a.plan, a.xs);
  const int64_t rows = a.plan.expert_rows;
  a.he = new_act({rows, 2 * f});
  a.ae = new_act({rows, f});
  a.ye = new_act({rows, d});
  // The experts' products go to the backend as groups (which may run them at once); the chunks
  // tile the expert rows, so the activation runs over all of them in one call.
  std::vector<Backend::GemmProblem> up, down;
  for (const auto& c : a.plan.chunks()) {
    if (c.rows == 0) continue;
    const int64_t b = c.begin, en = c.begin + c.rows;
    up.push_back({a.xe.slice(b, en), L.w1->work[c.local_expert], a.he.slice(b, en),
                  L.b1->work[c.local_expert]});
    down.push_back({a.ae.slice(b, en), L.w2->work[c.local_expert], a.ye.slice(b, en),
                    L.b2->work[c.local_expert]});
  }
  family(be_, OpFamily::kExpertGemm);
  if (rows > 0) {
    expert_gemms(up, false, false, 0.0, false);
    be_.glu_fwd(a.he, glu_, a.ae);
    expert_gemms(down, false, false, 0.0, false);
  }
  family(be_, OpFamily::kRouting);
  a.ys = exchange_->combine(be_, a.plan, a.ye);
  if (cfg_.moe_aux_coef > 0) {
    // The loss value counts once, in forward; a recompute only regenerates the gradient.
    // f_e needs the global counts. With W ranks of N/W tokens each, the op's local f and P
    // normalizations are W times too large each, hence coef / W^2 for this rank's exact share.
    a.daux = be_.zeros({n, e}, be_.act_dtype());
    Tensor scratch = recompute ? be_.zeros({1}, be_.master_dtype()) : aux_sum_;
    Tensor counts = a.counts;
    const int w = exchange_->data_ranks();
    if (w > 1) {
      counts = be_.empty({e}, DType::kI32);
      be_.copy(a.counts, counts);
      exchange_->sum_over_data_ranks(be_, counts);
    }
    be_.router_aux_loss(a.logits, counts, static_cast<int>(k),
                        cfg_.moe_aux_coef / (static_cast<double>(w) * w), scratch, a.daux);
  }
}

void Model::forward(const BatchMeta& meta, const Tensor& aux_sum, Pass pass,
                    ParamReadyHook* param_ready) {
  HP_CHECK(aux_sum.defined(), "Model::forward: aux_sum must be a [1] tensor");
  const int64_t n = meta.inputs.dim(0), d = cfg_.d_model;
  const bool train = pass == Pass::kTrain;
  const bool ckpt = opts_.checkpoint_activations;
  pass_ = std::make_unique<PassState>();
  be_.release_fp8_weights();  // what a pass that did not finish left held
  PassState& st = *pass_;
  st.pass = pass;
  st.meta = meta;
  aux_sum_ = aux_sum;
  st.acts.resize(train ? static_cast<size_t>(cfg_.n_layers) : 1);
  // With checkpointing, block inputs live in the activation store between forward and backward.
  st.store = ckpt && train ? store_.get() : nullptr;
  if (st.store) st.store->begin_step(cfg_.n_layers);

  Tensor x = new_act({n, d});
  if (param_ready) param_ready->layer_needed(-1);
  FamilyScope scope(be_, OpFamily::kEmbedding);
  be_.embedding_fwd(embed_->work, meta.inputs, x);
  for (int l = 0; l < cfg_.n_layers; ++l) {
    LayerActs& a = st.acts[train ? static_cast<size_t>(l) : 0];
    TraceRange range(kLayerFwd[std::min(l, kMaxNamedLayers - 1)]);
    if (param_ready) param_ready->layer_needed(l);
    a.x = x;
    if (st.store) st.store->save(l, x);  // before the layer, so its offload overlaps the layer
    layer_forward(l, meta, a, false);
    // Layer output: h + ffn(hn).
    Tensor out = new_act({n, d});
    if (cfg_.is_moe()) {
      family(be_, OpFamily::kRouting);
      be_.unpermute_combine(a.ys, a.a2s, a.w, out);
      family(be_, OpFamily::kElementwise);
      be_.add(out, a.h, out);
    } else {
      family(be_, OpFamily::kDenseGemm);
      dense_gemm(a.act, false, layers_[static_cast<size_t>(l)]->w_down->work, false, out, 0.0,
                 Tensor(), a.h, false);
    }
    if (!train) a = LayerActs();
    if (ckpt) a.drop_intermediates();
    if (st.store) a.x = Tensor();
    x = out;
  }
  if (!train) be_.release_fp8_weights();
  st.x_last = x;
  st.hidden = new_act({n, d});
  st.rstd_final = new_master({n});
  family(be_, OpFamily::kElementwise);
  be_.rmsnorm_fwd(x, final_norm_->work, cfg_.norm_eps, st.hidden, st.rstd_final);
}

void Model::loss(double grad_scale, const Tensor& lm_sum) {
  HP_CHECK(pass_ && pass_->hidden.defined(), "Model::loss: call forward() first");
  PassState& st = *pass_;
  const bool train = st.pass == Pass::kTrain;
  const int64_t n = st.hidden.dim(0), d = cfg_.d_model, vocab = cfg_.vocab_size;
  Tensor lm = lm_sum;
  FamilyScope scope(be_, OpFamily::kDenseGemm);
  if (train) st.d_hidden = be_.zeros({n, d}, be_.act_dtype());
  // The unembedding's weight, quantized once for every chunk's logits and input gradient; it
  // stays held until backward ends (release_fp8_weights), or this eval pass's loss does.
  const Tensor& head = lm_head_ ? lm_head_->work : embed_->work;
  if (opts_.fp8_unembedding()) be_.hold_fp8_weights({head}, fp8_spec());
  // Unembedding + cross-entropy in row chunks: logits for the whole batch never exist at once.
  const int64_t chunk = std::max<int64_t>(1, opts_.ce_chunk_tokens);
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t r1 = std::min(n, r0 + chunk);
    TraceRange range("unembed+loss chunk");
    Tensor hc = st.hidden.slice(r0, r1);
    Tensor chunk_logits = new_act({r1 - r0, vocab});
    family(be_, OpFamily::kDenseGemm);
    // lm_head is [d, vocab]; a tied embedding is [vocab, d].
    head_gemm(hc, false, head, !lm_head_, chunk_logits);
    Tensor tc = st.meta.targets.slice(r0, r1);
    // Adds the chunk's -log p to lm and replaces the logits by d(grad_scale * loss)/d(logits),
    // in place: the chunk's one [rows, vocab] buffer serves both.
    family(be_, OpFamily::kCrossEntropy);
    if (train && opts_.fp8_unembedding())  // the input gradient below takes dlogits' codes
      be_.cross_entropy_fp8(chunk_logits, tc, grad_scale, lm, fp8_spec());
    else
      be_.cross_entropy(chunk_logits, tc, grad_scale, lm);
    if (!train) continue;
    family(be_, OpFamily::kDenseGemm);
    const Tensor dlogits = chunk_logits;
    Tensor dhc = st.d_hidden.slice(r0, r1);
    head_gemm(dlogits, false, head, static_cast<bool>(lm_head_), dhc);
    if (lm_head_)
      head_weight_grad(hc, dlogits, lm_head_->grad, grad_beta(*lm_head_));
    else
      head_weight_grad(dlogits, hc, embed_->grad, grad_beta(*embed_));
  }
  if (!train) be_.release_fp8_weights();
}

void Model::backward(GradReadyHook* grad_ready, bool leave_unreached) {
  HP_CHECK(pass_ && pass_->pass == Pass::kTrain && pass_->d_hidden.defined(),
           "Model::backward: call forward(Pass::kTrain) and loss() first");
  HP_CHECK(!(grad_ready && leave_unreached),
           "Model::backward: leave_unreached needs no grad_ready hook (the hook reads every "
           "gradient as each layer finishes)");
  leave_unreached_ = leave_unreached;
  PassState& st = *pass_;
  const int64_t n = st.hidden.dim(0), d = cfg_.d_model;
  const bool ckpt = opts_.checkpoint_activations;
  Tensor dx = new_act({n, d});
  FamilyScope scope(be_, OpFamily::kElementwise);
  be_.rmsnorm_bwd(st.x_last, final_norm_->work, st.rstd_final, st.d_hidden, dx,
                  grad_acc(*final_norm_), false);
  st.hidden = Tensor();
  st.d_hidden = Tensor();
  for (int l = cfg_.n_layers - 1; l >= 0; --l) {
    LayerActs& a = st.acts[static_cast<size_t>(l)];
    TraceRange range(kLayerBwd[std::min(l, kMaxNamedLayers - 1)]);
    if (st.store) a.x = st.store->load(l);
    if (ckpt) layer_forward(l, st.meta, a, true);
    layer_backward(l, a, dx);
    a = LayerActs();
    settle_grads(l);
    if (grad_ready) grad_ready->layer_ready(l);
  }
  if (st.store) st.store->end_step();
  be_.release_fp8_weights();
  family(be_, OpFamily::kEmbedding);
  be_.embedding_bwd(dx, st.meta.inputs, grad_acc(*embed_));
  settle_grads(-2);
  if (grad_ready) grad_ready->layer_ready(-1);
  leave_unreached_ = false;
  pass_.reset();
}

void Model::layer_backward(int l, LayerActs& a, Tensor& dx) {
  Layer& L = *layers_[static_cast<size_t>(l)];
  const int64_t n = a.x.dim(0), d = cfg_.d_model, hd = cfg_.head_dim;
  const int64_t hq = cfg_.n_heads, hkv = cfg_.n_kv_heads, htot = hq + 2 * hkv;
  // dx holds d(layer output). Output = h + ffn(hn): dh = dx + d(ffn path).
  Tensor dhn = new_act({n, d});
  if (cfg_.is_moe()) {
    moe_backward(l, a, dx, dhn);
  } else {
    const int64_t f = cfg_.ffn_dim;
    Tensor dact = new_act({n, f});
    family(be_, OpFamily::kDenseGemm);
    dense_gemm(dx, false, L.w_down->work, true, dact, 0.0, Tensor(), Tensor(), false);
    dense_gemm(a.act, true, dx, false, L.w_down->grad, grad_beta(*L.w_down), Tensor(), Tensor(),
               true);
    Tensor dgu = new_act({n, 2 * f});
    family(be_, OpFamily::kElementwise);
    if (opts_.fp8_dense())  // the input gradient below takes dgu's codes from the GLU
      be_.glu_bwd_fp8(a.gu, dact, glu_, dgu, fp8_spec());
    else
      be_.glu_bwd(a.gu, dact, glu_, dgu);
    family(be_, OpFamily::kDenseGemm);
    dense_gemm(dgu, false, L.w_gate_up->work, true, dhn, 0.0, Tensor(), Tensor(), false);
    dense_gemm(a.hn, true, dgu, false, L.w_gate_up->grad, grad_beta(*L.w_gate_up), Tensor(),
               Tensor(), true);
  }
  // dh = dx + d(norm path), accumulated into dx's buffer (the FFN path has read dx by now).
  family(be_, OpFamily::kElementwise);
  be_.rmsnorm_bwd(a.h, L.ffn_norm->work, a.rstd2, dhn, dx, grad_acc(*L.ffn_norm), true);
  Tensor dh = dx;
  // h = x + attn @ wo + bo.
  family(be_, OpFamily::kDenseGemm);
  if (L.bo) be_.bias_grad(dh, grad_acc(*L.bo));
  dense_gemm(a.attn.reshape({n, hq * hd}), true, dh, false, L.wo->grad, grad_beta(*L.wo),
             Tensor(), Tensor(), true);
  Tensor dattn = new_act({n, hq, hd});
  Tensor dattn_flat = dattn.reshape({n, hq * hd});
  dense_gemm(dh, false, L.wo->work, true, dattn_flat, 0.0, Tensor(), Tensor(), false);
  Tensor dqkv = new_act({n, htot, hd});
  Tensor no_sinks;
  Tensor dsinks = L.sinks ? grad_acc(*L.sinks) : no_sinks;
  family(be_, OpFamily::kAttention);
  be_.attention_bwd(a.qkv, L.sinks ? L.sinks->work : no_sinks, a.meta, L.attn, a.attn, a.lse, dattn,
                    dqkv, dsinks);
  family(be_, OpFamily::kElementwise);
  if (cfg_.qk_norm) {
    // In place: the gradient before the norm replaces the one after rope.
    be_.qk_norm_rope_bwd(a.qkv_pre, L.q_norm->work, L.k_norm->work, hq, hkv, a.qk_rstd,
                         a.meta.positions, rope_, dqkv, dqkv, grad_acc(*L.q_norm),
                         grad_acc(*L.k_norm));
  } else {
    be_.rope(dqkv, static_cast<int>(hq + hkv), a.meta.positions, rope_, true);
  }
  Tensor dqkv_flat = dqkv.reshape({n, htot * hd});
  family(be_, OpFamily::kDenseGemm);
  if (L.bqkv) be_.bias_grad(dqkv_flat, grad_acc(*L.bqkv));
  dense_gemm(a.xn, true, dqkv_flat, false, L.wqkv->grad, grad_beta(*L.wqkv), Tensor(), Tensor(),
             true);
  Tensor dxn = new_act({n, d});
  dense_gemm(dqkv_flat, false, L.wqkv->work, true, dxn, 0.0, Tensor(), Tensor(), false);
  // d(layer input) = dh + d(norm path), into dh's buffer (the attention path has read dh).
  family(be_, OpFamily::kElementwise);
  be_.rmsnorm_bwd(a.x, L.attn_norm->work, a.rstd1, dxn, dh, grad_acc(*L.attn_norm), true);
  dx = dh;
}

void Model::moe_backward(int l, LayerActs& a, const Tensor& dy, Tensor& dhn) {
  Layer& L = *layers_[static_cast<size_t>(l)];
  const int64_t n = a.hn.dim(0), d = cfg_.d_model, e = cfg_.n_experts, k = cfg_.top_k;
  const int64_t f = cfg_.expert_ffn_dim;
  Tensor dys = new_act({n * k, d});
  Tensor dw = new_act({n, k});
  family(be_, OpFamily::kRouting);
  be_.unpermute_combine_bwd(dy, a.ys, a.a2s, a.w, dys, dw);
  // The adjoint of combine is a dispatch with the same plan, and vice versa.
  Tensor dye = exchange_->dispatch(be_, a.plan, dys);
  const int64_t rows = a.plan.expert_rows;
  Tensor dxe = new_act({rows, d});
  Tensor dae = new_act({rows, f});
  Tensor dhe = new_act({rows, 2 * f});
  // Weight gradients accumulate per expert; under ep > 1 an expert has a chunk from each source
  // rank, in source order. The first product of an expert after zero_grads writes (beta 0), the
  // others add (beta 1); each group has one beta and disjoint outputs, and the groups run in
  // source order, so every expert sums its chunks in the order one product after another would.
  const std::vector<ExchangePlan::Chunk> chunks = a.plan.chunks();
  const bool w_zero = L.w1->grad_zero;
  HP_CHECK(L.w2->grad_zero == w_zero && L.w1->grad_zero_experts == L.w2->grad_zero_experts,
           "moe_backward: w1 and w2 gradients out of step");
  // Whether an expert's gradient memory holds its sum so far (else it is zero, unwritten).
  std::vector<char> written(static_cast<size_t>(local_experts_));
  for (int le = 0; le < local_experts_; ++le)
    written[static_cast<size_t>(le)] = !w_zero && !L.w1->expert_grad_unwritten(le);
  std::vector<Backend::GemmProblem> dact, dinput;
  // [source][0: writes, 1: adds]
  std::vector<std::array<std::vector<Backend::GemmProblem>, 2>> dw2(
      static_cast<size_t>(a.plan.ep_size)),
      dw1(static_cast<size_t>(a.plan.ep_size));
  for (size_t i = 0; i < chunks.size(); ++i) {
    const auto& c = chunks[i];
    if (c.rows == 0) continue;
    const int le = c.local_expert;
    const size_t src = i / static_cast<size_t>(a.plan.experts_per_rank);
    const int adds = written[static_cast<size_t>(le)];
    written[static_cast<size_t>(le)] = 1;
    const int64_t b = c.begin, en = c.begin + c.rows;
    dw2[src][adds].push_back({a.ae.slice(b, en), dye.slice(b, en), L.w2->grad[le], {}});
    dact.push_back({dye.slice(b, en), L.w2->work[le], dae.slice(b, en), {}});
    dw1[src][adds].push_back({a.xe.slice(b, en), dhe.slice(b, en), L.w1->grad[le], {}});
    dinput.push_back({dhe.slice(b, en), L.w1->work[le], dxe.slice(b, en), {}});
  }
  L.w1->grad_zero = L.w2->grad_zero = false;
  family(be_, OpFamily::kExpertGemm);
  // Experts no row reached: their zero gradient, written, or flagged for an optimizer that reads
  // the flags (backward's leave_unreached; on GPT-OSS-20b each is 99 MB of fills otherwise).
  if (leave_unreached_) {
    std::vector<char> unwritten(static_cast<size_t>(local_experts_));
    for (int le = 0; le < local_experts_; ++le)
      unwritten[static_cast<size_t>(le)] = !written[static_cast<size_t>(le)];
    L.w1->grad_zero_experts = L.w2->grad_zero_experts = unwritten;
  } else {
    for (int le = 0; le < local_experts_; ++le) {
      if (written[static_cast<size_t>(le)]) continue;
      Tensor g1 = L.w1->grad[le], g2 = L.w2->grad[le];
      be_.fill(g1, 0.0);
      be_.fill(g2, 0.0);
    }
    L.w1->grad_zero_experts.clear();
    L.w2->grad_zero_experts.clear();
  }
  auto run_dw = [&](const std::vector<std::array<std::vector<Backend::GemmProblem>, 2>>& groups) {
    for (const auto& g : groups) {
      expert_gemms(g[0], true, false, 0.0, true);
      expert_gemms(g[1], true, false, 1.0, true);
    }
  };
  // Each expert's bias gradient adds its chunks' rows (zero-filled once, first), in chunk order.
  auto bias_grads = [&](const Tensor& dy, Param& bias) {
    grad_acc(bias);
    std::vector<Backend::RowSegment> segments;
    for (const auto& c : chunks)
      if (c.rows > 0) segments.push_back({c.begin, c.rows, bias.grad[c.local_expert]});
    be_.bias_grad_segments(dy, segments);
  };
  if (rows > 0) {
    bias_grads(dye, *L.b2);
    run_dw(dw2);
    expert_gemms(dact, false, true, 0.0, false);
    be_.glu_bwd(a.he, dae, glu_, dhe);
    bias_grads(dhe, *L.b1);
    run_dw(dw1);
    expert_gemms(dinput, false, true, 0.0, false);
  }
  family(be_, OpFamily::kRouting);
  Tensor dxs = exchange_->combine(be_, a.plan, dxe);
  be_.permute_rows_bwd(dxs, a.s2a, static_cast<int>(k), dhn);
  Tensor dlogits = new_act({n, e});
  be_.router_topk_bwd(a.idx, a.w, dw, dlogits);
  if (a.daux.defined()) be_.add(dlogits, a.daux, dlogits);
  be_.bias_grad(dlogits, grad_acc(*L.br));
  matmul(be_, a.hn, dlogits, L.wr->grad, true, false, grad_beta(*L.wr));
  matmul(be_, dlogits, L.wr->work, dhn, false, true, 1.0);
}

LossSums Model::forward_backward(const BatchMeta& meta, double grad_scale, LossSums into) {
  if (!into.lm.defined()) into.lm = be_.zeros({1}, be_.master_dtype());
  if (!into.aux.defined()) into.aux = be_.zeros({1}, be_.master_dtype());
  forward(meta, into.aux, Pass::kTrain);
  loss(grad_scale, into.lm);
  backward(nullptr);
  return into;
}

Tensor Model::logits(const BatchMeta& meta) {
  Tensor aux = be_.zeros({1}, be_.master_dtype());
  forward(meta, aux, Pass::kEval);
  const int64_t n = pass_->hidden.dim(0);
  Tensor out = new_act({n, cfg_.vocab_size});
  // The products loss() runs: FP8 under the unembedding class.
  const Tensor& head = lm_head_ ? lm_head_->work : embed_->work;
  FamilyScope scope(be_, OpFamily::kDenseGemm);
  if (opts_.fp8_unembedding()) be_.hold_fp8_weights({head}, fp8_spec());
  head_gemm(pass_->hidden, false, head, !lm_head_, out);
  if (opts_.fp8_unembedding()) be_.release_fp8_weights();
  pass_.reset();
  return out;
}

LossSums Model::evaluate(const BatchMeta& meta, LossSums into) {
  if (!into.lm.defined()) into.lm = be_.zeros({1}, be_.master_dtype());
  if (!into.aux.defined()) into.aux = be_.zeros({1}, be_.master_dtype());
  forward(meta, into.aux, Pass::kEval);
  loss(1.0, into.lm);
  pass_.reset();
  return into;
}

}  // namespace hp
