// Background checkpoint saves (launch/train/async_checkpoint.h) write the very file a synchronous
// save of the same step writes, byte for byte: on one rank, and under MPI on 2 and 4 ranks with
// optimizer_sharding none and zero1 (the writer then runs its collectives on its own
// communicator). A run that reads its batches from an HDF5 token file while a writer thread
// writes a checkpoint after every step ends as the same run with synchronous saves: the same
// losses and the same files (its token file is chunked, so the training thread reads every
// batch through HDF5 while the writer writes through it: the process-wide HDF5 lock at work).
#include "launch/train/async_checkpoint.h"

#include <gtest/gtest.h>
#include <hdf5.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "framework/checkpoint/checkpoint.h"
#include "framework/core/hdf5_util.h"
#include "framework/data/loader.h"
#include "launch/json.h"
#include "launch/train/fault_injection.h"
#include "launch/train/rank_context.h"
#include "launch/train/trainer.h"
#include "parallel/launch_env.h"
#include "tests/common/launch_fixtures.h"
#include "tests/common/mpi_case.h"
#include "tests/parallel/thread_comm.h"

namespace fs = std::filesystem;

namespace hp {
namespace {

std::vector<char> file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  EXPECT_TRUE(in.good()) << p;
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TrainOptions moe_options(OptimizerSharding sharding, int ep) {
  TrainOptions o = test::small_dense_options();
  o.model.n_experts = 4;
  o.model.top_k = 2;
  o.model.expert_ffn_dim = 32;
  o.parallel.ep_size = ep;
  o.optimizer.sharding = sharding;
  o.run.steps = 4;
  o.run.log_every = 100;
  return o;
}

// Trains 2 steps, saves step 2 synchronously into <dir>/sync and in the background into
// <dir>/async, and expects the two files equal byte for byte (rank 0 compares them).
void expect_same_file(const TrainOptions& base, const RankContext& ctx, const fs::path& dir) {
  Trainer t(base, ctx);
  t.step();
  t.step();
  const RunState run = t.run_state();
  const SaveStats sync = save_checkpoint(run, (dir / "sync").string(), 0);
  TrainOptions o = base;
  o.checkpoint.dir = (dir / "async").string();
  o.checkpoint.async = true;
  CheckpointSaver saver(o, run);
  ASSERT_TRUE(saver.async()) << "background saves were not chosen";
  EXPECT_GT(saver.snapshot_bytes(), 0);
  saver.save(run);
  saver.save_now(run);  // waits for the writer; step 2 is committed, so nothing more is saved
  const std::vector<CheckpointReport> reports = saver.take_reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].step, 2);
  EXPECT_TRUE(reports[0].async);
  if (ctx.rank() != 0) return;
  const fs::path a = dir / "async" / checkpoint_file_name(2);
  EXPECT_EQ(reports[0].bytes, static_cast<int64_t>(fs::file_size(a)));
  EXPECT_EQ(read_latest((dir / "async").string()), a.string());
  EXPECT_FALSE(fs::exists(a.string() + ".tmp"));
  const std::vector<char> s = file_bytes(sync.path), b = file_bytes(a);
  EXPECT_GT(s.size(), 0u);
  EXPECT_TRUE(s == b) << sync.path << " and " << a << " differ (" << s.size() << " vs " << b.size()
                      << " bytes)";
}

// The fault points of background saves parse; a failure point that does not exist is refused
// naming the variable and the points there are.
TEST(AsyncCheckpoint, FaultPointsOfBackgroundSaves) {
  for (const char* point : {"snapshot", "latest"}) {
    const FaultSpec f = parse_fault_spec(std::string("kill-save-") + point + ":1:4");
    EXPECT_EQ(f.kind, FaultKind::kKillInSave);
    EXPECT_EQ(f.save_point, point);
  }
  for (const char* point : {"snapshot", "data", "close"}) {
    const FaultSpec f = parse_fault_spec(std::string("fail-save-") + point + ":-1:6");
    EXPECT_EQ(f.kind, FaultKind::kFailSave);
    EXPECT_EQ(f.save_point, point);
    EXPECT_EQ(f.rank, -1);
    EXPECT_EQ(f.step, 6);
  }
  const FaultSpec slow = parse_fault_spec("slow-save:0:2");
  EXPECT_EQ(slow.kind, FaultKind::kSlowSave);
  EXPECT_EQ(slow.step, 2);
  const FaultSpec full = parse_fault_spec("no-host-memory:-1:0");
  EXPECT_EQ(full.kind, FaultKind::kNoHostMemory);
  EXPECT_EQ(full.rank, -1);
  try {
    parse_fault_spec("no-host-memory:0:3");
    ADD_FAILURE() << "no-host-memory at step 3 accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("no-host-memory acts before step 1: STEP must be 0"),
              std::string::npos)
        << e.what();
  }
  try {
    parse_fault_spec("fail-save-rename:0:1");
    ADD_FAILURE() << "fail-save-rename accepted";
  } catch (const UserError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("HOTPATH_FAULT='fail-save-rename:0:1'"), std::string::npos) << m;
    EXPECT_NE(m.find("unknown failure point 'rename'"), std::string::npos) << m;
    EXPECT_NE(m.find("fail-save-POINT (POINT: snapshot, data, close"), std::string::npos) << m;
  }
}

