// OpenMP defaults for the CPU backend's threads, chosen before the OpenMP runtime starts.
//
// The OpenMP runtimes read OMP_WAIT_POLICY and OMP_NUM_THREADS once, when they are loaded,
// which is before main(). Their own defaults are poor for training jobs: idle threads spin for a
// while before they sleep, so a process on a busy machine (or several ranks of a node) slows
// itself and its neighbours down; and every rank of a node starts one thread per core, so N
// ranks oversubscribe the cores N-fold. So hotpath, unless the user set them:
//   OMP_WAIT_POLICY=passive   idle threads sleep at once;
//   OMP_NUM_THREADS=1         when the launcher says several ranks share this node.
// A variable the user set is never changed. When a default must be set, the program sets it in
// its environment and executes itself again (same pid, same arguments), so the runtime starts
// with it; HOTPATH_OMP_DEFAULTS marks the second start. The start-up log says what was chosen.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "parallel/launch_env.h"

namespace hp {

struct OmpDefaults {
  std::vector<std::pair<std::string, std::string>> set;  // variables to set, in order
  int local_ranks = 1;                                   // ranks on this node, as known
};

// What to set, from the environment (tests pass a map): pure.
OmpDefaults choose_omp_defaults(const EnvLookup& env);

// Called first in main(): sets the defaults and re-executes the program when any is missing.
// Returns (without re-executing) when nothing needs setting, on the second start, or when the
// re-execution fails (the runtime's defaults then stay; describe_cpu_threads() says so).
void apply_omp_defaults(char** argv);

// One line for the start-up log: threads per rank and wait policy, and who chose them, e.g.
// "cpu threads: 1 per rank (OMP_NUM_THREADS=1 chosen for 2 ranks on this node), idle threads
// passive (OMP_WAIT_POLICY=passive chosen)".
std::string describe_cpu_threads();

}  // namespace hp
