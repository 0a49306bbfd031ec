// The CheckpointGroup (framework/checkpoint/checkpoint_group.h) of an MPI communicator: the one
// place that hands an MPI communicator to HDF5 (its MPI-IO file driver) and reduces the writers'
// chunk checksums (MPI_Allreduce with MPI_BOR: a bitwise OR is exact in any order, so MPI may
// choose the algorithm).
#pragma once

#include <memory>
#include <string>

#include "framework/checkpoint/checkpoint_group.h"
#include "parallel/communicator.h"

namespace hp {

// The group of `comm`'s processes when `comm` is an MPI communicator, else null: parallel HDF5
// runs over MPI only, so the caller writes serially (rank 0 alone, after gathering the shards).
// The group borrows the communicator's MPI handle: `comm` must outlive it.
std::unique_ptr<CheckpointGroup> make_checkpoint_group(const Communicator& comm);

// A background checkpoint writer's own communicator: a duplicate of `world` (MPI_Comm_dup,
// collective over it: call it on the thread that drives `world`, at the same point on every
// rank), with world's options. Null, with the reason in *why_not, when `world` is not an MPI
// communicator or MPI was not initialised at MPI_THREAD_MULTIPLE (the writer's collectives would
// then run on a second thread that MPI does not allow). Every rank gets the same answer.
std::shared_ptr<Communicator> make_writer_communicator(const Communicator& world,
                                                       std::string* why_not);

}  // namespace hp
