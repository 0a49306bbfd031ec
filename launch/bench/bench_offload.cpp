#include "launch/bench/bench_offload.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "framework/backend/link_arbiter.h"
#include "framework/model/activation_store.h"
#include "launch/bench/bench_util.h"
#include "launch/json.h"
#include "parallel/link_arbiter.h"

namespace hp {
namespace {

struct Variant {
  std::string name;
  OffloadOptions opts;
  double ms = 0;
  int64_t offload_syncs = 0;
  OffloadStats stats;
};

// The copies of one step alone, back to back on the copy stream: `blocks` block inputs of
// `shape` device -> host, then host -> device. Returns {d2h ms, h2d ms}.
std::pair<double, double> time_copies(Backend& be, const Shape& shape, int blocks, int64_t reps) {
  const DType dt = be.act_dtype();
  Tensor dev = be.zeros(shape, dt);
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dt);
  std::shared_ptr<Storage> pool = be.pinned_host_storage(bytes * static_cast<size_t>(blocks));
  std::vector<Tensor> host;
  for (int b = 0; b < blocks; ++b)
    host.push_back(pool ? Tensor(pool, static_cast<int64_t>(b) * shape_numel(shape), shape, dt)
                        : Tensor::host(shape, dt));
  auto run = [&](bool d2h) {
    return time_ms(be, [&] {
      be.set_stream(Backend::StreamKind::kCopy);
      for (Tensor& h : host) {
        if (d2h)
          be.copy(dev, h);
        else
          be.copy(h, dev);
      }
      auto done = be.record_event(Backend::StreamKind::kCopy);
      be.set_stream(Backend::StreamKind::kCompute);
      be.event_synchronize(*done, SyncCause::kOther);
    });
  };
  std::vector<double> d2h, h2d;
  for (int64_t r = 0; r < reps; ++r) {
    d2h.push_back(run(true));
    h2d.push_back(run(false));
  }
  return {median(d2h), median(h2d)};
}

// One rank's side of the arbiter comparison: its median step and copy rate.
struct LinkRun {
  std::string name;                       // "off" | "on"
  std::string arbiter;                    // what make_link_arbiter gave: "local" | "node"
  std::vector<double> ms, gbps, wait_ms;  // per world rank (medians over the timed steps)
  std::vector<double> bytes;              // per world rank, of the last timed step
};

// Every rank offloads at once (offload=double, the ring's first variant): timed steps start
// together after a world barrier. Per rank: the median step time, the median achieved copy
// rate (LinkArbiterStats::achieved_gbps: bytes over first request to last release) and grant
// wait; gathered over the world by summing per-rank slots.
LinkRun run_link_variant(Backend& be, Model& model, const BatchMeta& meta, double scale,
                         const TrainOptions& o, const RankContext& ctx, bool on, int64_t reps) {
  LinkOptions lo = make_link_options(o, &be);
  lo.enabled = on;
  std::unique_ptr<LinkArbiter> arb = make_link_arbiter(*ctx.groups.node, lo);
  be.set_link_arbiter(arb.get());
  LinkRun r;
  r.name = on ? "on" : "off";
  r.arbiter = dynamic_cast<NodeLinkArbiter*>(arb.get()) ? "node" : "local";
  for (int64_t i = 0; i < std::max<int64_t>(1, o.bench.warmup); ++i) {
    model.zero_grads();
    model.forward_backward(meta, scale);
  }
  std::vector<double> ms, gbps, wait;
  double bytes = 0;
  for (int64_t i = 0; i < reps; ++i) {
    model.zero_grads();
    be.synchronize(SyncCause::kOther);
    ctx.groups.world->barrier();
    arb->begin_step();
    ms.push_back(time_ms(be, [&] { model.forward_backward(meta, scale); }));
    const LinkArbiterStats st = arb->stats();
    gbps.push_back(st.achieved_gbps());
    wait.push_back(1e3 * (st.wait_s[0] + st.wait_s[1]));
    bytes = static_cast<double>(st.bytes[0] + st.bytes[1]);
  }
  be.set_link_arbiter(nullptr);
  const int w = ctx.world(), me = ctx.rank();
  Tensor all = Tensor::host({4 * w}, DType::kF64);
  double* a = all.data<double>();
  std::fill(a, a + 4 * w, 0.0);
  a[me] = median(ms);
  a[w + me] = median(gbps);
  a[2 * w + me] = median(wait);
  a[3 * w + me] = bytes;
  ctx.groups.world->all_reduce(all, ReduceOp::kSum);
  r.ms.assign(a, a + w);
  r.gbps.assign(a + w, a + 2 * w);
  r.wait_ms.assign(a + 2 * w, a + 3 * w);
  r.bytes.assign(a + 3 * w, a + 4 * w);
  return r;
}

double max_over_min(const std::vector<double>& v) {
  const auto mm = std::minmax_element(v.begin(), v.end());
  return *mm.first > 0 ? *mm.second / *mm.first : 0.0;
}

}  // namespace

