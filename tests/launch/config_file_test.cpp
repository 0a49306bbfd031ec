// The config file is read literally: a value is everything after the first '=' (blanks trimmed),
// '#' and ';' start a comment only as the first non-blank character of a line, a UTF-8 byte
// order mark and CR LF line ends are accepted; anything else that is not `key = value` is an
// error naming the file and the line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "framework/core/error.h"
#include "launch/options.h"

namespace hp {
namespace {

const char* kModel =
    "vocab_size = 16\nd_model = 32\nn_layers = 2\nn_heads = 2\nn_kv_heads = 1\nhead_dim = 16\n"
    "ffn_dim = 64\n";

std::string write_config(const std::string& text) {
  const std::string path = testing::TempDir() + "hp_config_" + std::to_string(::getpid()) + "_" +
                           testing::UnitTest::GetInstance()->current_test_info()->name() + ".ini";
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

TrainOptions parse(const std::string& text, std::vector<std::string> extra = {}) {
  std::vector<std::string> args{"--config", write_config(text)};
  args.insert(args.end(), extra.begin(), extra.end());
  TrainOptions o;
  EXPECT_TRUE(parse_train_options(args, "train", o));
  return o;
}

std::string error_of(const std::string& text) {
  try {
    parse(text);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(ConfigFile, HashAndSemicolonInsideValuesAreLiteral) {
  const TrainOptions o = parse(std::string(kModel) +
                               "checkpoint_dir = runs/exp#2\n"
                               "metrics_path = runs/a;b # not a comment.jsonl\n"
                               "pcie_groups = 0,1;2,3\n"
                               "data = shards/part#1;x.bin\n");
  EXPECT_EQ(o.checkpoint.dir, "runs/exp#2");
  EXPECT_EQ(o.run.metrics_path, "runs/a;b # not a comment.jsonl");
  EXPECT_EQ(o.link.pcie_groups, "0,1;2,3");
  EXPECT_EQ(o.data.source, "shards/part#1;x.bin");
}

TEST(ConfigFile, CommentsOnlyAtLineStart) {
  const TrainOptions o = parse(std::string("# a comment\n; another\n   # indented\n\t; tab\n\n") +
                               kModel + "steps = 7\n");
  EXPECT_EQ(o.run.steps, 7);
}

TEST(ConfigFile, BlanksAroundKeyAndValueAreTrimmed) {
  const TrainOptions o = parse(std::string(kModel) + "   steps\t=\t  9   \n");
  EXPECT_EQ(o.run.steps, 9);
}

TEST(ConfigFile, Utf8BomAndCrLf) {
  std::string text = std::string("\xEF\xBB\xBF") + kModel + "steps = 5\n";
  std::string crlf;
  for (char c : text) crlf += c == '\n' ? std::string("\r\n") : std::string(1, c);
  const TrainOptions o = parse(crlf);
  EXPECT_EQ(o.model.vocab_size, 16);
  EXPECT_EQ(o.run.steps, 5);
}

TEST(ConfigFile, CommandLineWins) {
  const TrainOptions o = parse(std::string(kModel) + "steps = 5\n", {"--steps=8"});
  EXPECT_EQ(o.run.steps, 8);
}

TEST(ConfigFile, MistakesNameTheLine) {
  EXPECT_NE(error_of(std::string(kModel) + "steps = 5\nsteps = 6\n")
                .find("line 9: key 'steps' is given twice"),
            std::string::npos);
  EXPECT_NE(error_of(std::string(kModel) + "bogus = 1\n").find("line 8: unknown key 'bogus'"),
            std::string::npos);
  EXPECT_NE(error_of(std::string(kModel) + "steps 5\n").find("line 8: expected key = value"),
            std::string::npos);
  EXPECT_NE(error_of(std::string("[run]\n") + kModel).find("line 1: sections"), std::string::npos);
  EXPECT_NE(error_of(std::string(kModel) + " = 5\n").find("line 8: no key before '='"),
            std::string::npos);
  EXPECT_NE(error_of(std::string(kModel) + "steps = five\n").find("steps"), std::string::npos);
}

}  // namespace
}  // namespace hp
