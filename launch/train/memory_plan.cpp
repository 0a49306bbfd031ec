#include "launch/train/memory_plan.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>

#include "framework/core/error.h"
#include "launch/train/metrics.h"

namespace hp {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// What the CUDA caching allocator hands out for a request (framework/backend/cuda/
// cuda_allocator.cpp): 512-byte steps up to 1 MiB, then quarters of the power of two below.
int64_t cuda_bucket(int64_t bytes) {
  if (bytes <= 0) bytes = 1;
  constexpr int64_t kSmall = 1 << 20;
  if (bytes <= kSmall) return (bytes + 511) / 512 * 512;
  int64_t p = 1;
  while (p * 2 <= bytes) p *= 2;
  const int64_t step = p / 4;
  return (bytes + step - 1) / step * step;
}

// Bytes one layer keeps from forward for backward with `n` tokens on the rank (framework/model/
// model.cpp, LayerActs): a = activation bytes, m = master bytes (norm statistics, LSE).
int64_t layer_act_bytes(const ModelConfig& c, int64_t n, int ep, int64_t a, int64_t m) {
  const int64_t d = c.d_model, hq = c.n_heads, hkv = c.n_kv_heads, hd = c.head_dim;
  const int64_t qkv = n * (hq + 2 * hkv) * hd;
  int64_t b = n * d * a;                   // x, the block input
  b += n * d * a + n * m;                  // xn, rstd1
  b += qkv * a * (c.qk_norm ? 2 : 1);      // qkv (and qkv before the q/k norm)
  if (c.qk_norm) b += n * (hq + hkv) * m;  // q/k 1/rms
  b += n * hq * hd * a + n * hq * m;       // attention output, LSE
  b += 2 * n * d * a + n * m;              // h, hn, rstd2
  if (c.is_moe()) {
    const int64_t e = c.n_experts, k = c.top_k, f = c.expert_ffn_dim;
    const int64_t rows = n * k;  // routed rows; balanced routing gives each rank as many back
    b += n * e * a + n * k * (4 + a) + 2 * rows * 4 + 2 * (e + 1) * 4;  // logits, top-k, perms
    b += rows * d * a;                                                  // sorted rows
    if (ep > 1) b += 2 * rows * d * a;  // rows received for this rank's experts, and sent back
    b += rows * 2 * f * a + rows * f * a + rows * d * a;  // expert FFN in, activation, out
  } else {
    b += n * 2 * c.ffn_dim * a + n * c.ffn_dim * a;
  }
  return b;
}

// One operand of a CUDA FP8 product, quantized into scratch (framework/backend/cuda/
// fp8_layout.h): X [rows, k] K-contiguous, E4M3 codes with rows padded to 8 and K to 16, and its
// scales, the larger of the two recipes' (block128: fp32 per 1x128 block along K of each row for
// a data operand, per 128x128 tile with the tile columns padded to 4 for a weight; mxfp8: one
// E8M0 byte per 1x32 block in 128x4 tiles).
struct Fp8Operand {
  int64_t codes = 0, scales = 0;
};
Fp8Operand fp8_operand(int64_t rows, int64_t k, bool weight) {
  const int64_t rows_pad = (rows + 7) / 8 * 8, row_tiles = (rows_pad + 127) / 128;
  const int64_t blocks128 = (k + 127) / 128, blocks32 = (k + 31) / 32;
  const int64_t block128 =
      weight ? row_tiles * ((blocks128 + 3) / 4 * 4) * 4 : blocks128 * rows_pad * 4;
  const int64_t mx = row_tiles * ((blocks32 + 3) / 4 * 4) * 128;
  return {rows_pad * ((k + 15) / 16 * 16), std::max(block128, mx)};
}

}  // namespace

std::string PlanLayout::describe() const {
  std::string s = str_cat("world=", world, " (dp=", world / std::max(ep, 1), " x ep=", ep, ")");
  s += str_cat(", optimizer_sharding=", sharding == OptimizerSharding::kZero1 ? "zero1" : "none");
  if (offload != OffloadMode::kNone)
    s += str_cat(", offload=", offload == OffloadMode::kDouble ? "double" : "single");
  else if (checkpoint_activations)
    s += ", checkpoint_activations=true";
  return s;
}

PlanLayout layout_of(const TrainOptions& o, int world) {
  PlanLayout l;
  l.world = world;
  l.ep = o.parallel.ep_size;
  l.sharding = o.optimizer.sharding;
  l.offload = o.compute.offload.mode;
  l.checkpoint_activations = o.compute.checkpoint_activations || l.offload != OffloadMode::kNone;
  return l;
}

