// Attention benchmark (`hotpath bench attention`): the attention forward and backward alone, per
// attention path, on packed batches of several layouts (docs/benchmarks.md, "Attention").
#pragma once

#include "launch/options.h"
#include "launch/train/rank_context.h"

namespace hp {

// The model's attention shape (n_heads, n_kv_heads, head_dim, sinks when attn_sinks; full causal
// and, when sliding_window > 0, that window) over three layouts of --batch_tokens tokens: rows of
// --seq_len, one sequence, and documents of realistic lengths (kept in the proportions 3100, 517,
// 2048, 4000, 1290, 3777, 1652 of 16,384). Each path the device has: on CUDA tiled, cudnn
// (deterministic backward) and cudnn-fast, or only the one --attention names; on the CPU the
// reference. Per row the median forward and backward ms of --bench_steps timed calls after
// --bench_warmup, and TFLOP/s counted as 4 * causal pairs * head_dim * n_heads forward, 2.5x that
// backward. Rank 0 prints the table and writes --bench_json.
int run_bench_attention(const TrainOptions& o, const RankContext& ctx);

}  // namespace hp
