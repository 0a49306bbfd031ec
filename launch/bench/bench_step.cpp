#include "launch/bench/bench_step.h"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "framework/core/error.h"
#include "launch/bench/bench_attention.h"
#include "launch/bench/bench_comm.h"
#include "launch/bench/bench_gemm.h"
#include "launch/bench/bench_model.h"
#include "launch/bench/bench_offload.h"
#include "launch/bench/bench_util.h"
#include "launch/json.h"
#include "launch/train/memory_plan.h"
#include "launch/train/trainer.h"
#if HOTPATH_HAVE_CUDA
#include "framework/backend/cuda/cuda_backend.h"
#endif

namespace hp {
namespace {

constexpr size_t kTopKernels = 32;
constexpr size_t kTopIdleGaps = 10;

// This rank's memory figure and what it measures (see BenchStepResult::memory_bytes).
std::pair<std::string, int64_t> rank_memory(Backend& be) {
  if (be.device() != Device::kCPU) return {"device_peak_allocated", be.device_peak_bytes()};
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return {"host_peak_rss", static_cast<int64_t>(u.ru_maxrss) * 1024};  // ru_maxrss is in KiB
}

// Sums over `steps` steps made per step, the largest ms first, at most `keep` of them.
template <typename Entry>
void keep_largest_per_step(std::vector<Entry>& entries, double steps, size_t keep) {
  for (Entry& e : entries) {
    e.ms /= steps;
    e.count = static_cast<int64_t>(std::llround(e.count / steps));
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.ms > b.ms; });
  if (entries.size() > keep) entries.resize(keep);
}

}  // namespace
int run_bench(const std::string& scenario, const TrainOptions& o, const RankContext& ctx) {
  if (scenario == "metadata") return run_bench_metadata(o, ctx);
  if (scenario == "routing") return run_bench_routing(o, ctx);
  if (scenario == "alltoall") return run_bench_alltoall(o, ctx);
  if (scenario == "offload") return run_bench_offload(o, ctx);
  if (scenario == "step") return run_bench_step(o, ctx);
  if (scenario == "attention") return run_bench_attention(o, ctx);
  if (scenario == "gemm") return run_bench_gemm(o, ctx);
  HP_USER_ERROR(ErrorKind::kUser, "hotpath bench: unknown scenario '", scenario,
                "'; available: step, metadata, routing, alltoall, offload, attention, gemm");
}

