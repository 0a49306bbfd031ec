// Rank discovery and bootstrap: who am I, how many are we, and how do we meet.
//
// detect_launch() reads the launcher's environment, in this order (the first that is present
// wins):
//   "mpirun"     Open MPI's mpirun/mpiexec: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE.
//   "srun-pmix"  srun --mpi=pmix: PMIX_RANK with SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID.
//                (A PMIX_RANK without Slurm, or one set by Open MPI's singleton start, is not a
//                launcher.)
//   "env"        RANK, WORLD_SIZE, LOCAL_RANK (LOCAL_WORLD_SIZE optional), e.g. torchrun-style
//                launchers. Checked before Slurm because a launcher that sets them inside a Slurm
//                step knows better than the step.
//   "slurm-env"  srun without MPI: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (local world from
//                SLURM_TASKS_PER_NODE and SLURM_NODEID).
//   "single"     none of the above: rank 0 of 1.
// Values are validated (integers, 0 <= rank < world, 0 <= local_rank < local_world when known)
// with errors that name the variable. use_mpi is true for "mpirun" and "srun-pmix".
//
// The world communicator comes from create_world(): MPI when the bootstrap is "mpi" (MPI must be
// initialised first, see MpiSession); otherwise a StoreCommunicator over a TcpStore served by
// rank 0 ("tcp:HOST:PORT", or "file:PATH" to publish its address), which carries control messages
// and NCCL unique ids only; no transport at all for a single process. MPI is never needed by a
// non-MPI launch, but the CPU backend needs it for several ranks (choose_bootstrap refuses the
// rest).
//
// Thread safety: the functions here are pure except create_world() (which blocks in the
// rendezvous) and share_blob() (a collective).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace hp {

struct LaunchInfo {
  int rank = 0;
  int world = 1;
  int local_rank = 0;
  int local_world = 0;            // ranks on this node; 0 when the launcher does not say
  std::string method = "single";  // "mpirun", "srun-pmix", "env", "slurm-env", "single"
  bool use_mpi = false;           // the launcher started an MPI job

  // "rank 3 of 8 (local 1 of 4) via srun-pmix", for logs.
  std::string describe() const;
};

// Looks a variable up; nullptr when unset. The real one wraps std::getenv.
using EnvLookup = std::function<const char*(const char*)>;

// From the process environment. Throws UserError naming the variable on a bad value.
LaunchInfo detect_launch();
// From `env` (tests pass a map).
LaunchInfo detect_launch(const EnvLookup& env);

// Tasks on node `node_id` from Slurm's SLURM_TASKS_PER_NODE syntax, e.g. "4(x2),3" -> node 0..1:
// 4, node 2: 3. Returns 0 when the string does not say (malformed, node out of range).
int slurm_tasks_on_node(const std::string& tasks_per_node, int node_id);

// How the ranks meet.
struct Bootstrap {
  enum class Kind {
    kMpi,     // "mpi": MPI_COMM_WORLD of an MPI launch
    kFile,    // "file:PATH": PATH (shared file system) tells where rank 0 serves a TcpStore
    kTcp,     // "tcp:HOST:PORT": rank 0 serves a TcpStore on PORT; others connect to HOST:PORT
    kSingle,  // one process, nothing to meet (from default_bootstrap only)
  };
  Kind kind = Kind::kSingle;
  std::string path;  // kFile
  std::string host;  // kTcp
  int port = 0;      // kTcp

  std::string str() const;  // the spec that parses back to this
};

// Parses "mpi", "file:PATH" or "tcp:HOST:PORT". Throws UserError saying what is valid.
Bootstrap parse_bootstrap(const std::string& spec);

// The bootstrap to use when the user gives none: "mpi" for MPI launches, kSingle for one process;
// otherwise a UserError asking for --bootstrap=file:PATH or tcp:HOST:PORT.
Bootstrap default_bootstrap(const LaunchInfo& info);

// The bootstrap of a launch: `given` (the bootstrap key, parsed by parse_bootstrap when the options
// were read), or default_bootstrap(info) when none was given. `cpu_backend` says whether this rank
// will run the CPU backend: with several ranks that backend moves its tensors over MPI, so a launch
// without MPI is refused with a UserError that says to launch with mpirun or srun --mpi=pmix (file:
// and tcp: bootstraps serve GPU runs, whose tensors move over NCCL). Pure: decides before any rank
// does any work.
Bootstrap choose_bootstrap(const LaunchInfo& info, const std::optional<Bootstrap>& given,
                           bool cpu_backend);

// Creates the world communicator (name "world") on every rank; collective over the job, bounded
// by options.timeout. Throws UserError for a bootstrap that cannot work with this launch (e.g.
// "mpi" without an MPI launcher, ranks started with different world sizes, a port in use).
//  - mpi: MPI must be initialised and must agree with `info` (rank and size); the communicator
//    is a duplicate of MPI_COMM_WORLD.
//  - file:PATH: rank 0 serves a TcpStore on an ephemeral port and writes "HOST:PORT RUN" to PATH
//    (temporary file + rename; HOST is HOTPATH_RENDEZVOUS_HOST, else the first non-loopback IPv4
//    address of this host's name; RUN a random token that its store also holds). The others poll
//    PATH and connect; an address where nobody serves, or a store whose token differs, is a PATH
//    left by an earlier job, and they read PATH again until rank 0 rewrites it. Rank 0 removes
//    PATH once every rank has joined. PATH must be on a file system every rank sees; the messages
//    themselves go over TCP (shared file systems may hide a new file from other hosts for
//    seconds, which one rendezvous tolerates but a training step cannot).
//  - tcp:HOST:PORT: rank 0 serves a TcpStore on PORT (every interface); the others connect to
//    HOST:PORT, retrying until rank 0 is up.
// Both then meet through StoreCommunicator::create_world (every rank present, same world size).
std::shared_ptr<Communicator> create_world(const LaunchInfo& info, const Bootstrap& bootstrap,
                                           const CommOptions& options = {});

// Collective: returns root's `blob` on every rank (other ranks' `blob` is ignored). For opaque
// bootstrap data such as the NCCL unique id.
std::vector<uint8_t> share_blob(Communicator& comm, const std::vector<uint8_t>& blob, int root = 0);

}  // namespace hp
