// The link arbiter config keys (link_arbiter, link_chunk_mib, link_inflight, pcie_groups):
// defaults, parsing into LinkOptions, validation messages that name the key, and the keys' former
// names refused.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "launch/options.h"
#include "tests/common/launch_fixtures.h"

namespace hp {
namespace {

TrainOptions small_model() { return test::small_dense_options(); }

TEST(LinkOptions, DefaultsAreTheBaseline) {
  const LinkOptions l = make_link_options(TrainOptions());
  EXPECT_FALSE(l.enabled);
  EXPECT_EQ(l.chunk_mib, 8);
  EXPECT_EQ(l.inflight, 1);
  EXPECT_EQ(l.pcie_groups, "auto");
}

TEST(LinkOptions, ParsedFromTheCommandLine) {
  TrainOptions o;
  ASSERT_TRUE(parse_train_options(
      {"--link_arbiter=on", "--link_chunk_mib=4", "--link_inflight=2", "--pcie_groups=0,1;2,3",
       "--collective_timeout_s=12", "--vocab_size=16", "--d_model=32", "--n_layers=2",
       "--n_heads=2", "--n_kv_heads=1", "--head_dim=16", "--ffn_dim=64"},
      "train", o));
  EXPECT_EQ(test::validation_message(o), "");
  const LinkOptions l = make_link_options(o);
  EXPECT_TRUE(l.enabled);
  EXPECT_EQ(l.chunk_bytes(), int64_t{4} << 20);
  EXPECT_EQ(l.inflight, 2);
  EXPECT_EQ(l.pcie_groups, "0,1;2,3");
  EXPECT_EQ(l.timeout.count(), 12000);
}

TEST(LinkOptions, ValidationNamesTheKey) {
  TrainOptions o = small_model();
  // Enumerated keys are checked as they are parsed.
  std::string parse_error;
  try {
    TrainOptions p;
    parse_train_options({"--link_arbiter=yes"}, "train", p);
  } catch (const UserError& e) {
    parse_error = e.what();
  }
  EXPECT_NE(parse_error.find("config key 'link_arbiter': must be on or off, got 'yes'"),
            std::string::npos)
      << parse_error;
  o.link.chunk_mib = 0;
  EXPECT_NE(test::validation_message(o).find("'link_chunk_mib'"), std::string::npos);
  o = small_model();
  o.link.inflight = 0;
  EXPECT_NE(test::validation_message(o).find("'link_inflight'"), std::string::npos);
  o = small_model();
  o.link.pcie_groups = "0-1";
  EXPECT_NE(test::validation_message(o).find("'pcie_groups'"), std::string::npos);
  // What fails on every node is refused before the node's size is known.
  for (const char* bad : {"0,0", "1", "0;;1", "0,,1", "0;2"}) {
    o.link.pcie_groups = bad;
    EXPECT_NE(
        test::validation_message(o).find("config key 'pcie_groups': '" + std::string(bad) + "'"),
        std::string::npos)
        << bad << ": " << test::validation_message(o);
  }
  for (const char* good : {"0", "0,1", "1,0;2,3", "auto", ""}) {
    o.link.pcie_groups = good;
    EXPECT_EQ(test::validation_message(o), "") << good;
  }
}

// The keys under their former names are refused, naming the key to write, on the command line and
// in a config file; the run's options are left alone.
TEST(LinkOptions, FormerKeyNamesAreRefusedNamingTheNewOne) {
  const std::string dir = testing::TempDir();
  const std::string ini = dir + "hp_link_former_keys_" + std::to_string(::getpid()) + ".ini";
  const struct {
    const char* before;
    const char* now;
    const char* value;
  } keys[] = {{"lane_arbiter", "link_arbiter", "on"},
              {"lane_chunk_mib", "link_chunk_mib", "4"},
              {"lane_inflight", "link_inflight", "2"}};
  int refused = 0;
  for (const auto& k : keys) {
    SCOPED_TRACE(k.before);
    const auto error_of = [](const std::vector<std::string>& args) -> std::string {
      TrainOptions o;
      try {
        parse_train_options(args, "train", o);
      } catch (const UserError& e) {
        return e.what();
      }
      return "";
    };
    const std::string cli = error_of({str_cat("--", k.before, "=", k.value)});
    EXPECT_NE(cli.find(str_cat("--", k.before, " is renamed to ", k.now)), std::string::npos)
        << cli;
    std::ofstream(ini, std::ios::binary) << "vocab_size = 16\n"
                                         << k.before << " = " << k.value << "\n";
    const std::string file = error_of({"--config", ini});
    EXPECT_NE(file.find(str_cat("line 2: key '", k.before, "' is renamed to ", k.now)),
              std::string::npos)
        << file;
    refused += !cli.empty() && !file.empty();
  }
  EXPECT_EQ(refused, 3);
  std::remove(ini.c_str());
}

// A checkpoint written under the former names records them: its options are read (export-hf
// rebuilds the model from them) with the values under today's names.
TEST(LinkOptions, RecordedFormerKeyNamesReadUnderTheNewOnes) {
  TrainOptions o;
  parse_recorded_options("vocab_size = 16\nlane_arbiter = on\n  lane_inflight=3\n",
                         "--lane_chunk_mib=4 --steps=7", o);
  EXPECT_TRUE(o.link.enabled);
  EXPECT_EQ(o.link.chunk_mib, 4);
  EXPECT_EQ(o.link.inflight, 3);
  EXPECT_EQ(o.run.steps, 7);
  EXPECT_EQ(o.model.vocab_size, 16);
  TrainOptions fresh;
  parse_recorded_options("vocab_size = 16\n", "", fresh);
  EXPECT_FALSE(fresh.link.enabled);
  EXPECT_EQ(fresh.link.inflight, 1);
}

}  // namespace
}  // namespace hp
