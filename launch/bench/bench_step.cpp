#include "launch/bench/bench_step.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <vector>

#include "framework/core/error.h"
#include "launch/bench_comm.h"
#include "launch/bench_model.h"
#include "launch/bench_offload.h"

namespace hp {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int run_bench(const std::string& scenario, const TrainOptions& o, const RankContext& ctx) {
  if (scenario == "metadata") return run_bench_metadata(o, ctx);
  if (scenario == "routing") return run_bench_routing(o, ctx);
  if (scenario == "alltoall") return run_bench_alltoall(o, ctx);
  if (scenario == "offload") return run_bench_offload(o, ctx);
  if (scenario == "step") return run_bench_step(o, ctx);
  HP_USER_ERROR(ErrorKind::kUser, "hotpath bench: unknown scenario '", scenario,
                "'; available: step, metadata, routing, alltoall, offload");
}

int run_bench_step(const TrainOptions& o, const RankContext& ctx) {
  Trainer trainer(o, ctx);
  for (int64_t i = 0; i < o.bench_warmup; ++i) trainer.step();
  std::vector<double> ms, tps, syncs, flops;
  for (int64_t i = 0; i < o.bench_steps; ++i) {
    StepStats s = trainer.step();
    ms.push_back(s.ms);
    tps.push_back(s.tokens_per_s);
    syncs.push_back(static_cast<double>(s.syncs.total()));
    flops.push_back(s.model_flops);
  }
  const double med_ms = median(ms), med_tps = median(tps), med_syncs = median(syncs);
  const bool gpu = trainer.backend().device() == Device::kCUDA;
  // MFU per GPU against the bf16 peak; meaningless for the CPU reference.
  const double mfu = gpu ? median(flops) / ctx.world() / (med_ms / 1000.0) / kPeakBf16Flops : 0.0;
  if (ctx.rank() != 0) return 0;
  std::printf(
      "bench step: backend=%s world=%d tokens/step=%lld layers=%d steps=%lld (warm-up %lld)\n",
      trainer.backend().name().c_str(), ctx.world(), static_cast<long long>(o.batch_tokens),
      o.model.n_layers, static_cast<long long>(o.bench_steps),
      static_cast<long long>(o.bench_warmup));
  std::printf("%-10s %12s %12s %12s %8s\n", "variant", "ms/step", "tokens/s", "syncs/step", "MFU");
  std::printf("%-10s %12.2f %12.1f %12.0f %7.1f%%\n", "step", med_ms, med_tps, med_syncs,
              100 * mfu);
  if (!o.bench_json.empty()) {
    std::ofstream f(o.bench_json);
    f << "{\"scenario\":\"step\",\"backend\":\"" << trainer.backend().name()
      << "\",\"ms_per_step\":" << med_ms << ",\"tokens_per_s\":" << med_tps
      << ",\"syncs_per_step\":" << med_syncs << ",\"mfu\":" << mfu << "}\n";
  }
  return 0;
}

}  // namespace hp
