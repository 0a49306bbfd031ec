// Rank discovery from launcher environments, bootstrap specs, and the world of one process.
#include "parallel/launch_env.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <map>
#include <string>

#include "parallel/mpi_communicator.h"

namespace hp {
namespace {

using Env = std::map<std::string, std::string>;

LaunchInfo detect(const Env& vars) {
  return detect_launch([&vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

// The message of the UserError that detect() throws ("" when it does not throw).
std::string detect_error(const Env& vars) {
  try {
    detect(vars);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

std::string bootstrap_error(const std::string& spec) {
  try {
    parse_bootstrap(spec);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(LaunchEnv, NothingSetIsOneProcess) {
  LaunchInfo info = detect({});
  EXPECT_EQ(info.method, "single");
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world, 1);
  EXPECT_EQ(info.local_rank, 0);
  EXPECT_FALSE(info.use_mpi);
}

TEST(LaunchEnv, Mpirun) {
  LaunchInfo info = detect({{"OMPI_COMM_WORLD_RANK", "5"},
                            {"OMPI_COMM_WORLD_SIZE", "8"},
                            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                            {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                            {"PMIX_RANK", "5"},
                            {"RANK", "0"}});  // mpirun wins over everything else
  EXPECT_EQ(info.method, "mpirun");
  EXPECT_TRUE(info.use_mpi);
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world, 4);
  EXPECT_EQ(info.describe(), "rank 5 of 8 (local 1 of 4) via mpirun");
}

TEST(LaunchEnv, MpirunMissingSize) {
  std::string err =
      detect_error({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}});
  EXPECT_NE(err.find("OMPI_COMM_WORLD_SIZE"), std::string::npos) << err;
}

TEST(LaunchEnv, SrunPmix) {
  LaunchInfo info = detect({{"PMIX_RANK", "6"},
                            {"SLURM_PROCID", "6"},
                            {"SLURM_NTASKS", "16"},
                            {"SLURM_LOCALID", "2"},
                            {"SLURM_NODEID", "1"},
                            {"SLURM_TASKS_PER_NODE", "4(x4)"}});
  EXPECT_EQ(info.method, "srun-pmix");
  EXPECT_TRUE(info.use_mpi);
  EXPECT_EQ(info.rank, 6);
  EXPECT_EQ(info.world, 16);
  EXPECT_EQ(info.local_rank, 2);
  EXPECT_EQ(info.local_world, 4);
}

TEST(LaunchEnv, SrunPmixRankDisagreement) {
  std::string err = detect_error(
      {{"PMIX_RANK", "1"}, {"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"}});
  EXPECT_NE(err.find("PMIX_RANK=1"), std::string::npos) << err;
  EXPECT_NE(err.find("SLURM_PROCID=2"), std::string::npos) << err;
}

TEST(LaunchEnv, PmixWithoutSlurmIsNotALauncher) {
  // Open MPI's singleton start sets PMIX_RANK; so may other PMIx tools.
  EXPECT_EQ(detect({{"PMIX_RANK", "0"}}).method, "single");
}

TEST(LaunchEnv, SingletonMpiIsIgnored) {
  // A process that called MPI_Init on its own, launched with RANK/WORLD_SIZE or by srun.
  LaunchInfo env = detect({{"OMPI_MCA_ess", "singleton"},
                           {"PMIX_RANK", "0"},
                           {"RANK", "2"},
                           {"WORLD_SIZE", "3"},
                           {"LOCAL_RANK", "2"}});
  EXPECT_EQ(env.method, "env");
  EXPECT_EQ(env.rank, 2);
  LaunchInfo slurm = detect({{"OMPI_MCA_ess", "singleton"},
                             {"PMIX_RANK", "0"},
                             {"SLURM_PROCID", "1"},
                             {"SLURM_NTASKS", "2"},
                             {"SLURM_LOCALID", "1"}});
  EXPECT_EQ(slurm.method, "slurm-env");
  EXPECT_FALSE(slurm.use_mpi);
  EXPECT_EQ(slurm.rank, 1);
}

TEST(LaunchEnv, RankWorldSize) {
  LaunchInfo info = detect({{"RANK", "3"},
                            {"WORLD_SIZE", "4"},
                            {"LOCAL_RANK", "1"},
                            {"LOCAL_WORLD_SIZE", "2"},
                            {"SLURM_PROCID", "0"},  // the step's view; RANK is more specific
                            {"SLURM_NTASKS", "2"},
                            {"SLURM_LOCALID", "0"}});
  EXPECT_EQ(info.method, "env");
  EXPECT_FALSE(info.use_mpi);
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world, 2);
}

TEST(LaunchEnv, SlurmWithoutMpi) {
  LaunchInfo info = detect({{"SLURM_PROCID", "5"},
                            {"SLURM_NPROCS", "7"},  // older name of SLURM_NTASKS
                            {"SLURM_LOCALID", "1"},
                            {"SLURM_NODEID", "2"},
                            {"SLURM_TASKS_PER_NODE", "2(x2),3"}});
  EXPECT_EQ(info.method, "slurm-env");
  EXPECT_FALSE(info.use_mpi);
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world, 7);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world, 3);
}

TEST(LaunchEnv, BadValuesNameTheVariable) {
  struct Case {
    Env env;
    std::string expect;
  };
  const Case cases[] = {
      {{{"RANK", "abc"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}, "RANK='abc'"},
      {{{"RANK", "-1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}, "RANK='-1'"},
      {{{"RANK", " 1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}, "RANK=' 1'"},
      {{{"RANK", "1"}, {"WORLD_SIZE", "2x"}, {"LOCAL_RANK", "0"}}, "WORLD_SIZE='2x'"},
      {{{"RANK", "1"}, {"WORLD_SIZE", ""}, {"LOCAL_RANK", "0"}}, "WORLD_SIZE=''"},
      {{{"RANK", "1"}, {"WORLD_SIZE", "99999999999"}, {"LOCAL_RANK", "0"}}, "WORLD_SIZE="},
      {{{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}},
       "RANK=4 must be less than WORLD_SIZE=4"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "0"}, {"LOCAL_RANK", "0"}}, "WORLD_SIZE=0"},
      {{{"RANK", "1"}, {"WORLD_SIZE", "2"}}, "LOCAL_RANK"},
      {{{"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}, "RANK"},
      {{{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
       "LOCAL_RANK=2 must be less than LOCAL_WORLD_SIZE=2"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}}, "SLURM_NTASKS"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}, "SLURM_LOCALID"},
      {{{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}},
       "SLURM_PROCID=2 must be less than SLURM_NTASKS=2"},
      {{{"OMPI_COMM_WORLD_RANK", "x"},
        {"OMPI_COMM_WORLD_SIZE", "2"},
        {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}},
       "OMPI_COMM_WORLD_RANK='x'"},
  };
  for (const Case& c : cases) {
    std::string err = detect_error(c.env);
    EXPECT_NE(err.find(c.expect), std::string::npos)
        << "expected '" << c.expect << "' in '" << err << "'";
  }
}

TEST(LaunchEnv, SlurmTasksPerNode) {
  EXPECT_EQ(slurm_tasks_on_node("8", 0), 8);
  EXPECT_EQ(slurm_tasks_on_node("4(x2),3", 0), 4);
  EXPECT_EQ(slurm_tasks_on_node("4(x2),3", 1), 4);
  EXPECT_EQ(slurm_tasks_on_node("4(x2),3", 2), 3);
  EXPECT_EQ(slurm_tasks_on_node("4(x2),3", 3), 0);
  EXPECT_EQ(slurm_tasks_on_node("1,2(x3)", 3), 2);
  EXPECT_EQ(slurm_tasks_on_node("", 0), 0);
  EXPECT_EQ(slurm_tasks_on_node("2(x", 0), 0);
  EXPECT_EQ(slurm_tasks_on_node("x", 0), 0);
  EXPECT_EQ(slurm_tasks_on_node("2;3", 1), 0);
}

TEST(Bootstrap, Parses) {
  Bootstrap m = parse_bootstrap("mpi");
  EXPECT_EQ(m.kind, Bootstrap::Kind::kMpi);
  Bootstrap f = parse_bootstrap("file:/shared/job/rdv");
  EXPECT_EQ(f.kind, Bootstrap::Kind::kFile);
  EXPECT_EQ(f.path, "/shared/job/rdv");
  Bootstrap t = parse_bootstrap("tcp:node017.cluster:29500");
  EXPECT_EQ(t.kind, Bootstrap::Kind::kTcp);
  EXPECT_EQ(t.host, "node017.cluster");
  EXPECT_EQ(t.port, 29500);
  for (const char* spec : {"mpi", "file:/a/b:c", "tcp:10.0.0.1:1"}) {
    EXPECT_EQ(parse_bootstrap(spec).str(), spec);
  }
}

TEST(Bootstrap, BadSpecsSayWhatIsValid) {
  const std::pair<const char*, const char*> cases[] = {
      {"", "unknown bootstrap ''"},
      {"MPI", "unknown bootstrap 'MPI'"},
      {"udp:host:1", "expected mpi, file:PATH"},
      {"file:", "has no path"},
      {"tcp:host", "needs a host and a port"},
      {"tcp::80", "needs a host and a port"},
      {"tcp:host:", "port ''"},
      {"tcp:host:0", "port '0' is not an integer in 1..65535"},
      {"tcp:host:65536", "port '65536'"},
      {"tcp:host:80x", "port '80x'"},
  };
  for (const auto& c : cases) {
    std::string err = bootstrap_error(c.first);
    EXPECT_NE(err.find(c.second), std::string::npos)
        << "spec '" << c.first << "': expected '" << c.second << "' in '" << err << "'";
  }
}

TEST(Bootstrap, Defaults) {
  LaunchInfo mpi;
  mpi.use_mpi = true;
  mpi.world = 4;
  EXPECT_EQ(default_bootstrap(mpi).kind, Bootstrap::Kind::kMpi);
  LaunchInfo one;
  EXPECT_EQ(default_bootstrap(one).kind, Bootstrap::Kind::kSingle);
  LaunchInfo env;
  env.method = "env";
  env.world = 2;
  try {
    default_bootstrap(env);
    ADD_FAILURE() << "a non-MPI launch of 2 ranks needs a bootstrap";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("file:PATH"), std::string::npos) << e.what();
  }
}

// choose_bootstrap() for the bootstrap key's text ("": not given), parsed as the options do.
Bootstrap choose_bootstrap(const LaunchInfo& info, const std::string& spec, bool cpu) {
  return hp::choose_bootstrap(
      info, spec.empty() ? std::nullopt : std::optional<Bootstrap>(parse_bootstrap(spec)), cpu);
}

// The message of the UserError that choose_bootstrap() throws ("" when it does not throw).
std::string choose_error(const LaunchInfo& info, const std::string& spec, bool cpu) {
  try {
    choose_bootstrap(info, spec, cpu);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

LaunchInfo launched(const char* method, bool mpi, int world) {
  LaunchInfo info;
  info.method = method;
  info.use_mpi = mpi;
  info.world = world;
  info.rank = world - 1;
  return info;
}

TEST(ChooseBootstrap, CpuRanksWithoutMpiAreRefusedBeforeAnyWork) {
  for (const char* method : {"env", "slurm-env"}) {
    const LaunchInfo info = launched(method, false, 2);
    for (const std::string spec : {"", "file:/shared/rdv", "tcp:node0:29500"}) {
      const std::string e = choose_error(info, spec, true);
      EXPECT_NE(e.find(str_cat("rank 1 of 2 (local 0) via ", method,
                               ": the cpu backend moves tensors between ranks over MPI")),
                std::string::npos)
          << e;
      EXPECT_NE(e.find("mpirun -np 2 hotpath"), std::string::npos) << e;
      EXPECT_NE(e.find("srun --mpi=pmix"), std::string::npos) << e;
      if (!spec.empty()) {
        EXPECT_NE(e.find("--bootstrap=" + spec), std::string::npos) << e;
      }
    }
  }
  // Under an MPI launcher, a store bootstrap would still leave the cpu backend without MPI.
  EXPECT_NE(choose_error(launched("mpirun", true, 2), "tcp:h:1", true).find("mpirun -np 2"),
            std::string::npos);
}

TEST(ChooseBootstrap, WhatIsAccepted) {
  // CPU: MPI launches, and one process without any.
  EXPECT_EQ(choose_bootstrap(launched("mpirun", true, 4), "", true).kind, Bootstrap::Kind::kMpi);
  EXPECT_EQ(choose_bootstrap(launched("srun-pmix", true, 4), "mpi", true).kind,
            Bootstrap::Kind::kMpi);
  EXPECT_EQ(choose_bootstrap(launched("single", false, 1), "", true).kind,
            Bootstrap::Kind::kSingle);
  EXPECT_EQ(choose_bootstrap(launched("env", false, 1), "file:/x", true).kind,
            Bootstrap::Kind::kFile);
  // GPU: the store bootstraps, and the same demand for one as without a backend.
  const LaunchInfo env = launched("env", false, 2);
  EXPECT_EQ(choose_bootstrap(env, "file:/x", false).path, "/x");
  EXPECT_EQ(choose_bootstrap(env, "tcp:h:29500", false).port, 29500);
  EXPECT_NE(choose_error(env, "", false).find("file:PATH"), std::string::npos);
  EXPECT_NE(choose_error(env, "udp:x", false).find("unknown bootstrap 'udp:x'"), std::string::npos);
}

TEST(CreateWorld, SingleProcess) {
  LaunchInfo one;
  auto world = create_world(one, default_bootstrap(one));
  EXPECT_EQ(world->size(), 1);
  EXPECT_EQ(world->rank(), 0);
  EXPECT_EQ(world->name(), "world");
  Tensor t = Tensor::host_from(std::vector<float>{1.5f, -2.f}, DType::kF32);
  world->all_reduce(t, ReduceOp::kSum);
  EXPECT_EQ(t.data<float>()[1], -2.f);
  std::vector<uint8_t> blob{1, 2, 3};
  EXPECT_EQ(share_blob(*world, blob), blob);

  LaunchInfo two;
  two.world = 2;
  two.method = "env";
  EXPECT_THROW(create_world(two, default_bootstrap(one)), UserError);
}

TEST(CreateWorld, MpiMustAgreeWithTheEnvironment) {
  int mpi_size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &mpi_size);
  if (mpi_size != 1) GTEST_SKIP() << "checks a singleton MPI start";
  // Launched by something that says 2 ranks, but MPI was started without a launcher.
  LaunchInfo info;
  info.method = "slurm-env";
  info.world = 2;
  info.rank = 1;
  try {
    create_world(info, parse_bootstrap("mpi"));
    ADD_FAILURE() << "MPI world of 1 accepted for a launch of 2";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("srun --mpi=pmix"), std::string::npos) << e.what();
  }
  LaunchInfo one;
  auto world = create_world(one, parse_bootstrap("mpi"));
  EXPECT_EQ(world->size(), 1);
  EXPECT_NE(dynamic_cast<MpiCommunicator*>(world.get()), nullptr);
}

}  // namespace
}  // namespace hp
