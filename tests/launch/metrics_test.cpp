// The metrics file's JSON objects: the documented keys, and non-finite numbers as null.
#include "launch/train/metrics.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

namespace hp {
namespace {

TEST(StepJson, HasTheDocumentedKeysInOrder) {
  StepStats s;
  s.step = 7;
  s.loss = 1.5;
  s.aux_loss = 0.25;
  s.lr = 1e-3;
  s.grad_norm = 0.5;
  s.tokens = 3072;
  s.positions = 4096;
  s.padding = 0.25;
  s.model_flops = 1.25e12;
  s.syncs.add(SyncCause::kRouting, 4);
  s.syncs.add(SyncCause::kLoss, 1);
  s.optimizer_state_bytes_dense = 1200;
  s.optimizer_state_bytes_expert = 3600;
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(step_json(s, true));
  std::vector<std::string> keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
  EXPECT_EQ(keys,
            (std::vector<std::string>{"step", "loss", "aux_loss", "lr", "grad_norm", "tokens_per_s",
                                      "ms", "tokens", "positions", "padding", "flops",
                                      "syncs", "optimizer_state_bytes"}));
  EXPECT_EQ(j["step"], 7);
  EXPECT_DOUBLE_EQ(j["loss"].get<double>(), 1.5);
  EXPECT_EQ(j["tokens"], 3072);
  EXPECT_EQ(j["positions"], 4096);
  EXPECT_DOUBLE_EQ(j["padding"].get<double>(), 0.25);
  EXPECT_EQ(j["flops"].get<double>(), 1.25e12);
  EXPECT_FALSE(j.contains("eval_loss")) << "not an evaluated step";
  EXPECT_EQ(step_log_line(s, true).find("eval_loss="), std::string::npos);
  EXPECT_NE(step_log_line(s, true).find(" pad=25% "), std::string::npos) << step_log_line(s, true);
  EXPECT_EQ(j["syncs"]["routing"], 4);
  EXPECT_EQ(j["syncs"]["loss"], 1);
  EXPECT_EQ(j["syncs"].size(), 5u);
  EXPECT_EQ(j["optimizer_state_bytes"]["dense"], 1200);
  EXPECT_EQ(j["optimizer_state_bytes"]["expert"], 3600);
  EXPECT_FALSE(nlohmann::json::parse(step_json(s, false)).contains("aux_loss"));
  EXPECT_EQ(step_log_line(s, true).find("mfu="), std::string::npos) << "no MFU on the CPU";
}

// A GPU step's MFU follows tokens_per_s, in the JSON and as a percentage in the log line.
TEST(StepJson, MfuOnAGpuStep) {
  StepStats s;
  s.step = 3;
  s.mfu = 0.4567;
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(step_json(s, true));
  std::vector<std::string> keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
  ASSERT_GE(keys.size(), 7u);
  EXPECT_EQ(keys[5], "tokens_per_s");
  EXPECT_EQ(keys[6], "mfu");
  EXPECT_DOUBLE_EQ(j["mfu"].get<double>(), 0.4567);
  EXPECT_NE(step_log_line(s, true).find(" mfu=45.7% "), std::string::npos)
      << step_log_line(s, true);
}

// An evaluated step: eval_loss, eval_tokens and eval_ms after flops, the loss exact (round trip),
// and eval_loss= last on the step line.
TEST(StepJson, HeldOutEvaluation) {
  StepStats s;
  s.step = 4;
  s.loss = 2.5;
  s.model_flops = 3e9;
  s.eval = EvalStats{2.718281828459045, 2048, 2040, 12.5};
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(step_json(s, false));
  std::vector<std::string> keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
  const auto at = std::find(keys.begin(), keys.end(), "flops");
  ASSERT_NE(at, keys.end());
  EXPECT_EQ(std::vector<std::string>(at, at + 4),
            (std::vector<std::string>{"flops", "eval_loss", "eval_tokens", "eval_ms"}));
  EXPECT_EQ(j["eval_loss"].get<double>(), 2.718281828459045);  // bitwise
  EXPECT_EQ(j["eval_tokens"], 2048);
  EXPECT_EQ(j["eval_ms"].get<double>(), 12.5);
  const std::string line = step_log_line(s, false);
  EXPECT_EQ(line.substr(line.size() - std::string(" eval_loss=2.71828").size()),
            " eval_loss=2.71828")
      << line;
  // A held-out set without targets has no loss: null, as every non-finite number.
  s.eval->loss = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(nlohmann::json::parse(step_json(s, false))["eval_loss"].is_null());
}

TEST(StepJson, NonFiniteNumbersAreNull) {
  StepStats s;
  s.loss = std::numeric_limits<double>::quiet_NaN();
  s.grad_norm = std::numeric_limits<double>::infinity();
  s.lr = -std::numeric_limits<double>::infinity();
  s.finite = false;
  const std::string text = step_json(s, true);
  EXPECT_EQ(text.find("nan"), std::string::npos) << text;
  EXPECT_EQ(text.find("inf"), std::string::npos) << text;
  const nlohmann::json j = nlohmann::json::parse(text);
  EXPECT_TRUE(j["loss"].is_null());
  EXPECT_TRUE(j["grad_norm"].is_null());
  EXPECT_TRUE(j["lr"].is_null());
  EXPECT_EQ(j["finite"], false);
}

TEST(StepJson, LinkArbiterStatsOfASharedLink) {
  StepStats s;
  LinkArbiterStats c;
  c.bytes[0] = 3 << 20;
  c.bytes[1] = 1 << 20;
  c.chunks[0] = 3;
  c.chunks[1] = 1;
  c.link_ranks = {0, 1};
  c.link_bytes = {4 << 20, 4 << 20};
  c.link_jain = 1.0;
  s.copies = c;
  const nlohmann::json j = nlohmann::json::parse(step_json(s, false));
  ASSERT_TRUE(j.contains("link"));
  EXPECT_EQ(j["link"]["arbiter"], "node");
  EXPECT_EQ(j["link"]["reload_bytes"], 3 << 20);
  EXPECT_EQ(j["link"]["offload_chunks"], 1);
  EXPECT_EQ(j["link"]["link_ranks"], nlohmann::json({0, 1}));
  EXPECT_EQ(j["link"]["jain"], 1.0);
  s.copies->link_ranks.clear();
  const nlohmann::json local = nlohmann::json::parse(step_json(s, false));
  EXPECT_EQ(local["link"]["arbiter"], "local");
  EXPECT_FALSE(local["link"].contains("jain"));
  EXPECT_NE(step_log_line(s, false).find(" link_mib=r3/o1"), std::string::npos)
      << step_log_line(s, false);
}

}  // namespace
}  // namespace hp
