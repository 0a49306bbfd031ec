// GEMM benchmark (`hotpath bench gemm`): the backend's GEMMs in the activation dtype (bf16 on CUDA)
// against its FP8 GEMMs (Backend::gemm_fp8; docs/design.md, "FP8 on the GPU") at 8192^3 and at the
// model's shapes (docs/benchmarks.md, "GEMMs, bf16 against FP8").
#pragma once

#include "launch/options.h"
#include "launch/train/rank_context.h"

namespace hp {

// Products timed: the 8192^3 cube, then per weight of the model's layer its forward y = x W
// (rows x in x out), input gradient dX = dY W^T and weight gradient dW += X^T dY (f32, beta 1),
// with rows = --batch_tokens for the attention projections and the dense FFN, and
// batch_tokens * top_k / n_experts (the mean expert's rows) for the experts' products. On the
// CPU backend every dimension is divided by 32 (its emulated FP8 product is a reference, not a
// kernel). Per row the median ms of --bench_steps timed samples after --bench_warmup, each
// sample several calls, for the activation dtype (gemm: bf16 on CUDA, the CPU's dtype there), FP8
// (gemm_fp8: quantization and matmul) and, on CUDA, the two operands' quantization alone;
// TFLOP/s counted as 2 m n k for each (the FP8 matmul's: over FP8 ms less quantization ms).
// The FP8 rows use the device's recipe (block128 on compute capability 9.x, mxfp8 on 10.x) and
// are listed as unavailable on other devices. Rank 0 prints the table and writes --bench_json.
int run_bench_gemm(const TrainOptions& o, const RankContext& ctx);

}  // namespace hp
