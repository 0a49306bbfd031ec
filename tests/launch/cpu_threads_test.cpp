// OpenMP defaults (launch/cpu_threads.h): what is chosen from the launcher's environment, that a
// variable the user set is never overridden, and that the choice takes effect in this process.
#include "launch/cpu_threads.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace hp {
namespace {

using Vars = std::vector<std::pair<std::string, std::string>>;

OmpDefaults choose(const std::map<std::string, std::string>& env) {
  return choose_omp_defaults([&](const char* k) -> const char* {
    auto it = env.find(k);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

const std::map<std::string, std::string> kTwoLocalRanks = {{"OMPI_COMM_WORLD_RANK", "1"},
                                                           {"OMPI_COMM_WORLD_SIZE", "4"},
                                                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};

TEST(CpuThreads, OneProcessKeepsTheRuntimesDefaults) {
  const OmpDefaults d = choose({});
  EXPECT_EQ(d.local_ranks, 1);
  EXPECT_TRUE(d.set.empty());
}

TEST(CpuThreads, SeveralRanksOnANodeGetOneThreadEach) {
  const OmpDefaults d = choose(kTwoLocalRanks);
  EXPECT_EQ(d.local_ranks, 2);
  EXPECT_EQ(d.set, (Vars{{"OMP_NUM_THREADS", "1"}}));
  // The same from Slurm's and torchrun-style variables.
  EXPECT_EQ(
      choose({{"RANK", "0"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "4"}})
          .local_ranks,
      4);
  EXPECT_EQ(choose({{"SLURM_PROCID", "3"},
                    {"SLURM_NTASKS", "4"},
                    {"SLURM_LOCALID", "1"},
                    {"SLURM_TASKS_PER_NODE", "2(x2)"},
                    {"SLURM_NODEID", "1"}})
                .set,
            (Vars{{"OMP_NUM_THREADS", "1"}}));
}

TEST(CpuThreads, WhatTheUserSetIsKept) {
  auto env = kTwoLocalRanks;
  env["OMP_NUM_THREADS"] = "3";
  EXPECT_TRUE(choose(env).set.empty());
  env["OMP_NUM_THREADS"] = "";  // empty: as if unset
  EXPECT_EQ(choose(env).set, (Vars{{"OMP_NUM_THREADS", "1"}}));
  // The wait policy is the user's alone, set or not.
  env["OMP_WAIT_POLICY"] = "active";
  EXPECT_EQ(choose(env).set, (Vars{{"OMP_NUM_THREADS", "1"}}));
}

TEST(CpuThreads, OneRankPerNodeKeepsTheRuntimesThreadCount) {
  EXPECT_EQ(
      choose({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"}})
          .set,
      Vars{});
}

TEST(CpuThreads, AMalformedLauncherEnvironmentIsLeftForTheJobToReport) {
  const OmpDefaults d = choose({{"OMPI_COMM_WORLD_RANK", "x"}});
  EXPECT_EQ(d.local_ranks, 1);
  EXPECT_TRUE(d.set.empty());
}

// This process as rank 1 of 2 on one node (torchrun-style variables: the test program's own MPI
// start may mark Open MPI's as a singleton's).
void set_two_local_ranks() {
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("LOCAL_RANK", "1", 1);
  ::setenv("LOCAL_WORLD_SIZE", "2", 1);
}

// Applied at run time, in this process: several ranks on the node and no OMP_NUM_THREADS make
// this thread's OpenMP regions one thread wide (the runtime may have started with more).
TEST(CpuThreads, AppliedDefaultsTakeEffectInThisProcess) {
  ::unsetenv("OMP_NUM_THREADS");
  set_two_local_ranks();
  omp_set_num_threads(3);
  apply_omp_defaults();
  EXPECT_EQ(omp_get_max_threads(), 1);  // the width of the next parallel region, BLAS's too
  EXPECT_STREQ(std::getenv("OMP_NUM_THREADS"), "1");
  EXPECT_NE(describe_cpu_threads().find(
                "cpu threads: 1 per rank (OMP_NUM_THREADS=1 chosen for 2 ranks on this node)"),
            std::string::npos)
      << describe_cpu_threads();
}

TEST(CpuThreads, AThreadCountTheUserSetIsKeptAtRunTime) {
  ::setenv("OMP_NUM_THREADS", "3", 1);
  set_two_local_ranks();
  omp_set_num_threads(3);
  apply_omp_defaults();
  EXPECT_EQ(omp_get_max_threads(), 3);
  EXPECT_NE(describe_cpu_threads().find("3 per rank (OMP_NUM_THREADS=3 set by the user)"),
            std::string::npos)
      << describe_cpu_threads();
}

}  // namespace
}  // namespace hp
