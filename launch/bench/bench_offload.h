// Activation-offload benchmark (`hotpath bench offload`, docs/architecture.md, "Rule 2: the host
// link is shared fairly").
#pragma once

#include "launch/options.h"
#include "launch/train/trainer.h"

namespace hp {

// Step time (forward + backward with checkpointing) of one batch for offload none / single /
// double with lookahead 1 and 2; the achieved D2H and H2D bandwidth of the block inputs' copies
// alone; overlap efficiency = hidden copy time / min(T_copy, T_compute), where hidden = T_copy -
// (T_variant - T_none); offload syncs per step; device memory held for block inputs against none.
// On 2 or more ranks, all offloading at once (double, lookahead 1): the link arbiter off vs on
// (link_chunk_mib, link_inflight, pcie_groups): per-rank step time, achieved copy GB/s and grant
// wait, the max/min ratios of copy rate and step time across ranks, Jain's index of the rates.
int run_bench_offload(const TrainOptions& o, const RankContext& ctx);

}  // namespace hp
