// What a run needs, checked before it starts: where it writes (a run that cannot save its
// checkpoints or its metrics must not train for hours first) and the host memory of the CPU
// backend (a batch too large must be refused naming the key, not die in std::bad_alloc).
//
// Outputs: checked Called before the job's ranks meet (no collective):
// every rank checks checkpoint_dir (all of them write checkpoint files under MPI), rank 0 also
// metrics_path, bench_json and eval_json. Missing directories are created; nothing else is
// left behind.
#pragma once

#include "launch/options.h"

namespace hp {

// Throws UserError(kConfig) naming the key, the path and the reason (read-only file system,
// permission denied, not a directory, ...) when an output of `command` ("train", "bench", ...)
// cannot be written.
void check_outputs_writable(const TrainOptions& o, const std::string& command, int rank);

// A lower bound on the host memory one rank of the CPU backend needs: parameters with their
// gradients and AdamW moments (experts split over ep_size), the activations backward keeps for
// `batch_tokens / world` tokens, and one chunk of logits.
int64_t cpu_rank_memory_lower_bound(const TrainOptions& o, int world);

// Throws UserError(kConfig) naming batch_tokens (or the model keys) when `ranks_here` ranks of
// the CPU backend need more than `available` bytes; `available` < 0: this machine's physical
// memory or its cgroup limit, whichever is lower.
void check_cpu_memory(const TrainOptions& o, int world, int ranks_here, int64_t available = -1);

}  // namespace hp
