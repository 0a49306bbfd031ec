#include "launch/bench/bench_attention.h"

#include <cmath>
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

// Document lengths of realistic packing (64..4096 tokens), 16,384 in all.
const std::vector<int64_t> kDocs = {3100, 517, 2048, 4000, 1290, 3777, 1652};

struct Layout {
  std::string name;
  std::vector<int64_t> lengths;  // the sequences of the batch, packed in order
};

// kDocs scaled to `tokens` in all: each length in proportion, the last taking what is left.
std::vector<int64_t> scaled_docs(int64_t tokens) {
  int64_t total = 0;
  for (int64_t d : kDocs) total += d;
  std::vector<int64_t> out;
  int64_t used = 0;
  for (size_t i = 0; i + 1 < kDocs.size(); ++i) {
    const int64_t n = std::max<int64_t>(1, kDocs[i] * tokens / total);
    out.push_back(n);
    used += n;
  }
  out.push_back(tokens - used);
  return out;
}

std::vector<Layout> layouts(const TrainOptions& o) {
  const int64_t tokens = o.data.batch_tokens, seq = o.data.seq_len;
  std::vector<Layout> out;
  out.push_back({"rows", std::vector<int64_t>(static_cast<size_t>(tokens / seq), seq)});
  if (tokens != seq) out.push_back({"one", {tokens}});
  out.push_back({"docs", scaled_docs(tokens)});
  return out;
}

struct Path {
  std::string name;
  AttentionImpl attention;  // config key `attention`
  bool deterministic;
};

// The paths to time: the reference on the CPU; on CUDA every path, or the one --attention names.
std::vector<Path> paths(const TrainOptions& o, Device device) {
  using A = AttentionImpl;
  if (device == Device::kCPU) return {{"reference", o.cuda.attention, o.cuda.deterministic}};
  if (o.cuda.attention == A::kTiled) return {{"tiled", A::kTiled, true}};
  if (o.cuda.attention == A::kCudnn)
    return {{o.cuda.deterministic ? "cudnn" : "cudnn-fast", A::kCudnn, o.cuda.deterministic}};
  return {{"tiled", A::kTiled, true}, {"cudnn", A::kCudnn, true}, {"cudnn-fast", A::kCudnn, false}};
}

struct Row {
  std::string layout, path;
  int window = 0;
  int64_t tokens = 0, sequences = 0;
  std::vector<int64_t> lengths;
  double pairs = 0, fwd_ms = 0, bwd_ms = 0;
};

double tflops(double flops, double ms) { return ms > 0 ? flops / (ms * 1e9) : 0; }

// Times one layout and window on `be`.
Row time_layout(Backend& be, const TrainOptions& o, const Layout& l, int window) {
  const ModelConfig& m = o.model;
  std::vector<int32_t> pos;
  for (int64_t len : l.lengths)
    for (int64_t i = 0; i < len; ++i) pos.push_back(static_cast<int32_t>(i));
  std::vector<int32_t> ids(pos.size(), 0);
  const int64_t n = static_cast<int64_t>(pos.size());
  const PackedBatch batch = PackedBatch::from_tokens(ids, ids, pos, n);
  BatchMeta meta = be.upload_batch(batch);
  const int64_t h = m.n_heads + 2 * m.n_kv_heads;
  const AttentionShape shape{static_cast<int>(m.n_heads), static_cast<int>(m.n_kv_heads),
                             static_cast<int>(m.head_dim), window,
                             1.0 / std::sqrt(static_cast<double>(m.head_dim))};
  const DType act = be.act_dtype();
  // Normal draws in the master dtype (the backends draw there), converted to the activations'.
  const auto random = [&](Shape dims, uint64_t seed) {
    Tensor draws = be.empty(dims, be.master_dtype());
    be.fill_normal(draws, seed, 0, 1.0);
    if (act == be.master_dtype()) return draws;
    Tensor t = be.empty(dims, act);
    be.convert(draws, t);
    return t;
  };
  Tensor qkv = random({n, h, m.head_dim}, o.run.seed);
  Tensor dout = random({n, m.n_heads, m.head_dim}, o.run.seed + 1);
  Tensor sinks, dsinks;
  if (m.attn_sinks) {
    sinks = random({m.n_heads}, o.run.seed + 2);
    dsinks = be.zeros({m.n_heads}, be.master_dtype());
  }
  Tensor out = be.empty({n, m.n_heads, m.head_dim}, act);
  Tensor lse = be.empty({n, m.n_heads}, be.master_dtype());
  Tensor dqkv = be.empty({n, h, m.head_dim}, act);
  std::vector<double> f, b;
  for (int64_t it = 0; it < o.bench.warmup + o.bench.steps; ++it) {
    const double fm = time_ms(be, [&] { be.attention_fwd(qkv, sinks, meta, shape, out, lse); });
    const double bm = time_ms(be, [&] {
      be.attention_bwd(qkv, sinks, meta, shape, out, lse, dout, dqkv, dsinks);
    });
    if (it >= o.bench.warmup) {
      f.push_back(fm);
      b.push_back(bm);
    }
  }
  Row r;
  r.layout = l.name;
  r.window = window;
  r.tokens = n;
  r.sequences = static_cast<int64_t>(l.lengths.size());
  r.lengths = l.lengths;
  r.pairs = batch.attention_pairs(window);
  r.fwd_ms = median(f);
  r.bwd_ms = median(b);
  return r;
}

}  // namespace

