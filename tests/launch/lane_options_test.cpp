// The lane arbiter config keys (lane_arbiter, lane_chunk_mib, lane_inflight, pcie_groups):
// defaults, parsing into LaneOptions, and validation messages that name the key.
#include <gtest/gtest.h>

#include "launch/options.h"
#include "tests/common/launch_fixtures.h"

namespace hp {
namespace {

TrainOptions small_model() { return test::small_dense_options(); }

std::string validation_message(const TrainOptions& o) {
  try {
    validate_train_options(o, 1);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(LaneOptions, DefaultsAreTheBaseline) {
  const LaneOptions l = make_lane_options(TrainOptions());
  EXPECT_FALSE(l.enabled);
  EXPECT_EQ(l.chunk_mib, 8);
  EXPECT_EQ(l.inflight, 1);
  EXPECT_EQ(l.pcie_groups, "auto");
}

TEST(LaneOptions, ParsedFromTheCommandLine) {
  TrainOptions o;
  ASSERT_TRUE(parse_train_options(
      {"--lane_arbiter=on", "--lane_chunk_mib=4", "--lane_inflight=2", "--pcie_groups=0,1;2,3",
       "--collective_timeout_s=12", "--vocab_size=16", "--d_model=32", "--n_layers=2",
       "--n_heads=2", "--n_kv_heads=1", "--head_dim=16", "--ffn_dim=64"},
      "train", o));
  EXPECT_EQ(validation_message(o), "");
  const LaneOptions l = make_lane_options(o);
  EXPECT_TRUE(l.enabled);
  EXPECT_EQ(l.chunk_bytes(), int64_t{4} << 20);
  EXPECT_EQ(l.inflight, 2);
  EXPECT_EQ(l.pcie_groups, "0,1;2,3");
  EXPECT_EQ(l.timeout.count(), 12000);
}

TEST(LaneOptions, ValidationNamesTheKey) {
  TrainOptions o = small_model();
  // Enumerated keys are checked as they are parsed.
  std::string parse_error;
  try {
    TrainOptions p;
    parse_train_options({"--lane_arbiter=yes"}, "train", p);
  } catch (const UserError& e) {
    parse_error = e.what();
  }
  EXPECT_NE(parse_error.find("config key 'lane_arbiter': must be on or off, got 'yes'"),
            std::string::npos)
      << parse_error;
  o.offload.lane_chunk_mib = 0;
  EXPECT_NE(validation_message(o).find("'lane_chunk_mib'"), std::string::npos);
  o = small_model();
  o.offload.lane_inflight = 0;
  EXPECT_NE(validation_message(o).find("'lane_inflight'"), std::string::npos);
  o = small_model();
  o.offload.pcie_groups = "0-1";
  EXPECT_NE(validation_message(o).find("'pcie_groups'"), std::string::npos);
}

}  // namespace
}  // namespace hp
