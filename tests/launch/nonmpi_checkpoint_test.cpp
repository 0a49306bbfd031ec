// The checkpoint of a launch without MPI, on the CPU: two ranks as threads, each with the two
// kinds of communicators such a launch has. The save's control messages (its agreements,
// barriers and commit) go through a StoreCommunicator over one store; tensors (gradient sums, the
// expert exchange, zero1's gathers, the checkpoint's gathers) and the training steps' scalars go
// through ThreadCommunicator, the in-process stand-in for the NCCL groups of a GPU run
// (tests/parallel/thread_comm.h). The save takes the same path as on GPUs: plan, gathers over the
// tensor groups, rank 0 writes alone, commit. The test checks that every tensor byte the save
// moved went through the tensor groups (the exact count of a 2-rank gather), that the file holds
// each rank's rows bitwise with sound checksums, and that a resume from it continues bitwise.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "framework/checkpoint/checkpoint.h"
#include "launch/tools/tools.h"
#include "launch/train/run_checkpoint.h"
#include "launch/train/trainer.h"
#include "parallel/store_communicator.h"
#include "tests/common/launch_fixtures.h"
#include "tests/parallel/thread_comm.h"

namespace fs = std::filesystem;

namespace hp {
namespace {

using namespace std::chrono_literals;

// The HDF5 library of the build is not thread-safe: the ranks (threads) take turns at the file.
std::mutex hdf5_mu;

// A 2-layer MoE of 4 experts, split over 2 ranks (ep_size 2), optimizer state sharded (zero1).
TrainOptions moe_run() {
  TrainOptions o = test::small_dense_options();
  o.model.n_experts = 4;
  o.model.top_k = 2;
  o.model.expert_ffn_dim = 32;
  o.parallel.ep_size = 2;
  o.optimizer.sharding = OptimizerSharding::kZero1;
  o.run.steps = 3;
  o.run.log_every = 100;
  return o;
}

// The bytes a save's gathers move between 2 ranks: zero1 shards over a group of 2 (each rank
// sends its half of the block), expert blocks over ep (each rank sends its block), for the
// master and both moments.
int64_t expected_gather_bytes(Model& model, DType dtype) {
  int64_t bytes = 0;
  for (auto& p : model.params().all()) {
    const int64_t es = static_cast<int64_t>(dtype_size(dtype));
    int64_t per_item = 0;
    if (p->sharded()) per_item += shape_numel(p->shape) * es;
    if (p->group == ParamGroup::kExpert) per_item += p->global_numel() * es;
    bytes += 3 * per_item;
  }
  return bytes;
}

struct Rank {
  RankContext tensors;  // ThreadCommunicator groups: the data path
  RankContext control;  // StoreCommunicator groups: control messages only
};

// Rank r's two contexts over `mailbox` (tensors) and `store` (control).
Rank make_rank(int r, const std::shared_ptr<test::ThreadCommunicator>& world,
               const std::shared_ptr<HashStore>& store) {
  CommOptions co;
  co.timeout = 60s;
  Rank k;
  k.tensors.groups = make_process_groups(world, 2);
  k.control.groups =
      make_process_groups(StoreCommunicator::create_world(store->handle(r), r, 2, co), 2);
  return k;
}

// The run state of `t` whose collectives go through the control groups, its tensors through the
// trainer's tensor groups (the ThreadCommunicator ones).
RunState control_state(Trainer& t, const RankContext& control) {
  RunState s = t.run_state();
  RunState c{s.options,  control,    s.backend,       s.model,         s.loader,
             s.schedule, s.position, s.params_loaded, s.tensor_groups, s.loader_state};
  return c;
}

TEST(NonMpiCheckpoint, GathersOverTheTensorGroupsAndResumesBitwise) {
  const TrainOptions o = moe_run();
  const fs::path dir = test::fresh_temp_dir("nonmpi_ckpt");
  const std::string ckpt_dir = (dir / "ckpt").string();

  // Run 1: 2 steps, save, 1 more step (the reference for the resumed run).
  auto mailbox = std::make_shared<test::Mailbox>();
  auto store = std::make_shared<HashStore>();
  CommOptions co;
  co.timeout = 60s;
  auto worlds = test::ThreadCommunicator::world(2, mailbox, co);
  std::vector<double> third_loss(2, 0.0);
  std::vector<int64_t> moved(2, 0), expected(2, 0);
  std::vector<std::string> errors(2);
  std::vector<std::string> mismatches(2);
  std::string saved_path;
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        try {
          Rank k = make_rank(r, worlds[static_cast<size_t>(r)], store);
          Trainer t(o, k.tensors);
          t.step();
          t.step();
          RunState rs = control_state(t, k.control);
          k.control.groups.world->barrier();
          const int64_t before = mailbox->bytes_moved();
          k.control.groups.world->barrier();
          const SaveStats stats = save_checkpoint(rs, ckpt_dir, 0);
          k.control.groups.world->barrier();
          moved[static_cast<size_t>(r)] = mailbox->bytes_moved() - before;
          expected[static_cast<size_t>(r)] =
              expected_gather_bytes(t.model(), t.backend().master_dtype());
          if (r == 0) saved_path = stats.path;
          k.control.groups.world->barrier();
          // The file holds this rank's rows of every master and moment, bitwise.
          {
            std::lock_guard<std::mutex> lk(hdf5_mu);
            CheckpointReader reader(stats.path);
            for (auto& p : t.model().params().all()) {
              const int64_t base = p->group == ParamGroup::kExpert ? p->expert_begin : 0;
              const RowRange rows{base + p->state_row_begin(), p->state_rows()};
              const std::pair<std::string, const Tensor*> items[] = {
                  {"/params/" + p->name, &p->master},
                  {"/optim/" + p->name + "/m", &p->m},
                  {"/optim/" + p->name + "/v", &p->v}};
              for (const auto& [name, local] : items) {
                std::vector<char> got(local->nbytes());
                reader.read_rows(name, rows, local->dtype(), got.data());
                if (std::memcmp(got.data(), local->raw(), got.size()) != 0)
                  mismatches[static_cast<size_t>(r)] += name + " ";
              }
            }
          }
          third_loss[static_cast<size_t>(r)] = t.step().loss;
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
          worlds[static_cast<size_t>(r)]->abort(e.what());
        }
      });
    }
    for (auto& th : threads) th.join();
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    EXPECT_EQ(mismatches[static_cast<size_t>(r)], "") << "rank " << r << " rows differ";
  }
  // Every tensor byte of the save crossed over the tensor groups, and nothing else did.
  EXPECT_GT(expected[0], 0);
  EXPECT_EQ(moved[0], expected[0]);
  EXPECT_EQ(moved[1], expected[0]);
  // Sound checksums and a complete dataset list.
  {
    testing::internal::CaptureStdout();
    const int rc = inspect_main({saved_path});
    const std::string out = testing::internal::GetCapturedStdout();
    EXPECT_EQ(rc, 0) << out;
    EXPECT_NE(out.find("checksums: ok"), std::string::npos) << out;
  }
  {
    CheckpointReader reader(saved_path);
    EXPECT_EQ(reader.int_attr("world"), 2);
    EXPECT_EQ(reader.int_attr("ep"), 2);
    EXPECT_EQ(reader.int_attr("step"), 2);
  }

  // Run 2: fresh ranks load the checkpoint (each its own rows; zero1 then gathers the working
  // weights over the tensor groups) and step 3 gives the uninterrupted run's loss, bitwise.
  auto mailbox2 = std::make_shared<test::Mailbox>();
  auto store2 = std::make_shared<HashStore>();
  auto worlds2 = test::ThreadCommunicator::world(2, mailbox2, co);
  std::vector<double> resumed_loss(2, 0.0);
  std::vector<int64_t> resumed_at(2, -1);
  {
    const TrainOptions o2 = o;
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        try {
          Rank k = make_rank(r, worlds2[static_cast<size_t>(r)], store2);
          Trainer t(o2, k.tensors);
          RunState rs = control_state(t, k.control);
          const std::function<void()> gather = rs.params_loaded;
          rs.params_loaded = nullptr;  // a collective: run after the turn at the file
          RunPosition pos;
          {
            std::lock_guard<std::mutex> lk(hdf5_mu);
            pos = load_checkpoint(rs, saved_path);
          }
          if (gather) gather();
          t.set_position(pos);
          resumed_at[static_cast<size_t>(r)] = pos.step;
          resumed_loss[static_cast<size_t>(r)] = t.step().loss;
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
          worlds2[static_cast<size_t>(r)]->abort(e.what());
        }
      });
    }
    for (auto& th : threads) th.join();
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    EXPECT_EQ(resumed_at[static_cast<size_t>(r)], 2);
    EXPECT_EQ(resumed_loss[static_cast<size_t>(r)], third_loss[static_cast<size_t>(r)])
        << "rank " << r << ": step 3 after the resume differs from the uninterrupted run";
  }
  EXPECT_GT(third_loss[0], 0.0);
}

