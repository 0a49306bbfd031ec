// OpenMP defaults (launch/cpu_threads.h): what is chosen from the launcher's environment, and
// that a variable the user set is never overridden.
#include "launch/cpu_threads.h"

#include <gtest/gtest.h>

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

TEST(CpuThreads, OneProcessGetsPassiveWaitingAndKeepsItsThreads) {
  const OmpDefaults d = choose({});
  EXPECT_EQ(d.local_ranks, 1);
  EXPECT_EQ(d.set, (Vars{{"OMP_WAIT_POLICY", "passive"}}));
}

TEST(CpuThreads, SeveralRanksOnANodeGetOneThreadEach) {
  const OmpDefaults d = choose(kTwoLocalRanks);
  EXPECT_EQ(d.local_ranks, 2);
  EXPECT_EQ(d.set, (Vars{{"OMP_WAIT_POLICY", "passive"}, {"OMP_NUM_THREADS", "1"}}));
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
                .set.size(),
            2u);
}

TEST(CpuThreads, WhatTheUserSetIsKept) {
  auto env = kTwoLocalRanks;
  env["OMP_NUM_THREADS"] = "3";
  env["OMP_WAIT_POLICY"] = "active";
  EXPECT_TRUE(choose(env).set.empty());
  env.erase("OMP_WAIT_POLICY");
  EXPECT_EQ(choose(env).set, (Vars{{"OMP_WAIT_POLICY", "passive"}}));
}

TEST(CpuThreads, OneRankPerNodeKeepsTheRuntimesThreadCount) {
  EXPECT_EQ(
      choose({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"}})
          .set,
      (Vars{{"OMP_WAIT_POLICY", "passive"}}));
}

TEST(CpuThreads, AMalformedLauncherEnvironmentIsLeftForTheJobToReport) {
  const OmpDefaults d = choose({{"OMPI_COMM_WORLD_RANK", "x"}});
  EXPECT_EQ(d.local_ranks, 1);
  EXPECT_EQ(d.set, (Vars{{"OMP_WAIT_POLICY", "passive"}}));
}

}  // namespace
}  // namespace hp