BenchStepResult measure_bench_step(const TrainOptions& o, const RankContext& ctx) {
  Trainer trainer(o, ctx);
  Backend& be = trainer.backend();
  BenchStepResult r;
  r.backend = be.name();
  r.attention = "reference";
#if HOTPATH_HAVE_CUDA
  if (be.device() == Device::kCUDA) r.attention = cuda_attention_description(be);
#endif
  r.data = trainer.loader().describe();
  r.world = ctx.world();
  r.reduction_stream = trainer.reduction_stream();
  r.steps = o.bench.steps;
  r.warmup = o.bench.warmup;
  r.startup_s = seconds_since_process_start();
  if (be.device() == Device::kCUDA)
    r.memory_plan_bytes = plan_memory(o, layout_of(o, ctx.world()), true).total;
  for (int64_t i = 0; i < o.bench.warmup; ++i) trainer.step();
  std::vector<double> ms, tps, pps, syncs, flops, tokens, positions;
  double sum_tokens = 0, sum_positions = 0;
  for (int64_t i = 0; i < o.bench.steps; ++i) {
    const StepStats s = trainer.step();
    ms.push_back(s.ms);
    tps.push_back(s.tokens_per_s);
    pps.push_back(s.positions / (s.ms / 1000.0));
    syncs.push_back(static_cast<double>(s.syncs.total()));
    flops.push_back(s.model_flops);
    tokens.push_back(static_cast<double>(s.tokens));
    positions.push_back(static_cast<double>(s.positions));
    sum_tokens += static_cast<double>(s.tokens);
    sum_positions += static_cast<double>(s.positions);
  }
  r.tokens_per_step = static_cast<int64_t>(median(tokens));
  r.positions_per_step = static_cast<int64_t>(median(positions));
  r.padding = sum_positions > 0 ? 1.0 - sum_tokens / sum_positions : 0.0;
  r.positions_per_s = median(pps);
#if HOTPATH_HAVE_CUDA
  if (be.device() == Device::kCUDA) {
    r.gemm_tuned_buckets = cuda_gemm_tuned_buckets(be);
    r.gemm_warmed_algos = cuda_gemm_warmed_algos(be);
    r.attention_tuned_graphs = cuda_attention_tuned_graphs(be);
  }
#endif
  r.ms = median(ms);
  r.tokens_per_s = median(tps);
  r.syncs = median(syncs);
  // MFU per GPU against the bf16 peak; meaningless for the CPU reference.
  if (be.device() == Device::kCUDA)
    r.mfu = median(flops) / ctx.world() / (r.ms / 1000.0) / kPeakBf16Flops;
  // The breakdown: the same number of steps again, profiled in one window. They run back to back
  // as in training (no device sync between them), so the busy and idle times below are those of
  // steps whose host work overlaps the device's as it does in a run.
  r.profiled_steps = std::max<int64_t>(1, o.bench.steps);
  // The window opens on a drained device, so none of its recorded work runs beside work issued
  // before it (the last timed step's update), which the profiler would not see.
  be.synchronize(SyncCause::kOther);
  be.profile_begin();
  for (int64_t i = 0; i < r.profiled_steps; ++i) trainer.step();
  r.profile = be.profile_end();
  const double n = static_cast<double>(r.profiled_steps);
  r.profile.wall_ms /= n;
  r.profile.busy_ms /= n;
  r.profile.idle_ms /= n;
  r.profile.kernels = static_cast<int64_t>(r.profile.kernels / n);
  // The host backend computes on the calling thread: always busy.
  const bool device = be.device() == Device::kCUDA;
  r.busy_fraction = !device                 ? 1.0
                    : r.profile.wall_ms > 0 ? std::min(1.0, r.profile.busy_ms / r.profile.wall_ms)
                                            : 0;
  r.idle_ms = device ? r.profile.idle_ms : 0.0;
  for (auto* a : {&r.profile.by_phase, &r.profile.idle_by_phase})
    for (double& v : *a) v /= n;
  for (auto* a : {&r.profile.by_family, &r.profile.idle_by_family})
    for (double& v : *a) v /= n;
  // Per step, the largest first; the table and the JSON keep the first kTopKernels kernels and
  // kTopIdleGaps gaps.
  keep_largest_per_step(r.profile.top_kernels, n, kTopKernels);
  keep_largest_per_step(r.profile.idle_gaps, n, kTopIdleGaps);
  // Every rank's memory, gathered: each rank fills its own slot, a MAX all-reduce joins them.
  const auto [kind, bytes] = rank_memory(be);
  r.memory_kind = kind;
  std::vector<int64_t> slots(static_cast<size_t>(ctx.world()), 0);
  slots[static_cast<size_t>(ctx.rank())] = bytes;
  if (ctx.world() > 1) {
    Tensor t = Tensor::host_from(slots, DType::kI64);
    ctx.groups.world->all_reduce(t, ReduceOp::kMax);
    for (size_t i = 0; i < slots.size(); ++i) slots[i] = t.data<int64_t>()[i];
  }
  r.memory_bytes = slots;
  return r;
}