TEST(AsyncCheckpoint, SameFileAsSynchronousSaveOnOneRank) {
  const fs::path dir = test::fresh_temp_dir("async_one_rank");
  expect_same_file(moe_options(OptimizerSharding::kNone, 1), single_rank_context(), dir);
}

// A token file whose /tokens is chunked (64 tokens a chunk), so that the loader reads every batch
// through HDF5 on the training thread, not with direct reads of the file.
void write_chunked_token_file(const std::string& path,
                              const std::vector<std::vector<int32_t>>& docs) {
  std::vector<uint32_t> tokens;
  std::vector<int64_t> offsets{0};
  for (const auto& d : docs) {
    tokens.insert(tokens.end(), d.begin(), d.end());
    offsets.push_back(static_cast<int64_t>(tokens.size()));
  }
  H5Lock lock;
  H5Handle file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
  ASSERT_TRUE(file.valid());
  const hsize_t nt = tokens.size(), no = offsets.size(), chunk = 64;
  H5Handle tspace(H5Screate_simple(1, &nt, nullptr), H5Sclose);
  H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  ASSERT_GE(H5Pset_chunk(dcpl.get(), 1, &chunk), 0);
  H5Handle t(H5Dcreate2(file.get(), "/tokens", H5T_STD_U32LE, tspace.get(), H5P_DEFAULT, dcpl.get(),
                        H5P_DEFAULT),
             H5Dclose);
  ASSERT_GE(H5Dwrite(t.get(), H5T_NATIVE_UINT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, tokens.data()), 0);
  H5Handle ospace(H5Screate_simple(1, &no, nullptr), H5Sclose);
  H5Handle o(H5Dcreate2(file.get(), "/doc_offsets", H5T_STD_I64LE, ospace.get(), H5P_DEFAULT,
                        H5P_DEFAULT, H5P_DEFAULT),
             H5Dclose);
  ASSERT_GE(H5Dwrite(o.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, offsets.data()), 0);
}

// Every line of a metrics file, parsed.
std::vector<Json> metrics_lines(const fs::path& p) {
  std::vector<Json> out;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line)) out.push_back(Json::parse(line));
  return out;
}

