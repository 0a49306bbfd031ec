// CheckpointGroup: the processes a CheckpointWriter writes one file with, collectively (parallel
// HDF5 over MPI-IO).
//
// Parallel HDF5 needs an MPI communicator on the file-access property list, and the writer needs
// one reduction (the chunk checksums of all writers). framework/ does not know MPI: it declares
// this interface and parallel/ implements it over its MPI communicator
// (parallel/mpi_checkpoint_group.h, the only code that hands a communicator to HDF5). A writer
// given no group writes serially.
//
// Every method is collective over the group except use_mpio_driver: all processes call them in
// the same order. Thread safety: none; the thread that drives the group's communicator calls them.
// Ownership: the writer borrows the group, which must outlive it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hp {

class CheckpointGroup {
 public:
  virtual ~CheckpointGroup() = default;

  // Selects HDF5's MPI-IO file driver over this group on `fapl`, an HDF5 file-access property
  // list (an hid_t: a 64-bit identifier since HDF5 1.10). Local; throws hp::Error(kHdf5) when
  // HDF5 refuses.
  virtual void use_mpio_driver(int64_t fapl) const = 0;

  // words[0, n) becomes the bitwise OR of every process's words[0, n). Collective; throws
  // hp::Error when the reduction fails.
  virtual void bitwise_or(uint32_t* words, size_t n) const = 0;
};

}  // namespace hp