MemoryPlan plan_memory(const TrainOptions& o, const PlanLayout& layout, bool cuda) {
  const ModelConfig& c = o.model;
  MemoryPlan p;
  p.layout = layout;
  p.cuda = cuda;
  const int world = std::max(layout.world, 1), ep = std::max(layout.ep, 1);
  const int dp = world / ep;
  const int64_t a = cuda ? 2 : dtype_size(o.device.cpu_dtype);  // activations, working copies
  const int64_t m = cuda ? 4 : dtype_size(o.device.cpu_dtype);  // master, grads, moments
  // Allocator blocks beyond the bytes asked for (CUDA's caching allocator rounds every tensor).
  int64_t rounding = 0;
  auto count = [&](int64_t bytes) {
    if (cuda) rounding += cuda_bucket(bytes) - bytes;
    return bytes;
  };
  const bool zero1 = layout.sharding == OptimizerSharding::kZero1;

  // Parameters, gradients and optimizer state, tensor by tensor as the model allocates them.
  // Dense tensors' optimizer state is split over the world, experts' over their dp replicas.
  int64_t params = 0, grads = 0, optimizer = 0;
  for (const ParamTensor& t : param_tensors(c)) {
    const int64_t local = t.experts > 0 ? t.numel / ep : t.numel;
    const int64_t local_rows = t.experts > 0 ? t.rows / ep : t.rows;
    const int64_t owners = t.experts > 0 ? dp : world;
    // zero1 splits a tensor's leading-axis rows evenly over its owners (parallel/zero1.h); one
    // whose rows do not divide stays whole on every owner.
    const bool split = zero1 && owners > 1 && local_rows % owners == 0;
    const int64_t shard = split ? local / owners : local;
    if (t.experts > 0)
      p.expert_numel_local += local;
    else
      p.dense_numel += local;
    p.shard_numel += shard;
    // The working copy: bf16 on CUDA; on the CPU the master itself unless zero1 split it.
    if (cuda || split) params += count(local * a);
    grads += count(local * m);
    optimizer += 3 * count(shard * m);  // fp32 master and both AdamW moments
  }
  p.params = params;
  p.grads = grads;
  p.optimizer = optimizer;

  // Activations: tokens per rank = the global batch over the world.
  const int64_t n = o.data.batch_tokens / world;
  p.tokens_per_rank = n;
  const int64_t layer = layer_act_bytes(c, n, ep, a, m);
  const int64_t block_in = n * c.d_model * a;
  const int64_t head = 3 * n * c.d_model * a + n * m;  // final norm in/out, d(hidden)
  // Backward of one layer holds its gradients of activations and the transients of the GEMMs
  // that make them next to what it reads: about two more layers' worth (on one H200, GPT-OSS-20b
  // with 4 layers and 16K tokens, the allocator's peak came within 2% below the plan).
  p.act_full = c.n_layers * layer + 2 * layer + head;
  p.act_checkpointed = c.n_layers * block_in + 3 * layer + head;
  p.act_offloaded = std::min<int64_t>(o.compute.offload.buffers, c.n_layers) * block_in + 3 * layer + head;
  p.activations = layout.offload != OffloadMode::kNone ? p.act_offloaded
                  : layout.checkpoint_activations      ? p.act_checkpointed
                                                       : p.act_full;
  if (layout.offload != OffloadMode::kNone) p.host_pinned = (c.n_layers - 1) * block_in;
  if (!o.checkpoint.dir.empty() && o.checkpoint.async) p.host_snapshot = optimizer;

  // Logits of one cross-entropy chunk (activation dtype, their gradient written in place) and
  // bf16 copies of gradient buckets on the wire.
  const int64_t chunk = std::min<int64_t>(o.compute.ce_chunk_tokens, n);
  p.staging = count(chunk * c.vocab_size * a);
  if (o.optimizer.grad_reduce_dtype == DType::kBF16 && world > 1)
    p.staging += count(std::max<int64_t>(p.dense_numel, p.expert_numel_local) * 2);
  if (cuda) {
    // Activation tensors are many and short-lived: an eighth for their rounding. The CUDA
    // context and libraries, cuBLASLt / cuDNN workspaces and NCCL's buffers take the rest.
    p.reserve = static_cast<int64_t>(1.5 * kGiB) + (world > 1 ? (int64_t{1} << 29) : 0);
  }
  if (o.compute.precision == GemmPrecision::kFP8) {
    // The CUDA FP8 path keeps no FP8 copies between products: each forward and input-gradient
    // product of an FP8 class quantizes both operands into scratch (the data operand, the
    // weight) and may write its product to an fp32 [m, n] scratch first; all of it is freed after
    // the product, so the peak is the largest product's. Weight gradients run in bf16 and take
    // none, but the unembedding's under unembedding_wgrad. The experts' group quantizes the data
    // operands of all its products first, so they live through the group: counted as one operand of
    // the rank's routed rows (tokens x top_k, each expert's rows padded to 4), with one expert's
    // weight and an fp32 scratch as large as all the rows' products, an upper bound however the
    // group's products are run.
    const int64_t d = c.d_model, hd = c.head_dim, qkv = (c.n_heads + 2 * c.n_kv_heads) * hd;
    const int64_t attn = c.n_heads * hd;
    int64_t best = 0;
    std::vector<int64_t> best_parts;
    // The product [m, k] x [k, cols] with a data operand of m rows and a weight of cols rows;
    // `scratch`: whether its fp32 [m, cols] scratch is counted.
    // `staged`: whether the data operand's scales are staged in a second buffer of their size
    // first (the cross-entropy's, "FP8 on the GPU").
    // `b_data`: the second operand is a data operand too (a weight gradient's, blocked along the
    // tokens).
    auto product = [&](int64_t m_rows, int64_t k, int64_t cols, bool scratch = true,
                       bool staged = false, bool b_data = false) {
      const Fp8Operand x = fp8_operand(m_rows, k, false), w = fp8_operand(cols, k, !b_data);
      std::vector<int64_t> parts = {x.codes, x.scales, w.codes, w.scales};
      if (staged) parts.push_back(x.scales);
      if (scratch) parts.push_back(m_rows * cols * 4);
      int64_t sum = 0;
      for (int64_t b : parts) sum += b;
      if (sum > best) {
        best = sum;
        best_parts = parts;
      }
    };
    // Forward y = x W ([rows, in] x [in, out]) and input gradient dX = dY W^T.
    auto layer_matrix = [&](int64_t rows, int64_t in, int64_t out) {
      product(rows, in, out);
      product(rows, out, in);
    };
    if (o.compute.fp8_gemms.dense) {
      layer_matrix(n, d, qkv);
      layer_matrix(n, attn, d);
      if (!c.is_moe()) {
        layer_matrix(n, d, 2 * c.ffn_dim);
        layer_matrix(n, c.ffn_dim, d);
      }
    }
    if (o.compute.fp8_gemms.experts && c.is_moe()) {
      const int64_t rows = n * c.top_k + 3 * c.n_experts, f = c.expert_ffn_dim;
      layer_matrix(rows, d, 2 * f);
      layer_matrix(rows, f, d);
    }
    if (o.compute.fp8_gemms.unembedding) {
      // A chunk's logits [rows, vocab] and the input gradient [rows, d] from its dlogits. The
      // product goes straight into its output when the rows are whole multiples of 4 and the
      // output's columns of 8 (the narrow form's padding, "FP8 on the GPU"); only otherwise
      // through the fp32 scratch, which for the logits is as large as 4 bytes a logit.
      const int64_t last = n - (n - 1) / chunk * chunk;
      const bool rows_whole = chunk % 4 == 0 && last % 4 == 0;
      product(chunk, d, c.vocab_size, !(rows_whole && c.vocab_size % 8 == 0));
      product(chunk, c.vocab_size, d, !(rows_whole && d % 8 == 0), true);
    }
    if (o.compute.fp8_gemms.unembedding_wgrad) {
      // A chunk's share of the unembedding's weight gradient, hᵀ dlogits into lm_head's [d, vocab]
      // (dlogitsᵀ h into a tied embedding's [vocab, d]), fp32: both operands blocked along the
      // chunk's tokens, straight into the gradient where its rows are a multiple of 4 and its
      // columns of 8, else through an fp32 scratch of its size.
      const int64_t rows = c.tie_embeddings ? c.vocab_size : d;
      const int64_t cols = c.tie_embeddings ? d : c.vocab_size;
      product(rows, chunk, cols, !(rows % 4 == 0 && cols % 8 == 0), false, true);
    }
    for (int64_t b : best_parts) p.fp8_scratch += count(b);
    // Held weights: a weight W [in, out] as X = W (in rows of K = out) and X = W^T.
    int64_t held = 0;
    auto hold = [&](int64_t in, int64_t out, int64_t copies) {
      for (const Fp8Operand& f : {fp8_operand(in, out, true), fp8_operand(out, in, true)})
        for (const int64_t bytes : {f.codes, f.scales}) {
          held += copies * count(bytes);
          if (cuda) rounding += (copies - 1) * (cuda_bucket(bytes) - bytes);
        }
    };
    if (o.compute.fp8_gemms.dense) {
      hold(d, qkv, c.n_layers);
      hold(attn, d, c.n_layers);
      if (!c.is_moe()) {
        hold(d, 2 * c.ffn_dim, c.n_layers);
        hold(c.ffn_dim, d, c.n_layers);
      }
    }
    if (o.compute.fp8_gemms.experts && c.is_moe()) {
      const int64_t local = c.n_experts / ep * c.n_layers;
      hold(d, 2 * c.expert_ffn_dim, local);
      hold(c.expert_ffn_dim, d, local);
    }
    if (o.compute.fp8_gemms.unembedding) hold(c.d_model, c.vocab_size, 1);
    p.fp8_weights = held;
  }
  p.total = p.params + p.grads + p.optimizer + p.activations + p.staging + p.reserve;
  if (cuda) p.total += p.fp8_scratch + p.fp8_weights;
  p.rounding = cuda ? rounding + p.activations / 8 : 0;
  p.total += p.rounding;
  return p;
}

