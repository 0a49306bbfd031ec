// The held-out evaluation (launch/train/evaluation.h): deterministic, free of training state
// (the training losses, parameters and data position are bitwise those of a run without it),
// one read per evaluation, the number `hotpath eval` gives for the checkpoint of the same step,
// and its keys refused when wrong.
#include "launch/train/evaluation.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "framework/core/error.h"
#include "framework/data/token_files.h"
#include "launch/tools/tools.h"
#include "launch/train/components.h"
#include "launch/train/run_checkpoint.h"
#include "launch/train/trainer.h"
#include "tests/common/launch_fixtures.h"

namespace fs = std::filesystem;

namespace hp {
namespace {

TrainOptions tiny_run() {
  TrainOptions o = test::small_dense_options();
  o.run.steps = 4;
  o.run.log_every = 100;
  o.optimizer.warmup_steps = 0;
  o.optimizer.lr = 1e-2;
  return o;
}

// A held-out file of synthetic documents of another seed than the training data.
std::string held_out_file(const fs::path& dir, const TrainOptions& o) {
  DataConfig d = make_data_config(o, 0, 1);
  d.source = "synthetic";
  d.seed = 99;
  const std::string path = (dir / "held_out.h5").string();
  write_h5_tokens(path, synthetic_documents(d, 60));
  return path;
}

// Training with an evaluation after every step computes bitwise what training without one
// does: losses, gradient norms, parameters and moments, the training data position. Two
// evaluations of the same parameters agree bitwise, and each makes one read (cause loss).
TEST(HeldOutEval, ChangesNothingOfTraining) {
  const fs::path dir = test::fresh_temp_dir("eval_nothing");
  const TrainOptions o = tiny_run();
  const std::string file = held_out_file(dir, o);
  Trainer with(o, single_rank_context());
  Trainer without(o, single_rank_context());
  HeldOutData data(o, file, "eval_data", 0, 1);
  double previous = std::nan("");
  for (int step = 1; step <= 4; ++step) {
    const StepStats a = with.step();
    with.backend().syncs().reset();
    const EvalStats e = evaluate_held_out(with, data, 2);
    EXPECT_EQ(with.backend().syncs().get(SyncCause::kLoss), 1);
    EXPECT_EQ(with.backend().syncs().total(), 1);
    const EvalStats again = evaluate_held_out(with, data, 2);
    EXPECT_EQ(again.loss, e.loss) << "the same batches every time";
    EXPECT_TRUE(std::isfinite(e.loss));
    EXPECT_NE(e.loss, previous) << "the parameters moved";
    previous = e.loss;
    // 2 global batches of 4 rows of 16 tokens, stream packing: every position a document
    // token; an EOT's position predicts nothing.
    EXPECT_EQ(e.tokens, 2 * 64);
    EXPECT_GT(e.targets, 2 * 64 - 2 * 64 / 4);
    EXPECT_LT(e.targets, 2 * 64);
    const StepStats b = without.step();
    EXPECT_EQ(a.loss, b.loss) << "step " << step;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << step;
  }
  EXPECT_EQ(test::state_bytes(with.model()), test::state_bytes(without.model()));
  EXPECT_EQ(with.loader().state(), without.loader().state());
}

// The evaluation after step 2 equals `hotpath eval` on the checkpoint saved at step 2, with the
// same data and batch count: bitwise (same parameters, batches and sums).
TEST(HeldOutEval, EqualsHotpathEvalOfTheCheckpoint) {
  const fs::path dir = test::fresh_temp_dir("eval_equals_tool");
  TrainOptions o = tiny_run();
  const std::string file = held_out_file(dir, o);
  Trainer t(o, single_rank_context());
  HeldOutData data(o, file, "eval_data", 0, 1);
  t.step();
  t.step();
  const EvalStats e = evaluate_held_out(t, data, 3);
  const std::string ckpt = save_checkpoint(t.run_state(), (dir / "ckpt").string(), 0).path;
  t.step();  // the run goes on; the checkpoint holds step 2

  TrainOptions tool = tiny_run();
  tool.data.source = file;
  tool.eval.checkpoint = ckpt;
  tool.eval.batches = 3;
  tool.eval.json = (dir / "eval.json").string();
  testing::internal::CaptureStdout();
  const int rc = run_eval(tool, single_rank_context());
  const std::string out = testing::internal::GetCapturedStdout();
  ASSERT_EQ(rc, 0) << out;
  std::ifstream in(tool.eval.json);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["step"], 2);
  EXPECT_EQ(j["eval_loss"].get<double>(), e.loss);
  EXPECT_EQ(j["eval_tokens"], e.tokens);
  EXPECT_EQ(j["eval_targets"], e.targets);
  EXPECT_NE(out.find("eval_loss="), std::string::npos) << out;
}

// whole packing pads rows: document tokens and targets count the documents only, and the
// evaluation is as repeatable as in stream packing.
TEST(HeldOutEval, WholePackingCountsDocumentTokens) {
  const fs::path dir = test::fresh_temp_dir("eval_whole");
  TrainOptions o = tiny_run();
  o.data.packing = Packing::kWhole;
  o.data.packing_window = 8;
  const std::string file = held_out_file(dir, o);
  Trainer t(o, single_rank_context());
  HeldOutData data(o, file, "eval_data", 0, 1);
  const EvalStats e = evaluate_held_out(t, data, 2);
  EXPECT_GT(e.tokens, 0);
  EXPECT_LE(e.tokens, 2 * 64);
  EXPECT_LE(e.targets, e.tokens);
  EXPECT_GT(e.targets, 0);
  EXPECT_EQ(evaluate_held_out(t, data, 2).loss, e.loss);
}

TEST(HeldOutEval, BadKeysAreRefusedNamingThem) {
  const fs::path dir = test::fresh_temp_dir("eval_keys");
  TrainOptions o = tiny_run();
  const std::string file = held_out_file(dir, o);
  EXPECT_EQ(test::validation_message(o), "") << "no eval_data: no evaluation";
  o.held_out.every = -1;
  EXPECT_NE(test::validation_message(o).find("'eval_every': must be >= 0"), std::string::npos)
      << test::validation_message(o);
  o.held_out.every = 5;
  EXPECT_NE(test::validation_message(o).find("'eval_every': =5 needs eval_data"), std::string::npos)
      << test::validation_message(o);
  o.held_out.data = file;
  EXPECT_EQ(test::validation_message(o), "");
  o.held_out.batches = 0;
  EXPECT_NE(test::validation_message(o).find("'eval_batches': must be >= 1, got 0"),
            std::string::npos)
      << test::validation_message(o);
  o.held_out.batches = 1;
  o.held_out.every = 0;
  EXPECT_EQ(test::validation_message(o), "") << "eval_every=0: the final evaluation only";
}

TEST(HeldOutEval, MissingFileIsRefusedNamingTheKey) {
  const fs::path dir = test::fresh_temp_dir("eval_missing");
  const TrainOptions o = tiny_run();
  const std::string missing = (dir / "no-such.h5").string();
  try {
    HeldOutData data(o, missing, "eval_data", 0, 1);
    FAIL() << "opened a missing file";
  } catch (const UserError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("config key 'eval_data'"), std::string::npos) << what;
    EXPECT_NE(what.find("no-such.h5"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace hp
