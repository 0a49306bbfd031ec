// `bench step`'s breakdown on the CPU backend: every field is there and the parts add up to the
// whole (phases and op families each sum to the busy time; busy + idle is the wall time), and
// the memory of every rank.
#include "launch/bench/bench_step.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <numeric>

#include "launch/options.h"

namespace hp {
namespace {

TrainOptions tiny_moe() {
  TrainOptions o;
  EXPECT_TRUE(parse_train_options({"--config=" HP_SOURCE_DIR "/examples/configs/tiny-moe.ini",
                                   "--device=cpu", "--bench_steps=2", "--bench_warmup=0",
                                   "--batch_tokens=1024", "--synthetic_doc_len=uniform:8:40"},
                                  "bench step", o));
  return o;
}

template <typename A>
double sum(const A& a) {
  return std::accumulate(a.begin(), a.end(), 0.0);
}

// One measurement serves both tests.
const BenchStepResult& measured() {
  static const BenchStepResult r = measure_bench_step(tiny_moe(), single_rank_context());
  return r;
}

TEST(BenchStep, BreakdownSumsToTheStep) {
  const BenchStepResult& r = measured();
  const StepProfile& p = r.profile;
  EXPECT_EQ(r.profiled_steps, 2);
  EXPECT_GT(r.ms, 0);
  EXPECT_GT(r.tokens_per_s, 0);
  ASSERT_GT(p.wall_ms, 0);
  EXPECT_NEAR(p.busy_ms + p.idle_ms, p.wall_ms, 1e-9 * p.wall_ms);
  EXPECT_NEAR(sum(p.by_phase), p.busy_ms, 1e-9 * p.wall_ms);
  EXPECT_NEAR(sum(p.by_family), p.busy_ms, 1e-9 * p.wall_ms);
  // The model and the trainer mark their work: forward, backward and the optimizer all show up,
  // and so do the families every step has.
  EXPECT_GT(p.by_phase[static_cast<int>(StepPhase::kForward)], 0);
  EXPECT_GT(p.by_phase[static_cast<int>(StepPhase::kBackward)], 0);
  EXPECT_GT(p.by_phase[static_cast<int>(StepPhase::kOptimizer)], 0);
  for (OpFamily f : {OpFamily::kAttention, OpFamily::kDenseGemm, OpFamily::kExpertGemm,
                     OpFamily::kRouting, OpFamily::kCrossEntropy, OpFamily::kOptimizer})
    EXPECT_GT(p.by_family[static_cast<int>(f)], 0) << op_family_name(f);
}

TEST(BenchStep, JsonCarriesTheBreakdown) {
  const BenchStepResult& r = measured();
  const auto j = nlohmann::json::parse(bench_step_json(r));
  for (const char* k :
       {"ms_per_step", "tokens_per_s", "syncs_per_step", "mfu", "gpu_busy_fraction", "attention",
        "data", "gemm_tuned_buckets", "gemm_warmed_algos", "attention_tuned_graphs"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_EQ(j.at("gemm_tuned_buckets").get<int64_t>(), 0) << "the CPU reference tunes nothing";
  EXPECT_EQ(j.at("gemm_warmed_algos").get<int64_t>(), 0) << "nor warms anything";
  EXPECT_EQ(j.at("attention_tuned_graphs").get<int64_t>(), 0);
  EXPECT_EQ(j.at("reduction_stream").get<std::string>(), "none") << "one rank reduces nothing";
  const auto& prof = j.at("profile");
  double phases = 0, families = 0;
  for (int k = 0; k < kNumStepPhases; ++k)
    phases += prof.at("by_phase_ms").at(step_phase_name(static_cast<StepPhase>(k))).get<double>();
  for (int k = 0; k < kNumOpFamilies; ++k)
    families += prof.at("by_family_ms").at(op_family_name(static_cast<OpFamily>(k))).get<double>();
  const double busy = prof.at("busy_ms").get<double>(), wall = prof.at("wall_ms").get<double>();
  EXPECT_NEAR(phases, busy, 1e-6 * wall);
  EXPECT_NEAR(families, busy, 1e-6 * wall);
  EXPECT_NEAR(busy + prof.at("idle_ms").get<double>(), wall, 1e-6 * wall);
  EXPECT_NE(bench_step_table(r).find("busy"), std::string::npos);
  // Where the device waited, by the work around each gap: a list (empty on the host backend,
  // which never waits).
  ASSERT_TRUE(prof.at("idle_gaps").is_array());
  EXPECT_EQ(prof.at("idle_gaps").size(), r.profile.idle_gaps.size());
}

// One rank: one memory figure, the process's peak resident set on the host backend, also printed
// in the table.
TEST(BenchStep, JsonCarriesMemoryPerRank) {
  const BenchStepResult& r = measured();
  const auto j = nlohmann::json::parse(bench_step_json(r));
  const auto& mem = j.at("memory");
  EXPECT_EQ(mem.at("kind").get<std::string>(), "host_peak_rss");
  ASSERT_EQ(mem.at("per_rank_bytes").size(), 1u);
  const int64_t bytes = mem.at("per_rank_bytes")[0].get<int64_t>();
  EXPECT_EQ(mem.at("max_bytes").get<int64_t>(), bytes);
  EXPECT_GT(bytes, 0);
  EXPECT_NE(bench_step_table(r).find("memory per rank"), std::string::npos);
}

}  // namespace
}  // namespace hp
