// Where a run writes, checked before it starts: a run that cannot save its checkpoints or its
// metrics must not train for hours first. Called before the job's ranks meet (no collective):
// every rank checks checkpoint_dir (all of them write checkpoint files under MPI), rank 0 also
// metrics_path and bench_json. Missing directories are created; nothing else is left behind.
#pragma once

#include "launch/options.h"

namespace hp {

// Throws UserError(kConfig) naming the key, the path and the reason (read-only file system,
// permission denied, not a directory, ...) when an output of `command` ("train", "bench", ...)
// cannot be written.
void check_outputs_writable(const TrainOptions& o, const std::string& command, int rank);

}  // namespace hp
