// OpenMP defaults for the CPU backend's threads, set at the start of main().
//
// The OpenMP runtime's own defaults suit a machine of one's own: every process starts one thread
// per core, so N ranks of one node oversubscribe the cores N-fold. So, unless the user set
// OMP_NUM_THREADS, hotpath runs one thread per rank when the launcher says several ranks share
// this node: omp_set_num_threads(1) on the thread that drives the backend (the only one that
// starts OpenMP regions, BLAS included), and OMP_NUM_THREADS=1 in the environment for anything
// it starts. A variable the user set is never changed.
//
// OMP_WAIT_POLICY is left to the user: the GNU runtime reads it when it is loaded, before main(),
// and no call changes it afterwards. Unless it is set, idle threads spin a while before they
// sleep (the runtime's default), which on a busy machine slows a process of several threads; one
// thread per rank has no idle threads. Set OMP_WAIT_POLICY=passive to make them sleep at once.
// The start-up log says what applies and who chose it.
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

// Called first in main(): applies choose_omp_defaults() of the process environment to this
// thread's OpenMP settings and to the environment.
void apply_omp_defaults();

// One line for the start-up log: threads per rank and wait policy, and who chose them, e.g.
// "cpu threads: 1 per rank (OMP_NUM_THREADS=1 chosen for 2 ranks on this node), idle threads
// spin, then sleep (OMP_WAIT_POLICY unset: the OpenMP runtime's default)".
std::string describe_cpu_threads();

}  // namespace hp