int64_t planned_device_bytes(const TrainOptions& o, int64_t visible_bytes) {
  switch (o.device.memory.kind) {
    case DeviceMemory::Kind::kAuto:
      return visible_bytes;
    case DeviceMemory::Kind::kOff:
      return 0;
    case DeviceMemory::Kind::kBytes:
      break;
  }
  return o.device.memory.bytes;
}

PlanLayout smallest_fitting_layout(const TrainOptions& o, const PlanLayout& from,
                                   int64_t device_bytes, bool cuda) {
  const int64_t rows = o.data.batch_tokens / o.data.seq_len;
  const int experts = o.model.is_moe() ? o.model.n_experts : 1;
  for (int world = 1; world <= 4096; world *= 2) {
    if (world < from.world) continue;  // fewer ranks only hold more each
    if (rows % world != 0) continue;   // the batch must split over the ranks
    PlanLayout best;
    int best_changes = 1 << 30;
    // Largest ep first: more ranks to hold the experts is what shrinks an MoE rank most.
    for (int ep = std::min(world, experts); ep >= 1; --ep) {
      if (world % ep != 0 || experts % ep != 0) continue;
      // zero1 needs each rank's experts to split over their dp replicas (validate_train_options).
      const bool zero1_ok = !o.model.is_moe() || (experts / ep) % (world / ep) == 0;
      for (const OptimizerSharding sh : {from.sharding, OptimizerSharding::kZero1}) {
        if (sh == OptimizerSharding::kZero1 && !zero1_ok) continue;
        for (const int mode : {0, 1, 2}) {  // as configured, checkpointing, double offload
          PlanLayout l = from;
          l.world = world;
          l.ep = ep;
          l.sharding = sh;
          if (mode == 1) l.checkpoint_activations = true;
          if (mode == 2) {
            l.checkpoint_activations = true;
            l.offload = OffloadMode::kDouble;
          }
          if (plan_memory(o, l, cuda).total > device_bytes) continue;
          const int changes = (ep != from.ep) + (sh != from.sharding) +
                              (l.checkpoint_activations != from.checkpoint_activations) +
                              (l.offload != from.offload);
          if (changes < best_changes) {
            best = l;
            best_changes = changes;
          }
        }
      }
    }
    if (best_changes < (1 << 30)) return best;
  }
  PlanLayout none;
  none.world = 0;
  return none;
}