std::string bench_step_table(const BenchStepResult& r) {
  const StepProfile& p = r.profile;
  std::string out;
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "bench step: backend=%s attention=%s world=%d reductions=%s tokens/step=%lld "
                "(document tokens of %lld positions, padding %.2f%%) steps=%lld (warm-up %lld)\n"
                "  %s\n",
                r.backend.c_str(), r.attention.c_str(), r.world, r.reduction_stream.c_str(),
                static_cast<long long>(r.tokens_per_step),
                static_cast<long long>(r.positions_per_step), 100 * r.padding,
                static_cast<long long>(r.steps),
                static_cast<long long>(r.warmup), r.data.c_str());
  out += buf;
  std::snprintf(buf, sizeof(buf), "%-10s %10s %12s %8s %11s %7s %9s\n", "variant", "ms/step",
                "tokens/s", "padding", "syncs/step", "MFU", "busy");
  out += buf;
  std::snprintf(buf, sizeof(buf), "%-10s %10.2f %12.1f %7.2f%% %11.0f %6.1f%% %8.1f%%\n", "step",
                r.ms, r.tokens_per_s, 100 * r.padding, r.syncs, 100 * r.mfu,
                100 * r.busy_fraction);
  out += buf;
  std::snprintf(buf, sizeof(buf),
                "profiled steps: %lld, back to back in one window (host overhead included); a "
                "step: wall %.2f ms = busy %.2f + idle %.2f, %lld kernels and copies; in all: "
                "%lld device allocations, %lld attention plans built; %lld GEMM buckets and %lld "
                "attention graphs tuned by the last timed step, %lld expert GEMM algorithms "
                "warmed\n",
                static_cast<long long>(r.profiled_steps), p.wall_ms, p.busy_ms, p.idle_ms,
                static_cast<long long>(p.kernels), static_cast<long long>(p.device_mallocs),
                static_cast<long long>(p.plans_built), static_cast<long long>(r.gemm_tuned_buckets),
                static_cast<long long>(r.attention_tuned_graphs),
                static_cast<long long>(r.gemm_warmed_algos));
  out += buf;
  std::snprintf(buf, sizeof(buf), "start-up %.2f s (process start to the first step)", r.startup_s);
  out += buf;
  if (r.memory_plan_bytes > 0) {
    std::snprintf(buf, sizeof(buf), "; memory plan %.1f MiB per rank",
                  r.memory_plan_bytes / 1048576.0);
    out += buf;
  }
  out += "\n";
  if (!r.memory_bytes.empty()) {
    out += "  memory per rank (" + r.memory_kind + ", MiB):";
    for (int64_t b : r.memory_bytes) {
      std::snprintf(buf, sizeof(buf), " %.1f", static_cast<double>(b) / 1048576.0);
      out += buf;
    }
    out += "\n";
  }
  out += "  by phase (ms):";
  for (int k = 0; k < kNumStepPhases; ++k) {
    std::snprintf(buf, sizeof(buf), " %s %.2f", step_phase_name(static_cast<StepPhase>(k)),
                  p.by_phase[k]);
    out += buf;
  }
  std::snprintf(buf, sizeof(buf), " | idle %.2f\n  idle before (ms):", p.idle_ms);
  out += buf;
  for (int k = 0; k < kNumStepPhases; ++k) {
    std::snprintf(buf, sizeof(buf), " %s %.2f", step_phase_name(static_cast<StepPhase>(k)),
                  p.idle_by_phase[k]);
    out += buf;
  }
  out += "\n  by op family (ms, % of wall; idle before its work, ms):\n";
  for (int k = 0; k < kNumOpFamilies; ++k) {
    std::snprintf(buf, sizeof(buf), "    %-18s %9.2f %6.1f%% %9.2f\n",
                  op_family_name(static_cast<OpFamily>(k)), p.by_family[k],
                  p.wall_ms > 0 ? 100 * p.by_family[k] / p.wall_ms : 0.0, p.idle_by_family[k]);
    out += buf;
  }
  std::snprintf(buf, sizeof(buf), "    %-18s %9.2f %6.1f%%\n", "idle", p.idle_ms,
                p.wall_ms > 0 ? 100 * p.idle_ms / p.wall_ms : 0.0);
  out += buf;
  if (!p.top_kernels.empty()) {
    out += "  kernels with the most device time (ms a step, launches a step):\n";
    for (const StepProfile::KernelTime& t : p.top_kernels) {
      std::snprintf(buf, sizeof(buf), "    %9.2f %6lld  %s\n", t.ms,
                    static_cast<long long>(t.count), t.name.c_str());
      out += buf;
    }
  }
  if (!p.idle_gaps.empty()) {
    out +=
        "  largest idle gaps, by the work around them (ms a step, gaps a step; phase/family "
        "after):\n";
    for (const StepProfile::IdleGap& g : p.idle_gaps) {
      std::snprintf(buf, sizeof(buf), "    %9.2f %6lld  %s -> %s  [%s/%s]\n", g.ms,
                    static_cast<long long>(g.count), g.before.c_str(), g.after.c_str(),
                    step_phase_name(g.phase), op_family_name(g.family));
      out += buf;
    }
  }
  return out;
}

