#include "parallel/mpi_checkpoint_group.h"

#include <climits>
#include <type_traits>

#include "framework/core/hdf5_util.h"
#include "parallel/mpi_communicator.h"

namespace hp {
namespace {

static_assert(std::is_same<hid_t, int64_t>::value, "HDF5 1.10 or later (64-bit hid_t)");

class MpiCheckpointGroup final : public CheckpointGroup {
 public:
  explicit MpiCheckpointGroup(MPI_Comm comm) : comm_(comm) {}

  void use_mpio_driver(int64_t fapl) const override {
    H5_CHECK(H5Pset_fapl_mpio(fapl, comm_, MPI_INFO_NULL), "the MPI-IO file driver");
  }

  void bitwise_or(uint32_t* words, size_t n) const override {
    HP_CHECK(n <= static_cast<size_t>(INT_MAX), "bitwise_or of ", n, " words");
    MPI_CHECK(
        MPI_Allreduce(MPI_IN_PLACE, words, static_cast<int>(n), MPI_UINT32_T, MPI_BOR, comm_));
  }

 private:
  MPI_Comm comm_;
};

}  // namespace

std::unique_ptr<CheckpointGroup> make_checkpoint_group(const Communicator& comm) {
  const auto* mpi = dynamic_cast<const MpiCommunicator*>(&comm);
  if (mpi == nullptr) return nullptr;
  return std::make_unique<MpiCheckpointGroup>(mpi->comm());
}

std::shared_ptr<Communicator> make_writer_communicator(const Communicator& world,
                                                       std::string* why_not) {
  const auto* mpi = dynamic_cast<const MpiCommunicator*>(&world);
  if (mpi == nullptr) {
    *why_not = "the world is not an MPI communicator";
    return nullptr;
  }
  if (!mpi_thread_multiple()) {
    *why_not = "the MPI library does not provide MPI_THREAD_MULTIPLE";
    return nullptr;
  }
  return MpiCommunicator::create(mpi->comm(), world.name() + ".checkpoint_writer", world.options());
}

}  // namespace hp
