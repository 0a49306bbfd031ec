// The memory plan: what one rank of a layout holds on its device, counted from the model's shape
// and the run's options before anything is allocated (`hotpath train --dry-run`, and the check
// every CUDA run makes before it builds the model).
//
// Parameters, gradients and optimizer state are counted exactly, tensor by tensor, as the
// backend allocates them. Activations are an estimate from the tensors one layer keeps between
// forward and backward, with every expert receiving its average share of the routed rows; the
// CUDA context, NCCL's own buffers and allocator rounding are covered by a fixed reserve.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "launch/json.h"
#include "launch/options.h"

namespace hp {

// A layout to plan: the world, its expert-parallel size and the options that move memory.
struct PlanLayout {
  int world = 1;
  int ep = 1;
  OptimizerSharding sharding = OptimizerSharding::kNone;
  bool checkpoint_activations = false;
  OffloadMode offload = OffloadMode::kNone;

  std::string describe() const;  // "world=8 (dp=2 x ep=4), optimizer_sharding=zero1, ..."
};

struct MemoryPlan {
  PlanLayout layout;
  bool cuda = true;  // bf16 working copies and activations (else the CPU's dtype)
  int64_t tokens_per_rank = 0;
  int64_t dense_numel = 0;         // replicated on every rank
  int64_t expert_numel_local = 0;  // this rank's experts
  int64_t shard_numel = 0;         // elements whose optimizer state this rank owns

  // Bytes on one rank's device.
  int64_t params = 0;     // working copies the model computes with (bf16 on CUDA; on the CPU the
                          // master is the working copy unless zero1 splits it)
  int64_t grads = 0;      // fp32 gradients of every local parameter
  int64_t optimizer = 0;  // fp32 masters and both AdamW moments of the elements this rank owns
  int64_t act_full = 0;   // every layer's activations kept for backward
  int64_t act_checkpointed = 0;  // block inputs kept, one layer recomputed at a time
  int64_t act_offloaded = 0;     // block inputs on the host, a ring of staging buffers here
  int64_t activations = 0;       // the one of the three the layout uses
  int64_t staging = 0;           // logits chunk, offload ring, bf16 gradient buckets
  int64_t rounding = 0;          // allocator blocks beyond the bytes asked for (CUDA)
  int64_t reserve = 0;           // CUDA context, library workspaces, NCCL
  int64_t host_pinned = 0;       // host memory for offloaded block inputs (not on the device)
  // precision=fp8 (docs/design.md, "The memory plan"): the CUDA FP8 path's scratch, the largest
  // FP8 product's two quantized operands (E4M3 codes and their scales) and its fp32 output, held
  // only during that product. The CPU backend emulates FP8 per product and holds none of it: a
  // CUDA plan counts it in its total, a CPU plan shows it only.
  int64_t fp8_scratch = 0;
  // precision=fp8 on CUDA: the FP8-class weights of every layer quantized in both forms a
  // product takes (X = W and X = W^T, codes and scales), held from the layer's forward to the
  // end of backward (Backend::hold_fp8_weights). Counted like fp8_scratch.
  int64_t fp8_weights = 0;
  // Host memory of a background checkpoint's snapshot (checkpoint_async with a checkpoint_dir):
  // at most the masters and moments this rank owns (under MPI it copies only the rows it writes).
  int64_t host_snapshot = 0;
  int64_t total = 0;             // device bytes: everything above but host_pinned
};

// The plan of `layout` for the model, batch and options of `o` on a CUDA device (cuda=true) or
// the CPU backend.
MemoryPlan plan_memory(const TrainOptions& o, const PlanLayout& layout, bool cuda);

// The layout `o` describes for `world` ranks.
PlanLayout layout_of(const TrainOptions& o, int world);

// Device memory to plan against, in bytes: device_memory_gib (parsed with the options), or (auto)
// `visible_bytes` (0 where no GPU is visible: no check). 0 means "do not check".
int64_t planned_device_bytes(const TrainOptions& o, int64_t visible_bytes);

// The smallest layout (fewest ranks, then fewest changes to `from`) whose plan fits in
// `device_bytes`; world = 0 when none up to 4096 ranks does.
PlanLayout smallest_fitting_layout(const TrainOptions& o, const PlanLayout& from,
                                   int64_t device_bytes, bool cuda);

// The plan's numbers (bytes) as --plan_json writes them.
nlohmann::ordered_json plan_json(const MemoryPlan& p, int64_t device_bytes);

// The plan as the lines --dry-run prints.
std::string format_plan(const MemoryPlan& p, int64_t device_bytes);

// Refuses (UserError naming the numbers and the smallest layout that fits) a layout whose plan
// does not fit in `device_bytes`; no-op when device_bytes is 0.
void require_plan_fits(const TrainOptions& o, const MemoryPlan& p, int64_t device_bytes,
                       bool with_plan = true);

}  // namespace hp
