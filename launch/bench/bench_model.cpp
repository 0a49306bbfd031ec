#include "launch/bench/bench_model.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <vector>

#include "framework/core/log.h"
#include "launch/bench/bench_util.h"
#include "launch/json.h"

namespace hp {
namespace {


}  // namespace

int run_bench_metadata(const TrainOptions& o, const RankContext& ctx) {
  std::unique_ptr<Backend> be = make_backend(o, ctx.launch.local_rank);
  auto loader = DataLoader::open(make_data_config(o, ctx.rank(), ctx.world()));
  Model model(o.model, make_model_options(o, be.get()), *be);
  model.init_params(o.run.seed);
  PackedBatch batch = loader->next();
  BatchMeta meta = be->upload_batch(batch);
  const double scale = 1.0 / std::max<int64_t>(1, batch.num_valid_targets);
  const int64_t reps = std::max<int64_t>(3, o.bench.steps);

  struct Row {
    const char* name;
    double fwd, fwdbwd;
    int64_t syncs;
  };
  std::vector<Row> rows;
  for (MetadataMode mode : {MetadataMode::kCached, MetadataMode::kPerLayer}) {
    model.set_metadata_mode(mode);
    for (int64_t i = 0; i < o.bench.warmup; ++i) {
      model.zero_grads();
      model.forward_backward(meta, scale);
    }
    std::vector<double> f, fb;
    for (int64_t i = 0; i < reps; ++i) f.push_back(time_ms(*be, [&] { model.evaluate(meta); }));
    int64_t syncs = 0;
    for (int64_t i = 0; i < reps; ++i) {
      model.zero_grads();
      be->syncs().reset();
      fb.push_back(time_ms(*be, [&] { model.forward_backward(meta, scale); }));
      syncs = be->syncs().get(SyncCause::kMetadata);
    }
    rows.push_back(
        {mode == MetadataMode::kCached ? "cached" : "per-layer", median(f), median(fb), syncs});
  }
  // m: one rebuild of the structures from positions on the device, including its read-back.
  std::vector<double> m;
  for (int64_t i = 0; i < reps; ++i) {
    BatchMeta copy = meta;
    m.push_back(time_ms(*be, [&] { be->rebuild_metadata(copy); }));
  }
  const double mm = median(m);
  const int layers = o.model.n_layers;
  if (ctx.rank() != 0) return 0;
  std::printf("bench metadata: backend=%s layers=%d tokens=%lld sequences=%lld reps=%lld\n",
              be->name().c_str(), layers, static_cast<long long>(batch.num_tokens()),
              static_cast<long long>(batch.num_seqs()), static_cast<long long>(reps));
  std::printf("%-10s %10s %10s %12s %16s\n", "variant", "fwd ms", "bwd ms", "fwd+bwd ms",
              "metadata syncs");
  for (const Row& r : rows)
    std::printf("%-10s %10.3f %10.3f %12.3f %16lld\n", r.name, r.fwd, r.fwdbwd - r.fwd, r.fwdbwd,
                static_cast<long long>(r.syncs));
  const double saved = rows[1].fwdbwd - rows[0].fwdbwd;
  std::printf(
      "per-layer rebuild m=%.3f ms; saved %.3f ms per step (%.2f%% of per-layer) vs "
      "L*m=%.3f ms, (L-1)*m=%.3f ms; forward speed-up %.3fx\n",
      mm, saved, 100.0 * saved / rows[1].fwdbwd, layers * mm, (layers - 1) * mm,
      rows[1].fwd / rows[0].fwd);
  if (!o.bench.json.empty()) {
    const Json j = {{"scenario", "metadata"},
                    {"layers", layers},
                    {"cached_fwd_ms", json_number(rows[0].fwd)},
                    {"cached_step_ms", json_number(rows[0].fwdbwd)},
                    {"per_layer_fwd_ms", json_number(rows[1].fwd)},
                    {"per_layer_step_ms", json_number(rows[1].fwdbwd)},
                    {"m_ms", json_number(mm)},
                    {"cached_syncs", rows[0].syncs},
                    {"per_layer_syncs", rows[1].syncs}};
    write_json_file(o.bench.json, j, "bench_json");
  }
  return 0;
}

}  // namespace hp