int run_bench_attention(const TrainOptions& o, const RankContext& ctx) {
  const ModelConfig& m = o.model;
  if (o.data.batch_tokens < static_cast<int64_t>(kDocs.size()))
    HP_USER_ERROR(ErrorKind::kConfig, "hotpath bench attention: --batch_tokens must be at least ",
                  kDocs.size(), " (a token for each document of the docs layout), got ",
                  o.data.batch_tokens);
  std::vector<int> windows = {0};
  if (m.sliding_window > 0) windows.push_back(static_cast<int>(m.sliding_window));
  const std::vector<Layout> lays = layouts(o);

  std::unique_ptr<Backend> first = make_backend(o, ctx.launch.local_rank);
  const Device device = first->device();
  const std::string backend_name = first->name();
  first.reset();
  std::vector<Row> rows;
  Json path_json = Json::array();
  for (const Path& p : paths(o, device)) {
    TrainOptions po = o;
    po.cuda.attention = p.attention;
    po.cuda.deterministic = p.deterministic;
    std::string what;
    std::vector<Row> these;
    try {
      std::unique_ptr<Backend> be = make_backend(po, ctx.launch.local_rank);
#if HOTPATH_HAVE_CUDA
      if (be->device() == Device::kCUDA) what = cuda_attention_description(*be);
#endif
      if (what.empty()) what = be->name();
      for (const Layout& l : lays)
        for (int w : windows) {
          Row r = time_layout(*be, o, l, w);
          r.path = p.name;
          these.push_back(r);
        }
    } catch (const UserError& e) {
      // A path this device or build cannot run (e.g. no loadable cuDNN): listed, not timed.
      if (ctx.rank() == 0) std::printf("attention path %s unavailable: %s\n", p.name.c_str(), e.what());
      path_json.push_back({{"path", p.name}, {"available", false}, {"reason", e.what()}});
      continue;
    }
    path_json.push_back({{"path", p.name}, {"available", true}, {"attention", what}});
    rows.insert(rows.end(), these.begin(), these.end());
  }
  if (ctx.rank() != 0) return 0;
  std::printf(
      "bench attention: backend=%s heads=%lld kv_heads=%lld head_dim=%lld sinks=%s tokens=%lld "
      "steps=%lld warmup=%lld\n",
      backend_name.c_str(), static_cast<long long>(m.n_heads),
      static_cast<long long>(m.n_kv_heads), static_cast<long long>(m.head_dim),
      m.attn_sinks ? "yes" : "no", static_cast<long long>(o.data.batch_tokens),
      static_cast<long long>(o.bench.steps), static_cast<long long>(o.bench.warmup));
  std::printf("%-6s %7s %-11s %5s %10s %10s %12s %12s\n", "layout", "window", "path", "seqs",
              "fwd ms", "bwd ms", "fwd TFLOP/s", "bwd TFLOP/s");
  Json row_json = Json::array();
  for (const Row& r : rows) {
    const double fwd_flops = 4.0 * r.pairs * m.head_dim * m.n_heads;  // QK^T and PV
    const double bwd_flops = 2.5 * fwd_flops;                           // five such products
    std::printf("%-6s %7d %-11s %5lld %10.3f %10.3f %12.2f %12.2f\n", r.layout.c_str(), r.window,
                r.path.c_str(), static_cast<long long>(r.sequences), r.fwd_ms, r.bwd_ms,
                tflops(fwd_flops, r.fwd_ms), tflops(bwd_flops, r.bwd_ms));
    row_json.push_back({{"layout", r.layout},
                        {"window", r.window},
                        {"path", r.path},
                        {"tokens", r.tokens},
                        {"sequences", r.sequences},
                        {"lengths", r.lengths},
                        {"pairs", json_number(r.pairs)},
                        {"fwd_ms", json_number(r.fwd_ms)},
                        {"bwd_ms", json_number(r.bwd_ms)},
                        {"fwd_flops", json_number(fwd_flops)},
                        {"bwd_flops", json_number(bwd_flops)},
                        {"fwd_tflops", json_number(tflops(fwd_flops, r.fwd_ms))},
                        {"bwd_tflops", json_number(tflops(bwd_flops, r.bwd_ms))}});
  }
  if (!o.bench.json.empty()) {
    const Json j = {{"scenario", "attention"},
                    {"backend", backend_name},
                    {"n_heads", m.n_heads},
                    {"n_kv_heads", m.n_kv_heads},
                    {"head_dim", m.head_dim},
                    {"sinks", m.attn_sinks},
                    {"batch_tokens", o.data.batch_tokens},
                    {"seq_len", o.data.seq_len},
                    {"steps", o.bench.steps},
                    {"warmup", o.bench.warmup},
                    {"paths", path_json},
                    {"rows", row_json}};
    write_json_file(o.bench.json, j, "bench_json");
  }
  return 0;
}

}  // namespace hp
