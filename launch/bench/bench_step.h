// `hotpath bench <scenario>`: the dispatcher, and the whole-step benchmark (`bench step`).
#pragma once

#include <string>

#include "launch/options.h"
#include "launch/trainer.h"

namespace hp {

// Runs one benchmark scenario (step, metadata, routing, alltoall, offload) and prints its table.
int run_bench(const std::string& scenario, const TrainOptions& o, const RankContext& ctx);

// Whole training steps: ms, tokens/s, syncs, MFU, GPU busy fraction and the time by phase and
// by op family.
int run_bench_step(const TrainOptions& o, const RankContext& ctx);

}  // namespace hp
