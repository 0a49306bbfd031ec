// MpiCommunicator: host-tensor communicator over an MPI communicator.
//
// Every operation is nonblocking MPI (MPI_Ialltoallv, MPI_Iallgatherv, MPI_Ibcast, MPI_Ibarrier,
// MPI_Isend/MPI_Irecv) completed by polling MPI_Test* against the call's deadline, so no call
// waits longer than timeout(). Point-to-point timeouts name the peers whose messages are still
// pending; for collectives MPI does not say which ranks are missing. A pending MPI operation
// cannot be cancelled, so after a timeout the communicator is broken (see communicator.h) and
// the caller must abort(), which calls MPI_Abort on MPI_COMM_WORLD and ends the whole job. As a
// safety net, a broken communicator aborts the job when it is destroyed: with an operation
// pending, neither MPI_Comm_free nor MPI_Finalize is sure to return.
// Reductions are computed by HostCommunicator (rank-order folds), never by MPI_Allreduce, whose
// summation order depends on the algorithm MPI picks.
//
// Ownership: the communicator owns its MPI_Comm (a duplicate or a split) and frees it on
// destruction (unless MPI is already finalised).
// Thread safety: one thread drives a communicator. MPI is initialised with MPI_THREAD_MULTIPLE
// where the library provides it, so that two threads may each drive their own communicator (the
// training thread and a background checkpoint writer, launch/train/async_checkpoint.h); with a
// lower level only the thread that initialised MPI calls it.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "parallel/host_communicator.h"

// Throws hp::Error(kMpi) with the statement, file:line and MPI's error string.
#define MPI_CHECK(stmt)                                                                   \
  do {                                                                                    \
    int hp_mpi_rc_ = (stmt);                                                              \
    if (hp_mpi_rc_ != MPI_SUCCESS) ::hp::mpi_fail(hp_mpi_rc_, #stmt, __FILE__, __LINE__); \
  } while (0)

namespace hp {

[[noreturn]] void mpi_fail(int rc, const char* stmt, const char* file, int line);

class MpiCommunicator final : public HostCommunicator {
 public:
  // Duplicates `comm` (MPI_COMM_WORLD for the world; collective over it, bounded by
  // options.timeout). MPI must be initialised.
  static std::shared_ptr<MpiCommunicator> create(MPI_Comm comm, const std::string& name,
                                                 const CommOptions& options = {});
  ~MpiCommunicator() override;

  // The underlying communicator, e.g. for MPI-IO. Owned by this object: do not free it.
  MPI_Comm comm() const { return comm_; }

  std::shared_ptr<Communicator> split_by_host(const std::string& name) override;
  // MPI_Abort with the status set_abort_exit_code() chose (1 by default).
  void abort(const std::string& reason) noexcept override;
  // The exit status abort() ends the whole job with (mpirun passes it on), so that a job fails
  // with the status a single process would have (2: a mistake in the input, 1: at run time).
  static void set_abort_exit_code(int code) noexcept;

 protected:
  void do_all_to_all(const Op& op, const char* send, const std::vector<size_t>& send_bytes,
                     const std::vector<size_t>& send_displs, char* recv,
                     const std::vector<size_t>& recv_bytes,
                     const std::vector<size_t>& recv_displs) override;
  void do_all_gather(const Op& op, const char* send, size_t bytes, char* recv,
                     const std::vector<size_t>& recv_bytes,
                     const std::vector<size_t>& recv_displs) override;
  void do_broadcast(const Op& op, char* data, size_t bytes, int root) override;
  void do_barrier(const Op& op) override;
  void do_p2p(const Op& op, const std::vector<P2p>& ops) override;
  std::shared_ptr<Communicator> do_split(const Op& op, int color, const std::vector<int>& members,
                                         const std::string& name) override;

 private:
  MpiCommunicator(MPI_Comm comm, std::string name, int rank, int size, std::vector<int> world_ranks,
                  CommOptions options);
  static std::vector<int> world_ranks_of(MPI_Comm comm);

  // Polls the requests until all complete or op.deadline passes. peers[i] is the rank that
  // request i waits on (-1: a collective, unknown).
  void wait(const Op& op, std::vector<MPI_Request>& requests, const std::vector<int>& peers);

  MPI_Comm comm_ = MPI_COMM_NULL;
};

// Whether MPI is initialised at MPI_THREAD_MULTIPLE (MPI_Query_thread): several threads may then
// call MPI at once, each on its own communicator.
bool mpi_thread_multiple();

// Initialises MPI (asking for MPI_THREAD_MULTIPLE; see mpi_thread_multiple) unless it already is, and finalises it on destruction if
// it did the initialising. Create it first in main() of an MPI program; destroy communicators
// before it goes away.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

 private:
  bool owns_ = false;
};

}  // namespace hp