std::string bench_step_json(const BenchStepResult& r) {
  const StepProfile& p = r.profile;
  nlohmann::ordered_json j;
  j["scenario"] = "step";
  j["backend"] = r.backend;
  j["attention"] = r.attention;
  j["data"] = r.data;
  j["world"] = r.world;
  j["reduction_stream"] = r.reduction_stream;
  j["tokens_per_step"] = r.tokens_per_step;
  j["positions_per_step"] = r.positions_per_step;
  j["padding"] = r.padding;
  j["steps"] = r.steps;
  j["ms_per_step"] = r.ms;
  j["tokens_per_s"] = r.tokens_per_s;
  j["positions_per_s"] = r.positions_per_s;
  j["syncs_per_step"] = r.syncs;
  j["mfu"] = r.mfu;
  j["gpu_busy_fraction"] = r.busy_fraction;
  j["idle_ms"] = r.idle_ms;
  j["gemm_tuned_buckets"] = r.gemm_tuned_buckets;
  j["gemm_warmed_algos"] = r.gemm_warmed_algos;
  j["attention_tuned_graphs"] = r.attention_tuned_graphs;
  nlohmann::ordered_json mem;
  mem["kind"] = r.memory_kind;
  mem["per_rank_bytes"] = r.memory_bytes;
  mem["max_bytes"] =
      r.memory_bytes.empty() ? 0 : *std::max_element(r.memory_bytes.begin(), r.memory_bytes.end());
  j["memory"] = mem;
  nlohmann::ordered_json prof;
  prof["steps"] = r.profiled_steps;
  prof["wall_ms"] = p.wall_ms;
  prof["busy_ms"] = p.busy_ms;
  prof["idle_ms"] = p.idle_ms;
  prof["kernels_per_step"] = p.kernels;
  prof["device_mallocs"] = p.device_mallocs;
  j["startup_s"] = r.startup_s;
  j["memory_plan_bytes"] = r.memory_plan_bytes;
  prof["plans_built"] = p.plans_built;
  for (int k = 0; k < kNumStepPhases; ++k) {
    const char* name = step_phase_name(static_cast<StepPhase>(k));
    prof["by_phase_ms"][name] = p.by_phase[k];
    prof["idle_by_phase_ms"][name] = p.idle_by_phase[k];
  }
  for (int k = 0; k < kNumOpFamilies; ++k) {
    const char* name = op_family_name(static_cast<OpFamily>(k));
    prof["by_family_ms"][name] = p.by_family[k];
    prof["idle_by_family_ms"][name] = p.idle_by_family[k];
  }
  prof["top_kernels"] = nlohmann::ordered_json::array();
  for (const StepProfile::KernelTime& t : p.top_kernels)
    prof["top_kernels"].push_back({{"name", t.name}, {"ms", t.ms}, {"count", t.count}});
  prof["idle_gaps"] = nlohmann::ordered_json::array();
  for (const StepProfile::IdleGap& g : p.idle_gaps)
    prof["idle_gaps"].push_back({{"before", g.before},
                                 {"after", g.after},
                                 {"phase", step_phase_name(g.phase)},
                                 {"family", op_family_name(g.family)},
                                 {"ms", g.ms},
                                 {"count", g.count}});
  j["profile"] = prof;
  return j.dump();
}

int run_bench_step(const TrainOptions& o, const RankContext& ctx) {
  const BenchStepResult r = measure_bench_step(o, ctx);
  if (ctx.rank() != 0) return 0;
  std::fputs(bench_step_table(r).c_str(), stdout);
  if (!o.bench.json.empty()) write_text_file(o.bench.json, bench_step_json(r), "bench_json");
  return 0;
}

}  // namespace hp