int run_bench_offload(const TrainOptions& o, const RankContext& ctx) {
  std::unique_ptr<Backend> be = make_backend(o, ctx.launch.local_rank);
  auto loader = DataLoader::open(make_data_config(o, ctx.rank(), ctx.world()));
  ModelOptions mo = make_model_options(o, be.get());
  mo.checkpoint_activations = true;
  OffloadOptions base = mo.offload;
  base.mode = OffloadMode::kNone;
  mo.offload = base;
  Model model(o.model, mo, *be);
  model.init_params(o.run.seed);
  PackedBatch batch = loader->next();
  BatchMeta meta = be->upload_batch(batch);
  const double scale = 1.0 / std::max<int64_t>(1, batch.num_valid_targets);
  const int64_t reps = std::max<int64_t>(3, o.bench.steps);

  std::vector<Variant> vs;
  auto add = [&](const char* name, OffloadMode m, int buffers, int lookahead) {
    Variant v;
    v.name = name;
    v.opts = base;
    v.opts.mode = m;
    v.opts.buffers = buffers;
    v.opts.lookahead = lookahead;
    vs.push_back(v);
  };
  add("none", OffloadMode::kNone, base.buffers, base.lookahead);
  add("single", OffloadMode::kSingle, base.buffers, base.lookahead);
  add("double L=1", OffloadMode::kDouble, std::max(2, base.buffers), 1);
  add("double L=2", OffloadMode::kDouble, std::max(3, base.buffers), 2);
  for (Variant& v : vs) {
    model.set_offload(v.opts);
    for (int64_t i = 0; i < std::max<int64_t>(1, o.bench.warmup); ++i) {
      model.zero_grads();
      model.forward_backward(meta, scale);
    }
    std::vector<double> t;
    for (int64_t i = 0; i < reps; ++i) {
      model.zero_grads();
      be->syncs().reset();
      t.push_back(time_ms(*be, [&] { model.forward_backward(meta, scale); }));
      v.offload_syncs = be->syncs().get(SyncCause::kOffload);
    }
    v.ms = median(t);
    v.stats = model.activation_store().stats();
  }
  const int layers = o.model.n_layers;
  const Shape act_shape = {batch.num_tokens(), o.model.d_model};
  const int blocks = std::max(1, layers - 1);
  const auto copy_ms = time_copies(*be, act_shape, blocks, reps);
  const double block_bytes =
      static_cast<double>(shape_numel(act_shape)) * dtype_size(be->act_dtype());
  const double moved = block_bytes * blocks;
  const double t_copy = copy_ms.first + copy_ms.second;
  const double t_none = vs[0].ms;
  // Ranks sharing host links: the same offloading step with the link arbiter off, then on.
  std::vector<LinkRun> link_runs;
  std::string links;  // the node's links as pcie_groups resolves them
  if (ctx.world() > 1) {
    links = resolve_pcie_groups(*ctx.groups.node, make_link_options(o, be.get()));
    model.set_offload(vs[2].opts);
    for (bool on : {false, true})
      link_runs.push_back(run_link_variant(*be, model, meta, scale, o, ctx, on, reps));
  }
  if (ctx.rank() != 0) return 0;

  std::printf(
      "bench offload: backend=%s layers=%d tokens=%lld block input=%.2f MiB reps=%lld "
      "sim_link_gbps=%g\n",
      be->name().c_str(), layers, static_cast<long long>(batch.num_tokens()),
      block_bytes / (1 << 20), static_cast<long long>(reps), o.compute.offload.sim_link_gbps);
  std::printf(
      "copies alone (%d blocks): D2H %.3f ms = %.2f GB/s, H2D %.3f ms = %.2f GB/s, "
      "T_copy %.3f ms; T_compute (none) %.3f ms\n",
      blocks, copy_ms.first, moved / (copy_ms.first * 1e6), copy_ms.second,
      moved / (copy_ms.second * 1e6), t_copy, t_none);
  std::printf("%-11s %10s %8s %10s %10s %9s %8s %14s %14s\n", "variant", "step ms", "vs none",
              "D2H MiB", "H2D MiB", "overlap", "syncs", "device MiB", "extra MiB");
  const double dev_none = static_cast<double>(vs[0].stats.resident_bytes);
  Json json = {{"scenario", "offload"},
               {"backend", be->name()},
               {"layers", layers},
               {"tokens", batch.num_tokens()},
               {"block_bytes", block_bytes},
               {"d2h_ms", json_number(copy_ms.first)},
               {"h2d_ms", json_number(copy_ms.second)},
               {"d2h_gbps", json_number(moved / (copy_ms.first * 1e6))},
               {"h2d_gbps", json_number(moved / (copy_ms.second * 1e6))},
               {"variants", Json::array()}};
  for (size_t i = 0; i < vs.size(); ++i) {
    const Variant& v = vs[i];
    const bool offloads = v.opts.mode != OffloadMode::kNone;
    const double exposed = v.ms - t_none;
    const double hidden = std::clamp(t_copy - exposed, 0.0, t_copy);
    const double overlap = offloads ? hidden / std::max(1e-9, std::min(t_copy, t_none)) : 0.0;
    // Device memory held for block inputs: resident inputs plus the staging ring (an offloaded
    // input additionally lives until its copy is done, at most one at a time).
    const double dev = static_cast<double>(v.stats.resident_bytes + v.stats.staging_bytes);
    std::printf("%-11s %10.3f %7.3fx %10.2f %10.2f %8.1f%% %8lld %14.2f %14.2f\n", v.name.c_str(),
                v.ms, v.ms / t_none, v.stats.d2h_bytes / 1048576.0, v.stats.h2d_bytes / 1048576.0,
                100.0 * overlap, static_cast<long long>(v.offload_syncs), dev / 1048576.0,
                (dev - dev_none) / 1048576.0);
    json["variants"].push_back({{"name", v.name},
                                {"step_ms", json_number(v.ms)},
                                {"overlap", json_number(overlap)},
                                {"offload_syncs", v.offload_syncs},
                                {"d2h_bytes", v.stats.d2h_bytes},
                                {"h2d_bytes", v.stats.h2d_bytes},
                                {"device_bytes", json_number(dev)}});
  }
  std::printf("double L=1 vs single: %.2f%% faster step\n", 100.0 * (vs[1].ms / vs[2].ms - 1.0));
  if (!link_runs.empty()) {
    std::printf(
        "link arbiter off vs on: %d ranks offloading at once (double L=1), chunk %lld MiB, "
        "inflight %d, pcie_groups='%s' (links: %s)%s\n",
        ctx.world(), static_cast<long long>(o.link.chunk_mib), o.link.inflight,
        o.link.pcie_groups.c_str(), links.empty() ? "every node rank on one" : links.c_str(),
        be->device() == Device::kCPU ? " (cpu: each rank simulates its own link)" : "");
    std::printf("%-5s %-6s %5s %10s %10s %10s %10s\n", "link", "grants", "rank", "step ms",
                "copy GB/s", "wait ms", "MiB");
    for (const LinkRun& l : link_runs) {
      for (int r = 0; r < ctx.world(); ++r) {
        std::printf("%-5s %-6s %5d %10.3f %10.3f %10.3f %10.2f\n", l.name.c_str(),
                    l.arbiter.c_str(), r, l.ms[static_cast<size_t>(r)],
                    l.gbps[static_cast<size_t>(r)], l.wait_ms[static_cast<size_t>(r)],
                    l.bytes[static_cast<size_t>(r)] / 1048576.0);
      }
    }
    std::printf("%-5s %14s %16s %12s\n", "link", "GB/s max/min", "step max/min", "jain(GB/s)");
    json["pcie_groups"] = o.link.pcie_groups;
    json["pcie_links"] = links;
    json["link"] = Json::array();
    for (size_t i = 0; i < link_runs.size(); ++i) {
      const LinkRun& l = link_runs[i];
      const double bw = max_over_min(l.gbps), spread = max_over_min(l.ms);
      const double jain = jain_fairness(l.gbps);
      std::printf("%-5s %14.3f %16.3f %12.4f\n", l.name.c_str(), bw, spread, jain);
      json["link"].push_back({{"link_arbiter", l.name},
                              {"grants", l.arbiter},
                              {"step_ms", json_numbers(l.ms)},
                              {"gbps", json_numbers(l.gbps)},
                              {"wait_ms", json_numbers(l.wait_ms)},
                              {"bytes", json_numbers(l.bytes)},
                              {"gbps_max_over_min", json_number(bw)},
                              {"step_max_over_min", json_number(spread)},
                              {"jain", json_number(jain)}});
    }
  }
  if (!o.bench.json.empty()) write_json_file(o.bench.json, json, "bench_json");
  return 0;
}

}  // namespace hp