TEST(AsyncCheckpoint, TrainsFromAnHdf5TokenFileWhileTheWriterWrites) {
  const fs::path dir = test::fresh_temp_dir("async_h5_tokens");
  // 40 documents of 5..40 tokens below the EOT (15), from a fixed LCG: random, not all alike.
  std::vector<std::vector<int32_t>> docs;
  uint32_t x = 12345;
  for (int d = 0; d < 40; ++d) {
    x = x * 1664525u + 1013904223u;
    std::vector<int32_t> doc(5 + (x >> 8) % 36);
    for (int32_t& tok : doc) {
      x = x * 1664525u + 1013904223u;
      tok = static_cast<int32_t>((x >> 12) % 15);
    }
    docs.push_back(doc);
  }
  write_chunked_token_file((dir / "docs.h5").string(), docs);
  {
    TrainOptions o = moe_options(OptimizerSharding::kNone, 1);
    o.data.source = (dir / "docs.h5").string();
    const std::string how = DataLoader::open(make_data_config(o, 0, 1))->describe();
    ASSERT_NE(how.find("read through HDF5"), std::string::npos) << how;
  }
  std::vector<std::vector<Json>> runs;
  for (const bool async : {true, false}) {
    TrainOptions o = moe_options(OptimizerSharding::kNone, 1);
    o.data.source = (dir / "docs.h5").string();
    o.checkpoint.dir = (dir / (async ? "async" : "sync")).string();
    o.checkpoint.every = 1;
    o.checkpoint.async = async;
    o.run.metrics_path = (dir / (async ? "async.jsonl" : "sync.jsonl")).string();
    ASSERT_EQ(test::validation_message(o), "");
    ASSERT_EQ(run_train(o, single_rank_context()), 0);
    runs.push_back(metrics_lines(o.run.metrics_path));
  }
  ASSERT_EQ(runs[0].size(), 4u);
  ASSERT_EQ(runs[1].size(), 4u);
  std::vector<int64_t> async_steps;
  int sync_reports = 0;
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(runs[0][i]["loss"].get<double>(), runs[1][i]["loss"].get<double>())
        << "step " << i + 1;
    // Reports of saves that committed in the background ride on the following steps' lines.
    if (runs[0][i].contains("checkpoints"))
      for (const Json& c : runs[0][i]["checkpoints"]) {
        EXPECT_TRUE(c["async"].get<bool>());
        EXPECT_GT(c["bytes"].get<int64_t>(), 0);
        EXPECT_GE(c["write_ms"].get<double>(), 0.0);
        EXPECT_LE(c["step"].get<int64_t>(), static_cast<int64_t>(i));
        EXPECT_GE(c["committed_after_step"].get<int64_t>(), c["step"].get<int64_t>());
        async_steps.push_back(c["step"].get<int64_t>());
      }
    if (runs[1][i].contains("checkpoints"))
      for (const Json& c : runs[1][i]["checkpoints"]) {
        EXPECT_FALSE(c["async"].get<bool>());
        ++sync_reports;
      }
  }
  // A save is reported on a line after its step's: the saves of steps 1 and 2 by the lines of
  // steps 3 and 4 at the latest (the next save waits for them), step 3's when it committed
  // before step 4's line; step 4's commits after the last line. Synchronous saves: each on the
  // next line.
  ASSERT_GE(async_steps.size(), 2u);
  EXPECT_EQ(async_steps[0], 1);
  EXPECT_EQ(async_steps[1], 2);
  EXPECT_LE(async_steps.size(), 3u);
  EXPECT_EQ(sync_reports, 3);
  for (int64_t step = 1; step <= 4; ++step) {
    const std::vector<char> a = file_bytes(dir / "async" / checkpoint_file_name(step));
    const std::vector<char> s = file_bytes(dir / "sync" / checkpoint_file_name(step));
    EXPECT_TRUE(a == s) << "step " << step;
  }
  EXPECT_EQ(read_latest((dir / "async").string()),
            (dir / "async" / checkpoint_file_name(4)).string());
}

// Several ranks without MPI (here threads over an in-process transport; on GPUs NCCL groups)
// gather a save's shards over the tensor groups on the training thread: their saves stay
// synchronous, whatever checkpoint_async says, and every rank decides so.
TEST(AsyncCheckpoint, SynchronousOnSeveralRanksWithoutMpi) {
  TrainOptions o = moe_options(OptimizerSharding::kZero1, 2);
  o.checkpoint.dir = test::fresh_temp_dir("async_nonmpi").string();
  o.checkpoint.async = true;
  auto mailbox = std::make_shared<test::Mailbox>();
  CommOptions co;
  co.timeout = std::chrono::seconds(60);
  auto worlds = test::ThreadCommunicator::world(2, mailbox, co);
  std::vector<int> async(2, -1);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        RankContext ctx;
        ctx.groups = make_process_groups(worlds[static_cast<size_t>(r)], 2);
        Trainer t(o, ctx);
        CheckpointSaver saver(o, t.run_state());
        async[static_cast<size_t>(r)] = saver.async() ? 1 : 0;
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        worlds[static_cast<size_t>(r)]->abort(e.what());
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
  EXPECT_EQ(async, (std::vector<int>{0, 0}));
}

// Under MPI: the world of this launch, with the process groups of `ep`.
RankContext mpi_context(int ep) {
  CommOptions options;
  options.timeout = std::chrono::seconds(60);
  const LaunchInfo info = detect_launch();
  RankContext ctx;
  ctx.launch = info;
  // Not kept past the test: every communicator is freed before MPI is finalised.
  if (info.use_mpi)
    ctx.groups = make_process_groups(create_world(info, parse_bootstrap("mpi"), options), ep);
  return ctx;
}

HP_MPI_TEST(AsyncCheckpoint, SameFileAsSynchronousSaveOnRanks, 2, 4) {
  const LaunchInfo info = detect_launch();
  if (!info.use_mpi || info.world < 2) GTEST_SKIP() << "needs a launch of 2 or more ranks";
  for (const OptimizerSharding sharding : {OptimizerSharding::kNone, OptimizerSharding::kZero1}) {
    const RankContext ctx = mpi_context(2);
    const std::string name = str_cat("async_np", ctx.world(), "_",
                                     sharding == OptimizerSharding::kZero1 ? "zero1" : "none");
    const fs::path dir = fs::temp_directory_path() / ("hotpath_" + name);
    if (ctx.rank() == 0) test::fresh_temp_dir(name);
    ctx.groups.world->barrier();
    SCOPED_TRACE(name);
    expect_same_file(moe_options(sharding, 2), ctx, dir);
    ctx.groups.world->barrier();
  }
}

}  // namespace
}  // namespace hp
