// The offload config keys: parsing, validation messages that name the key, and what reaches
// ModelOptions (offload != none implies checkpoint_activations).
#include <gtest/gtest.h>

#include "launch/options.h"
#include "launch/train/trainer.h"
#include "tests/common/launch_fixtures.h"

namespace hp {
namespace {

// Valid apart from what a test changes.
TrainOptions valid_options() { return test::small_dense_options(); }

TEST(OffloadOptions, ParsedFromTheCommandLine) {
  TrainOptions o;
  ASSERT_TRUE(parse_train_options(
      {"--offload=double", "--offload_buffers=3", "--offload_lookahead=2", "--sim_link_gbps=4.5",
       "--pinned_pool_mib=64", "--vocab_size=16", "--d_model=32", "--n_layers=2", "--n_heads=2",
       "--n_kv_heads=1", "--head_dim=16", "--ffn_dim=64"},
      "train", o));
  EXPECT_EQ(o.compute.offload.mode, OffloadMode::kDouble);
  EXPECT_EQ(test::validation_message(o), "");
  const ModelOptions m = make_model_options(o);
  EXPECT_TRUE(m.checkpoint_activations);
  EXPECT_EQ(m.offload.mode, OffloadMode::kDouble);
  EXPECT_EQ(m.offload.buffers, 3);
  EXPECT_EQ(m.offload.lookahead, 2);
  EXPECT_DOUBLE_EQ(m.offload.sim_link_gbps, 4.5);
  EXPECT_EQ(m.offload.pinned_pool_bytes, int64_t{64} << 20);
}

TEST(OffloadOptions, DefaultsKeepTodaysBehaviour) {
  TrainOptions o;
  const ModelOptions m = make_model_options(o);
  EXPECT_FALSE(m.checkpoint_activations);
  EXPECT_EQ(m.offload.mode, OffloadMode::kNone);
  EXPECT_EQ(m.offload.buffers, 2);
  EXPECT_EQ(m.offload.lookahead, 1);
}

TEST(OffloadOptions, ValidationNamesTheKey) {
  TrainOptions o = valid_options();
  EXPECT_EQ(test::validation_message(o), "");
  o.compute.offload.buffers = 1;
  EXPECT_NE(test::validation_message(o).find("'offload_buffers'"), std::string::npos);
  o = valid_options();
  o.compute.offload.lookahead = 2;  // needs offload_buffers >= 3
  EXPECT_NE(test::validation_message(o).find("'offload_lookahead'"), std::string::npos);
  o = valid_options();
  o.compute.offload.sim_link_gbps = -1;
  EXPECT_NE(test::validation_message(o).find("'sim_link_gbps'"), std::string::npos);
  // pinned_pool_mib is read in MiB and checked as it becomes bytes.
  try {
    TrainOptions p;
    parse_train_options({"--pinned_pool_mib=-1"}, "train", p);
    ADD_FAILURE() << "pinned_pool_mib=-1 accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("config key 'pinned_pool_mib'"), std::string::npos)
        << e.what();
  }
}

TEST(OffloadOptions, AnUnknownModeIsRejectedNamingTheKeyAndTheChoices) {
  TrainOptions o;
  try {
    parse_train_options({"--offload=triple"}, "train", o);
    ADD_FAILURE() << "offload=triple was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "config key 'offload': must be none, single or double, got 'triple'"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace hp
