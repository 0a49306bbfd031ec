// `hotpath bench <scenario>`: the dispatcher, and the whole-step benchmark (`bench step`).
#pragma once

#include <string>
#include <vector>

#include "framework/backend/profile.h"
#include "launch/options.h"
#include "launch/train/rank_context.h"

namespace hp {

// Runs one benchmark scenario (step, metadata, routing, alltoall, offload, attention, gemm) and
// prints its table.
int run_bench(const std::string& scenario, const TrainOptions& o, const RankContext& ctx);

// What `bench step` measures on rank 0. Timed steps run unprofiled; the breakdown comes from as
// many steps right after them, profiled back to back in one window (the profile's own cost stays
// out of the timings).
struct BenchStepResult {
  std::string backend, attention, data;
  int world = 1;
  // Document tokens (padding left out; StepStats) and input positions per step: medians of the
  // timed steps; padding: the padded fraction of the timed steps' positions.
  int64_t tokens_per_step = 0, positions_per_step = 0, steps = 0, warmup = 0;
  double padding = 0;
  // Medians of the timed steps; tokens_per_s and mfu count document tokens and their FLOPs.
  double ms = 0, tokens_per_s = 0, positions_per_s = 0, syncs = 0, mfu = 0;
  StepProfile profile;                                  // mean over the profiled steps
  int64_t profiled_steps = 0;
  // The profiled steps' device time with work running over their wall time (profile.busy_ms /
  // profile.wall_ms; both from the same steps, whose batches differ from the timed steps'); 1 on
  // the host backend.
  double busy_fraction = 0;
  double idle_ms = 0;             // profile.idle_ms: device idle a profiled step
  double startup_s = 0;           // process start to the first step
  int64_t memory_plan_bytes = 0;  // what the memory plan expected per rank (CUDA)
  // GEMM buckets whose candidate algorithms were timed by the end of the timed steps (CUDA,
  // gemm_autotune; 0 elsewhere).
  int64_t gemm_tuned_buckets = 0;
  // cuBLASLt algorithms of the expert products' shapes launched early so that their kernels
  // load before they are needed (CUDA; 0 elsewhere).
  int64_t gemm_warmed_algos = 0;
  // cuDNN attention forward graphs whose plans were timed (CUDA, attention_autotune; 0 elsewhere).
  int64_t attention_tuned_graphs = 0;
  std::string reduction_stream;  // Trainer::reduction_stream(): comm | compute | none
  // Memory of every rank after the profiled steps, gathered to each rank (index = world rank).
  // On a device backend: the peak of device bytes the caching allocator has handed out to
  // tensors since the process started ("device_peak_allocated"; the allocator's cached free
  // blocks and the libraries' own workspaces are not in it). On the host backend, whose device
  // memory is host memory: the process's peak resident set ("host_peak_rss").
  std::string memory_kind;
  std::vector<int64_t> memory_bytes;
};

BenchStepResult measure_bench_step(const TrainOptions& o, const RankContext& ctx);
// The table `bench step` prints, and its --bench_json object.
std::string bench_step_table(const BenchStepResult& r);
std::string bench_step_json(const BenchStepResult& r);

int run_bench_step(const TrainOptions& o, const RankContext& ctx);

}  // namespace hp