Json plan_json(const MemoryPlan& p, int64_t device_bytes) {
  Json j;
  j["layout"] = p.layout.describe();
  j["world"] = p.layout.world;
  j["ep"] = p.layout.ep;
  j["cuda"] = p.cuda;
  j["tokens_per_rank"] = p.tokens_per_rank;
  j["parameter_bytes"] = p.params;
  j["gradient_bytes"] = p.grads;
  j["optimizer_bytes"] = p.optimizer;
  j["activation_bytes"] = p.activations;
  j["activation_bytes_all_kept"] = p.act_full;
  j["activation_bytes_recompute"] = p.act_checkpointed;
  j["activation_bytes_offload"] = p.act_offloaded;
  j["staging_bytes"] = p.staging;
  j["rounding_bytes"] = p.rounding;
  j["reserve_bytes"] = p.reserve;
  j["host_pinned_bytes"] = p.host_pinned;
  j["fp8_scratch_bytes"] = p.fp8_scratch;
  j["fp8_weights_bytes"] = p.fp8_weights;
  j["host_snapshot_bytes"] = p.host_snapshot;
  j["total_bytes"] = p.total;
  j["device_bytes"] = device_bytes;
  j["fits"] = device_bytes <= 0 || p.total <= device_bytes;
  return j;
}

