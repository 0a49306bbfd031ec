// A checkpoint is only called sound when it is: `inspect` fails on non-finite values and on
// datasets missing from the list the saving run recorded, and `eval` fails on a non-finite loss.
// The damaged files are copies of a real checkpoint, rewritten dataset by dataset.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "framework/checkpoint/checkpoint.h"
#include "framework/core/error.h"
#include "launch/options.h"
#include "launch/tools/tools.h"
#include "launch/train/run_checkpoint.h"
#include "launch/train/trainer.h"
#include "tests/common/launch_fixtures.h"

namespace fs = std::filesystem;

namespace hp {
namespace {

TrainOptions tiny_run() {
  TrainOptions o = test::small_dense_options();
  o.run.steps = 2;
  o.run.log_every = 100;
  o.eval.batches = 1;
  return o;
}

fs::path fresh_dir(const std::string& name) { return test::fresh_temp_dir("trust_" + name); }

// A checkpoint of one step of tiny_run() in `dir`; its path.
std::string saved_checkpoint(const fs::path& dir) {
  TrainOptions o = tiny_run();
  Trainer t(o, single_rank_context());
  t.step();
  return save_checkpoint(t.run_state(), (dir / "ckpt").string(), 0).path;
}

// Copies checkpoint `src` to `dst` dataset by dataset: `drop` leaves one out, `poison` makes the
// first element of one f32 dataset NaN. The root attributes are copied.
void rewrite(const std::string& src, const std::string& dst, const std::string& drop,
             const std::string& poison, bool keep_list = true) {
  CheckpointReader r(src);
  CheckpointWriter w(dst, nullptr);
  for (const DatasetInfo& d : r.datasets()) {
    if (d.name == drop) continue;
    std::vector<char> bytes(static_cast<size_t>(d.bytes()));
    r.read_rows(d.name, RowRange{0, d.shape[0]}, d.dtype, bytes.data());
    if (d.name == poison) reinterpret_cast<float*>(bytes.data())[0] = std::nanf("");
    w.write_rows(d.name, d.shape, d.dtype, d.chunk_rows, RowRange{0, d.shape[0]}, bytes.data());
  }
  for (const char* a : {"format", "hotpath_version", "hdf5_version", "config", "command_line",
                        "master_dtype", "model_config"})
    w.set_attr(a, r.string_attr(a));
  if (keep_list) w.set_attr("datasets", r.string_attr("datasets"));
  for (const char* a : {"format_version", "step", "world", "dp", "ep", "skipped_steps"})
    w.set_attr(a, r.int_attr(a));
  w.close();
}

int inspect(const std::string& path, std::string* out) {
  testing::internal::CaptureStdout();
  const int rc = inspect_main({path});
  *out = testing::internal::GetCapturedStdout();
  return rc;
}

TEST(CheckpointTrust, InspectPassesASoundCheckpoint) {
  const fs::path dir = fresh_dir("sound");
  const std::string path = saved_checkpoint(dir);
  std::string out;
  EXPECT_EQ(inspect(path, &out), 0) << out;
  EXPECT_NE(out.find("checksums: ok"), std::string::npos) << out;
  EXPECT_EQ(out.find("completeness: FAILED"), std::string::npos) << out;
}

TEST(CheckpointTrust, InspectFailsOnNonFiniteValues) {
  const fs::path dir = fresh_dir("nan");
  const std::string good = saved_checkpoint(dir);
  for (const char* name : {"/params/final_norm", "/optim/final_norm/m", "/optim/final_norm/v"}) {
    const std::string bad = (dir / "bad.h5").string();
    rewrite(good, bad, "", name);
    std::string out;
    EXPECT_EQ(inspect(bad, &out), 1) << out;
    EXPECT_NE(out.find(std::string(name) + " f32"), std::string::npos) << out;
    EXPECT_NE(out.find("NON-FINITE: 1 values"), std::string::npos) << out;
    EXPECT_EQ(out.find("checksums: ok"), std::string::npos) << out;
  }
}

TEST(CheckpointTrust, InspectFailsOnMissingDatasets) {
  const fs::path dir = fresh_dir("missing");
  const std::string good = saved_checkpoint(dir);
  for (const char* name : {"/params/tok_embeddings", "/optim/final_norm/v", "/state/loader"}) {
    const std::string bad = (dir / "bad.h5").string();
    rewrite(good, bad, name, "");
    std::string out;
    EXPECT_EQ(inspect(bad, &out), 1) << out;
    EXPECT_NE(out.find(std::string(name) + " MISSING"), std::string::npos) << out;
    EXPECT_NE(out.find("completeness: FAILED (1 datasets missing)"), std::string::npos) << out;
    EXPECT_EQ(out.find("checksums: ok"), std::string::npos) << out;
  }
}

// Without the list of datasets, the parameter count of the saved model config still tells.
TEST(CheckpointTrust, InspectChecksCompletenessAgainstTheSavedConfig) {
  const fs::path dir = fresh_dir("config_count");
  const std::string good = saved_checkpoint(dir);
  std::string out;
  EXPECT_EQ(inspect(good, &out), 0) << out;
  EXPECT_NE(out.find("completeness: ok"), std::string::npos) << out;
  for (const char* name :
       {"/params/final_norm", "/optim/layers.1.attn.wqkv/m", "/optim/tok_embeddings/v"}) {
    const std::string bad = (dir / "bad.h5").string();
    rewrite(good, bad, name, "", false);
    EXPECT_EQ(inspect(bad, &out), 1) << out;
    EXPECT_NE(out.find("completeness: FAILED: the saved model config has"), std::string::npos)
        << out;
    EXPECT_EQ(out.find("checksums: ok"), std::string::npos) << out;
  }
}

TEST(CheckpointTrust, EvalFailsOnANonFiniteLoss) {
  const fs::path dir = fresh_dir("eval");
  const std::string good = saved_checkpoint(dir);
  const std::string bad = (dir / "bad.h5").string();
  rewrite(good, bad, "", "/params/final_norm");
  TrainOptions o = tiny_run();
  o.eval.checkpoint = good;
  EXPECT_EQ(run_eval(o, single_rank_context()), 0);
  o.eval.checkpoint = bad;
  try {
    run_eval(o, single_rank_context());
    ADD_FAILURE() << "eval of a NaN checkpoint succeeded";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("is not finite"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace hp
