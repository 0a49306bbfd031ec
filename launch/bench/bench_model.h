// Model-level benchmarks of the hot-path rules (`hotpath bench metadata`).
#pragma once

#include "launch/options.h"
#include "launch/train/trainer.h"

namespace hp {

// Forward, backward and forward+backward time with cached packed metadata against the
// per-layer rebuild baseline on one batch, the syncs of each, the cost m of one rebuild, and the
// measured saving against the model L*m (and the seed's (L-1)*m).
int run_bench_metadata(const TrainOptions& o, const RankContext& ctx);

}  // namespace hp
