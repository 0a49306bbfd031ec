// One rank's place in the job: how it was launched, and its process groups (world, dp, ep, node).
#pragma once

#include <memory>

#include "launch/options.h"
#include "parallel/launch_env.h"
#include "parallel/process_groups.h"

namespace hp {

class MpiSession;

struct RankContext {
  LaunchInfo launch;
  ProcessGroups groups;
  int rank() const { return groups.world ? groups.world->rank() : 0; }
  int world() const { return groups.world ? groups.world->size() : 1; }
};

// A context for one process without any launcher (tests, tools).
RankContext single_rank_context();

// Collective over the world: true on every rank when `flag` is true on any rank (all-reduce MAX).
bool any_rank(const RankContext& ctx, bool flag);

// This process as one rank of the job: finds the launch (mpirun, Slurm, RANK/WORLD_SIZE), sets
// up logging with the rank, checks that this host's memory holds the rank's batch (CPU backend),
// meets the other ranks and builds the process groups. The options have passed
// validate_train_options for the launch's world size (main), on every rank before any
// collective, so a bad config fails fast everywhere. A command that fails on any rank calls abort(), which tears the whole job down, so no
// rank waits forever for a peer that has died.
class Job {
 public:
  Job(const TrainOptions& o, int* argc, char*** argv);
  ~Job();
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;
  const RankContext& context() const { return ctx_; }
  // Aborts the job's communicators with `reason` (multi-rank worlds); under MPI the job ends
  // with `exit_code`. Never throws.
  void abort(const char* reason, int exit_code = 1) noexcept;

 private:
  std::unique_ptr<MpiSession> mpi_;  // declared first: outlives the communicators
  RankContext ctx_;
};

}  // namespace hp