// The step's host scalars go in one all-reduce of 9 doubles (loss sums, non-finite flag, gradient
// sums of squares, the next batch's counts, the preemption flag); only the first step also sums
// its own counts (3 doubles) first. Gradients are f32 here, so no gradient reduction has either
// size. (That the losses are those of counting each step on its own: the mpi tests comparing 2
// and 4 ranks with one, and the resume tests.)
TEST(HostCollectives, OnePerStepAfterTheFirst) {
  TrainOptions o = moe_run();
  o.optimizer.sharding = OptimizerSharding::kNone;
  o.run.steps = 4;
  auto mailbox = std::make_shared<test::Mailbox>();
  CommOptions co;
  co.timeout = 60s;
  auto worlds = test::ThreadCommunicator::world(2, mailbox, co);
  std::vector<std::vector<int>> scalars(2), counts(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        RankContext ctx;
        ctx.groups = make_process_groups(worlds[static_cast<size_t>(r)], 2);
        Trainer t(o, ctx);
        const auto& g = worlds[static_cast<size_t>(r)]->gathers();
        for (int step = 0; step < 4; ++step) {
          const size_t before = g.size();
          t.step();
          int n9 = 0, n3 = 0;
          for (size_t i = before; i < g.size(); ++i) {
            n9 += g[i] == 9 * sizeof(double);
            n3 += g[i] == 3 * sizeof(double);
          }
          scalars[static_cast<size_t>(r)].push_back(n9);
          counts[static_cast<size_t>(r)].push_back(n3);
        }
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        worlds[static_cast<size_t>(r)]->abort(e.what());
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    EXPECT_EQ(scalars[static_cast<size_t>(r)], (std::vector<int>{1, 1, 1, 1})) << "rank " << r;
    EXPECT_EQ(counts[static_cast<size_t>(r)], (std::vector<int>{1, 0, 0, 0})) << "rank " << r;
  }
}

}  // namespace
}  // namespace hp