std::string format_plan(const MemoryPlan& p, int64_t device_bytes) {
  auto gib = [](int64_t b) {
    char buf[32];
    if (b >= kGiB / 4)
      std::snprintf(buf, sizeof buf, "%9.2f GiB", b / kGiB);
    else
      std::snprintf(buf, sizeof buf, "%9.2f MiB", b / (1024.0 * 1024.0));
    return std::string(buf);
  };
  std::string s = str_cat("memory plan per rank: ", p.layout.describe(), ", ", p.tokens_per_rank,
                          " tokens per rank", p.cuda ? ", CUDA (bf16)" : ", CPU", "\n");
  s += str_cat("  parameters       ", gib(p.params), "  (", p.dense_numel, " dense + ",
               p.expert_numel_local, " expert elements)\n");
  s += str_cat("  gradients        ", gib(p.grads), "\n");
  s += str_cat("  optimizer state  ", gib(p.optimizer), "  (", p.shard_numel,
               " elements owned by this rank)\n");
  s += str_cat("  activations      ", gib(p.activations), "  (all kept ", gib(p.act_full),
               "; recompute ", gib(p.act_checkpointed), "; offload ", gib(p.act_offloaded), ")\n");
  s += str_cat("  staging buffers  ", gib(p.staging), "\n");
  if (p.fp8_scratch)
    s += str_cat("  fp8 scratch      ", gib(p.fp8_scratch),
                 p.cuda ? "  (the largest FP8 product's quantized operands and fp32 output)"
                        : "  (the CUDA FP8 path's; not held here, not in the total)",
                 "\n");
  if (p.fp8_weights)
    s += str_cat("  fp8 weights      ", gib(p.fp8_weights),
                 p.cuda ? "  (every layer's FP8-class weights quantized, both forms)"
                        : "  (the CUDA FP8 path's; not held here, not in the total)",
                 "\n");
  if (p.rounding) s += str_cat("  block rounding   ", gib(p.rounding), "\n");
  if (p.reserve)
    s += str_cat("  reserve          ", gib(p.reserve), "  (CUDA context, workspaces, NCCL)\n");
  s += str_cat("  total            ", gib(p.total), "\n");
  if (p.host_pinned) s += str_cat("  host (pinned)    ", gib(p.host_pinned), "\n");
  if (p.host_snapshot)
    s += str_cat("  host (snapshot)  ", gib(p.host_snapshot),
                 "  (at most: background checkpoint saves, checkpoint_async)\n");
  if (device_bytes > 0)
    s += str_cat("  device           ", gib(device_bytes),
                 p.total <= device_bytes ? "  fits" : "  DOES NOT FIT", "\n");
  else
    s += "  device           not checked (no GPU visible; set device_memory_gib)\n";
  return s;
}

void require_plan_fits(const TrainOptions& o, const MemoryPlan& p, int64_t device_bytes,
                       bool with_plan) {
  if (device_bytes <= 0 || p.total <= device_bytes) return;
  const PlanLayout fit = smallest_fitting_layout(o, p.layout, device_bytes, p.cuda);
  const std::string advice =
      fit.world > 0
          ? str_cat("the smallest layout that fits: ", fit.describe(), " (",
                    fmt_sig(plan_memory(o, fit, p.cuda).total / kGiB, 4), " GiB per rank)")
          : std::string("no layout up to 4096 ranks fits; lower batch_tokens");
  HP_USER_ERROR(ErrorKind::kConfig, "this layout needs ", fmt_sig(p.total / kGiB, 4),
                " GiB per rank, the device has ", fmt_sig(device_bytes / kGiB, 4),
                " GiB (device_memory_gib=", o.device.memory.text, "); ", advice, ".",
                with_plan ? "\n" + format_plan(p, device_bytes) : std::string());
}

}  // namespace hp
