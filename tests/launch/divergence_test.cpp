// A diverged run fails safely: it stops with an error naming the step, applies no update of a
// non-finite step, commits no checkpoint with non-finite values, and its metrics file stays
// valid JSON Lines.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "framework/core/error.h"
#include "launch/options.h"
#include "launch/train/trainer.h"
#include "tests/common/launch_fixtures.h"

namespace fs = std::filesystem;

namespace hp {
namespace {

TrainOptions tiny_run() {
  TrainOptions o = test::small_dense_options();
  o.run.steps = 4;
  o.optimizer.warmup_steps = 0;
  o.run.log_every = 100;
  return o;
}

fs::path fresh_dir(const std::string& name) { return test::fresh_temp_dir("divergence_" + name); }

std::vector<std::string> lines_of(const fs::path& p) {
  std::ifstream f(p);
  std::vector<std::string> lines;
  for (std::string l; std::getline(f, l);) lines.push_back(l);
  return lines;
}

// lr itself must be finite; a huge one makes the first update overflow the weights.
constexpr double kHugeLr = 1e30;

TEST(Divergence, InfiniteLrIsRefusedNamingTheKey) {
  TrainOptions o = tiny_run();
  o.optimizer.lr = std::numeric_limits<double>::infinity();
  // The one check of the options, which main makes before any work.
  try {
    validate_train_options(o, 1);
    ADD_FAILURE() << "lr=inf accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("'lr': must be finite"), std::string::npos) << e.what();
  }
}

TEST(Divergence, HugeLrStopsTheRunWithoutANonFiniteCheckpoint) {
  const fs::path dir = fresh_dir("run");
  TrainOptions o = tiny_run();
  o.optimizer.lr = kHugeLr;
  o.checkpoint.every = 1;
  o.checkpoint.dir = (dir / "ckpt").string();
  o.run.metrics_path = (dir / "metrics.jsonl").string();
  const RankContext ctx = single_rank_context();
  std::string message;
  try {
    run_train(o, ctx);
  } catch (const UserError& e) {
    message = e.what();
  }
  // Step 1 is finite but its update (lr=1e30) is not: its save is refused before any file
  // exists. (A run without checkpoints stops at step 2, whose loss is not finite.)
  EXPECT_NE(message.find("non-finite"), std::string::npos) << message;
  EXPECT_NE(message.find("step 1"), std::string::npos) << message;
  int files = 0;
  if (fs::exists(o.checkpoint.dir))
    for (const auto& e : fs::directory_iterator(o.checkpoint.dir)) {
      ADD_FAILURE() << "unexpected file " << e.path();
      ++files;
    }
  EXPECT_EQ(files, 0);
  const std::vector<std::string> lines = lines_of(o.run.metrics_path);
  ASSERT_EQ(lines.size(), 1u);
  for (const std::string& l : lines) {
    const nlohmann::json j = nlohmann::json::parse(l);  // throws on invalid JSON
    EXPECT_EQ(j["step"], 1);
    EXPECT_TRUE(j["lr"].is_number());
    EXPECT_TRUE(j["loss"].is_number());
  }
}

TEST(Divergence, NonFiniteLossFailsAtThatStepAndEveryMetricsLineParses) {
  const fs::path dir = fresh_dir("loss");
  TrainOptions o = tiny_run();
  o.optimizer.lr = kHugeLr;
  o.run.metrics_path = (dir / "metrics.jsonl").string();
  const RankContext ctx = single_rank_context();
  std::string message;
  try {
    run_train(o, ctx);
  } catch (const UserError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("training diverged at step 2"), std::string::npos) << message;
  const std::vector<std::string> lines = lines_of(o.run.metrics_path);
  ASSERT_EQ(lines.size(), 2u);
  const nlohmann::json first = nlohmann::json::parse(lines[0]);
  const nlohmann::json second = nlohmann::json::parse(lines[1]);
  EXPECT_FALSE(first.contains("finite"));
  EXPECT_EQ(second["step"], 2);
  EXPECT_EQ(second["finite"], false);
  EXPECT_TRUE(second["loss"].is_null());
  EXPECT_TRUE(second["grad_norm"].is_null());
  EXPECT_EQ(second["syncs"]["loss"], 1);
}

TEST(Divergence, ANonFiniteStepChangesNothing) {
  TrainOptions o = tiny_run();
  o.optimizer.lr = kHugeLr;
  const RankContext ctx = single_rank_context();
  Trainer t(o, ctx);
  EXPECT_TRUE(t.step().finite);  // finite loss and gradients; the update makes the weights inf
  EXPECT_EQ(t.steps_done(), 1);
  const std::vector<std::vector<char>> before = test::state_bytes(t.model(), false);
  const StepStats s = t.step();
  EXPECT_FALSE(s.finite);
  EXPECT_FALSE(std::isfinite(s.loss));
  EXPECT_EQ(t.steps_done(), 1);  // not counted
  EXPECT_EQ(test::state_bytes(t.model(), false), before);
  EXPECT_EQ(s.syncs.get(SyncCause::kLoss), 1);  // the finite check adds no host sync
}

// nonfinite=skip: the step counts as done and as skipped; masters, m and v stay bitwise as they
// were, and the run goes on.
TEST(Divergence, SkipLeavesParametersAndMomentsBitwiseUnchanged) {
  TrainOptions o = tiny_run();
  o.optimizer.lr = kHugeLr;
  o.run.nonfinite = NonfinitePolicy::kSkip;
  Trainer t(o, single_rank_context());
  EXPECT_TRUE(t.step().finite);
  const std::vector<std::vector<char>> before = test::state_bytes(t.model());
  for (int64_t k = 2; k <= 3; ++k) {
    const StepStats s = t.step();
    EXPECT_FALSE(s.finite);
    EXPECT_TRUE(s.skipped);
    EXPECT_EQ(s.step, k);
    EXPECT_EQ(s.skipped_steps, k - 1);
    EXPECT_EQ(t.steps_done(), k);  // counted as done: the run moves on
    EXPECT_EQ(t.skipped_steps(), k - 1);
    EXPECT_EQ(test::state_bytes(t.model()), before);
  }
}

TEST(Divergence, ASaveOfNonFiniteWeightsWritesNothing) {
  const fs::path dir = fresh_dir("save");
  TrainOptions o = tiny_run();
  const RankContext ctx = single_rank_context();
  Trainer t(o, ctx);
  t.step();
  Param& p = *t.model().params().all().front();
  p.master.data<float>()[0] = std::numeric_limits<float>::quiet_NaN();
  try {
    save_checkpoint(t.run_state(), (dir / "ckpt").string(), 0);
    ADD_FAILURE() << "save_checkpoint accepted a NaN";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("/params/" + p.name), std::string::npos) << e.what();
  }
  EXPECT_TRUE(!fs::exists(dir / "ckpt") || fs::is_empty(dir / "ckpt"));
}

TEST(Divergence, AFiniteRunSavesAndCountsItsSteps) {
  const fs::path dir = fresh_dir("finite");
  TrainOptions o = tiny_run();
  o.run.steps = 2;
  o.checkpoint.every = 1;
  o.checkpoint.dir = (dir / "ckpt").string();
  o.run.metrics_path = (dir / "metrics.jsonl").string();
  EXPECT_EQ(run_train(o, single_rank_context()), 0);
  int committed = 0;
  for (const auto& e : fs::directory_iterator(dir / "ckpt")) {
    const std::string name = e.path().filename().string();
    committed += name.rfind("step_", 0) == 0 && e.path().extension() == ".h5";
  }
  EXPECT_EQ(committed, 2);
  const std::vector<std::string> lines = lines_of(o.run.metrics_path);
  ASSERT_EQ(lines.size(), 2u);
  for (size_t i = 0; i < lines.size(); ++i) {
    const nlohmann::json j = nlohmann::json::parse(lines[i]);
    EXPECT_EQ(j["step"], static_cast<int>(i + 1));
    EXPECT_TRUE(j["loss"].is_number());
    EXPECT_FALSE(j.contains("aux_loss"));  // dense model
  }
}

}  // namespace
}  // namespace hp
