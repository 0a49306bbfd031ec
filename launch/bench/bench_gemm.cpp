#include "launch/bench/bench_gemm.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "framework/core/error.h"
#include "launch/bench/bench_util.h"
#include "launch/json.h"
#include "launch/train/components.h"
#if HOTPATH_HAVE_CUDA
#include "framework/backend/cuda/cuda_backend.h"
#endif

namespace hp {
namespace {

// A product c[m, n] = op(a) op(b), K = k; `product` names which of a layer's three it is.
struct Gemm {
  std::string weight, product;
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  bool f32_accumulate = false;  // the weight gradient: c f32, beta 1
};

// A weight [in, out] used by `rows` rows: its forward, input gradient and weight gradient.
void add_weight(std::vector<Gemm>& out, const std::string& name, int64_t rows, int64_t in,
                int64_t out_dim) {
  out.push_back({name, "forward", rows, out_dim, in, false, false, false});
  out.push_back({name, "input_grad", rows, in, out_dim, false, true, false});
  out.push_back({name, "weight_grad", in, out_dim, rows, true, false, true});
}

std::vector<Gemm> products(const TrainOptions& o, int64_t div) {
  const ModelConfig& m = o.model;
  auto s = [&](int64_t v) { return std::max<int64_t>(1, v / div); };
  std::vector<Gemm> g;
  g.push_back({"cube", "forward", s(8192), s(8192), s(8192), false, false, false});
  const int64_t t = o.data.batch_tokens, d = m.d_model;
  const int64_t q = static_cast<int64_t>(m.n_heads) * m.head_dim;
  const int64_t qkv = static_cast<int64_t>(m.n_heads + 2 * m.n_kv_heads) * m.head_dim;
  add_weight(g, "attn_qkv", s(t), s(d), s(qkv));
  add_weight(g, "attn_out", s(t), s(q), s(d));
  if (m.is_moe()) {
    const int64_t rows = t * m.top_k / m.n_experts, f = m.expert_ffn_dim;
    add_weight(g, "expert_gate_up", s(rows), s(d), s(2 * f));
    add_weight(g, "expert_down", s(rows), s(f), s(d));
  } else {
    add_weight(g, "ffn_gate_up", s(t), s(d), s(2 * int64_t{m.ffn_dim}));
    add_weight(g, "ffn_down", s(t), s(m.ffn_dim), s(d));
  }
  // The unembedding [d, vocab] over every token (ce_chunk_tokens at or above batch_tokens):
  // GPT-OSS-20b's largest product.
  add_weight(g, "unembedding", s(t), s(d), s(m.vocab_size));
  return g;
}

struct Row {
  Gemm g;
  double act_ms = 0, fp8_ms = 0, quant_ms = 0;
  bool fp8 = false, quant = false;
};

double tflops(double flops, double ms) { return ms > 0 ? flops / (ms * 1e9) : 0; }

// Calls per timed sample: enough that a sample holds about 4 ms of work at 700 TFLOP/s.
int64_t calls_per_sample(const Gemm& g) {
  const double flops = 2.0 * g.m * g.n * g.k;
  return std::clamp<int64_t>(static_cast<int64_t>(4e-3 * 700e12 / std::max(flops, 1.0)), 1, 200);
}

}  // namespace

int run_bench_gemm(const TrainOptions& o, const RankContext& ctx) {
  std::unique_ptr<Backend> be = make_backend(o, ctx.launch.local_rank);
  const bool cuda = be->device() == Device::kCUDA;
  const int64_t div = cuda ? 1 : 32;
  // The device's FP8 recipe, or why there is none.
  Backend::Fp8Gemm spec;
  std::string fp8_why;
  bool fp8_ok = true;
#if HOTPATH_HAVE_CUDA
  if (cuda) {
    try {
      spec.recipe = cuda_fp8_recipe(*be);
    } catch (const Error& e) {
      fp8_ok = false;
      fp8_why = e.what();
    }
  }
#endif
  const DType act = be->act_dtype();
  const auto random = [&](Shape dims, uint64_t seed) {
    Tensor draws = be->empty(dims, be->master_dtype());
    be->fill_normal(draws, seed, 0, 1.0);
    if (act == be->master_dtype()) return draws;
    Tensor t = be->empty(dims, act);
    be->convert(draws, t);
    return t;
  };
  std::vector<Row> rows;
  uint64_t seed = o.run.seed;
  for (const Gemm& g : products(o, div)) {
    Row r;
    r.g = g;
    Tensor a = random(g.trans_a ? Shape{g.k, g.m} : Shape{g.m, g.k}, ++seed);
    Tensor b = random(g.trans_b ? Shape{g.n, g.k} : Shape{g.k, g.n}, ++seed);
    Tensor c = g.f32_accumulate ? be->zeros({g.m, g.n}, DType::kF32) : be->empty({g.m, g.n}, act);
    const double beta = g.f32_accumulate ? 1.0 : 0.0;
    Backend::Fp8Gemm s = spec;
    if (g.product == "weight_grad") s.b = fp8::Role::kData;
    const int64_t calls = calls_per_sample(g);
    auto sample = [&](auto&& fn) {
      std::vector<double> v;
      for (int64_t it = 0; it < o.bench.warmup + o.bench.steps; ++it) {
        const double ms = time_ms(*be, [&] {
          for (int64_t i = 0; i < calls; ++i) fn();
        });
        if (it >= o.bench.warmup) v.push_back(ms / static_cast<double>(calls));
      }
      return median(v);
    };
    r.act_ms = sample([&] { be->gemm(a, g.trans_a, b, g.trans_b, c, 1.0, beta); });
    if (fp8_ok) {
      r.fp8 = true;
      r.fp8_ms =
          sample([&] { be->gemm_fp8(a, g.trans_a, b, g.trans_b, c, beta, Tensor(), Tensor(), s); });
#if HOTPATH_HAVE_CUDA
      if (cuda) {
        // Both operands as gemm_fp8 quantizes them: op(a) and op(b)^T along K.
        const bool mx = s.recipe == fp8::Recipe::kMx32;
        r.quant = true;
        r.quant_ms = sample([&] {
          cuda_fp8_quantize_only(*be, a, g.trans_a, s.recipe, mx ? fp8::Role::kData : s.a);
          cuda_fp8_quantize_only(*be, b, !g.trans_b, s.recipe, mx ? fp8::Role::kData : s.b);
        });
      }
#endif
    }
    rows.push_back(r);
  }
  if (ctx.rank() != 0) return 0;
  const std::string recipe = fp8_ok ? fp8::recipe_name(spec.recipe) : "none";
  std::printf("bench gemm: backend=%s fp8 recipe=%s%s%s steps=%lld warmup=%lld%s\n",
              be->name().c_str(), recipe.c_str(), fp8_ok ? "" : " (", fp8_ok ? "" : fp8_why.c_str(),
              static_cast<long long>(o.bench.steps), static_cast<long long>(o.bench.warmup),
              div > 1 ? " (CPU: every dimension divided by 32)" : "");
  if (!fp8_ok) std::printf(")\n");
  const std::string act_ms = std::string(dtype_name(act)) + " ms";
  const std::string act_tf = std::string(dtype_name(act)) + " TFLOP/s";
  std::printf("%-15s %-11s %6s %6s %6s %10s %10s %10s %12s %12s %14s\n", "weight", "product", "m",
              "n", "k", act_ms.c_str(), "fp8 ms", "quant ms", act_tf.c_str(), "fp8 TFLOP/s",
              "matmul TFLOP/s");
  Json row_json = Json::array();
  for (const Row& r : rows) {
    const double flops = 2.0 * r.g.m * r.g.n * r.g.k;
    const double matmul_ms = r.quant ? r.fp8_ms - r.quant_ms : 0;
    std::printf("%-15s %-11s %6lld %6lld %6lld %10.4f %10.4f %10.4f %12.1f %12.1f %14.1f\n",
                r.g.weight.c_str(), r.g.product.c_str(), static_cast<long long>(r.g.m),
                static_cast<long long>(r.g.n), static_cast<long long>(r.g.k), r.act_ms, r.fp8_ms,
                r.quant_ms, tflops(flops, r.act_ms), tflops(flops, r.fp8_ms),
                tflops(flops, matmul_ms));
    Json j = {{"weight", r.g.weight},
              {"product", r.g.product},
              {"m", r.g.m},
              {"n", r.g.n},
              {"k", r.g.k},
              {"trans_a", r.g.trans_a},
              {"trans_b", r.g.trans_b},
              {"c_dtype", r.g.f32_accumulate ? "f32" : dtype_name(act)},
              {"beta", r.g.f32_accumulate ? 1.0 : 0.0},
              {"flops", json_number(flops)},
              {"act_ms", json_number(r.act_ms)},
              {"act_tflops", json_number(tflops(flops, r.act_ms))}};
    j["fp8_ms"] = r.fp8 ? json_number(r.fp8_ms) : Json(nullptr);
    j["fp8_tflops"] = r.fp8 ? json_number(tflops(flops, r.fp8_ms)) : Json(nullptr);
    j["quant_ms"] = r.quant ? json_number(r.quant_ms) : Json(nullptr);
    j["fp8_matmul_tflops"] = r.quant ? json_number(tflops(flops, matmul_ms)) : Json(nullptr);
    row_json.push_back(j);
  }
  if (!o.bench.json.empty()) {
    const Json j = {{"scenario", "gemm"},
                    {"backend", be->name()},
                    {"act_dtype", dtype_name(act)},
                    {"fp8_recipe", recipe},
                    {"fp8_available", fp8_ok},
                    {"fp8_unavailable_reason", fp8_why},
                    {"dimension_divisor", div},
                    {"batch_tokens", o.data.batch_tokens},
                    {"n_experts", o.model.n_experts},
                    {"top_k", o.model.top_k},
                    {"steps", o.bench.steps},
                    {"warmup", o.bench.warmup},
                    {"rows", row_json}};
    write_json_file(o.bench.json, j, "bench_json");
  }
  return 0;
}

}  // namespace hp
