// The CheckpointGroup (framework/checkpoint/checkpoint_group.h) of an MPI communicator: the one
// place that hands an MPI communicator to HDF5 (its MPI-IO file driver) and reduces the writers'
// chunk checksums (MPI_Allreduce with MPI_BOR: a bitwise OR is exact in any order, so MPI may
// choose the algorithm).
#pragma once

#include <memory>

#include "framework/checkpoint/checkpoint_group.h"
#include "parallel/communicator.h"

namespace hp {

// The group of `comm`'s processes when `comm` is an MPI communicator, else null: parallel HDF5
// runs over MPI only, so the caller writes serially (rank 0 alone, after gathering the shards).
// The group borrows the communicator's MPI handle: `comm` must outlive it.
std::unique_ptr<CheckpointGroup> make_checkpoint_group(const Communicator& comm);

}  // namespace hp
