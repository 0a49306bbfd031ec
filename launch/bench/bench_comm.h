// `hotpath bench routing` and `hotpath bench alltoall` (docs/architecture.md, "Rule 3: one
// routing sync per MoE layer" and "Measuring").
//
// routing: on rank 0 alone, one MoE layer's routing for 16,384 tokens x top-4 (d_model 2880,
// E = 32 and 128): router GEMM + top-k, histogram, exclusive scan, stable sort by expert, the
// count read, permute. Variants bincount (one blocking read) and per-expert (one per expert);
// prints ms (median of >= 20 after warm-up; CUDA events on the GPU, wall clock on the CPU), the
// ratio to bincount and the host syncs per layer.
// alltoall: on every rank, over NCCL groups mirroring the host groups, the MoE token exchange
// (CommExpertExchange dispatch + combine, 16,384 tokens x top-4 x d 2880 bf16, E = 32, uniform
// random routing, also at 1K, 4K, 8K and 32K tokens per rank) against the communicator's
// plain all_to_all_v of the same rows, and plain even all_to_all_v from 1 to 512 MiB per rank.
// Prints time, algorithm and bus bandwidth (nccl-tests convention: busbw = bytes/time x (n-1)/n)
// and the exchange/plain ratio. Needs the CUDA backend.
// Both write JSON to options.bench_json when set; only rank 0 prints.
#pragma once

#include "launch/options.h"
#include "launch/train/trainer.h"

namespace hp {

int run_bench_routing(const TrainOptions& o, const RankContext& ctx);
int run_bench_alltoall(const TrainOptions& o, const RankContext& ctx);

}  // namespace hp
