#include "launch/bench/bench_comm.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <vector>

#include "framework/model/expert_exchange.h"
#include "launch/bench/bench_util.h"
#include "launch/json.h"
#include "parallel/launch_env.h"
#include "parallel/moe_exchange.h"
#if HOTPATH_HAVE_CUDA
#include "framework/backend/cuda/cuda_backend.h"
#include "framework/backend/cuda/cuda_check.h"
#include "parallel/cuda/nccl_communicator.h"
#endif

namespace hp {
namespace {

constexpr int64_t kTokens = 16384;
constexpr int kTopK = 4;
constexpr int64_t kDModel = 2880;
constexpr int kMinIters = 20;


uint64_t next_random(uint64_t& s) {
  s += 0x9E3779B97F4A7C15ull;
  uint64_t z = s;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A device tensor of the given float dtype with random values in [-1, 1) (never all zero): a
// block of rows is generated on the host, uploaded once and repeated.
Tensor random_rows(Backend& be, int64_t rows, int64_t cols, DType dtype, uint64_t seed) {
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(rows, 1024));
  Tensor host = Tensor::host({block, cols}, DType::kF32);
  float* p = host.data<float>();
  for (int64_t i = 0; i < host.numel(); ++i)
    p[i] = static_cast<float>(next_random(seed) >> 40) * 0x1.0p-23f - 1.0f;
  Tensor dev32 = be.upload(host);
  Tensor blk = dev32;
  if (dtype != DType::kF32) {
    blk = be.empty({block, cols}, dtype);
    be.convert(dev32, blk);
  }
  Tensor out = be.empty({rows, cols}, dtype);
  for (int64_t r = 0; r < rows; r += block) {
    const int64_t n = std::min(block, rows - r);
    Tensor dst = out.slice(r, r + n);
    be.copy(blk.slice(0, n), dst);
  }
  return out;
}

// Times one region on the backend's compute stream: CUDA events on the GPU, wall clock on the
// CPU (whose ops run on the host in issue order).
class RegionTimer {
 public:
  explicit RegionTimer(Backend& be) : be_(be) {
#if HOTPATH_HAVE_CUDA
    if (be_.device() == Device::kCUDA) {
      stream_ = cuda_compute_stream(be_);
      CUDA_CHECK(cudaEventCreate(&start_));
      CUDA_CHECK(cudaEventCreate(&stop_));
    }
#endif
  }
  ~RegionTimer() {
#if HOTPATH_HAVE_CUDA
    if (start_) cudaEventDestroy(start_);
    if (stop_) cudaEventDestroy(stop_);
#endif
  }
  RegionTimer(const RegionTimer&) = delete;
  RegionTimer& operator=(const RegionTimer&) = delete;

  void start() {
#if HOTPATH_HAVE_CUDA
    if (stream_) {
      CUDA_CHECK(cudaEventRecord(start_, stream_));
      return;
    }
#endif
    t0_ = std::chrono::steady_clock::now();
  }
  // Milliseconds since start(); waits for the region (the timer's own wait counts no sync).
  double stop_ms() {
#if HOTPATH_HAVE_CUDA
    if (stream_) {
      CUDA_CHECK(cudaEventRecord(stop_, stream_));
      CUDA_CHECK(cudaEventSynchronize(stop_));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      return ms;
    }
#endif
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_)
        .count();
  }

 private:
  Backend& be_;
  std::chrono::steady_clock::time_point t0_;
#if HOTPATH_HAVE_CUDA
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
#endif
};

struct RoutingRow {
  int experts;
  std::string variant;
  double ms;       // router GEMM + routing + permute
  double core_ms;  // routing alone: top-k, histogram, scan, sort, count read
  double syncs_per_layer;
};

}  // namespace

int run_bench_routing(const TrainOptions& o, const RankContext& ctx) {
  if (ctx.rank() != 0) return 0;  // one rank's routing: the others have nothing to do
  auto be_ptr = make_backend(o, ctx.launch.local_rank);
  Backend& be = *be_ptr;
  const int warmup = static_cast<int>(std::max<int64_t>(3, o.bench.warmup));
  const int iters = static_cast<int>(std::max<int64_t>(kMinIters, o.bench.steps));
  const int64_t n = kTokens, d = kDModel, k = kTopK;
  Tensor x = random_rows(be, n, d, be.act_dtype(), 101);
  RegionTimer timer(be);
  std::vector<RoutingRow> rows;
  for (int e : {32, 128}) {
    Tensor wr = random_rows(be, d, e, be.act_dtype(), 202 + e);
    Tensor logits = be.empty({n, e}, be.act_dtype());
    Tensor idx = be.empty({n, k}, DType::kI32);
    Tensor w = be.empty({n, k}, be.act_dtype());
    Tensor ids = idx.reshape({n * k});
    Tensor counts = be.empty({e}, DType::kI32);
    Tensor offsets = be.empty({e + 1}, DType::kI32);
    Tensor s2a = be.empty({n * k}, DType::kI32);
    Tensor a2s = be.empty({n * k}, DType::kI32);
    Tensor xs = be.empty({n * k, d}, be.act_dtype());
    for (RoutingMode mode : {RoutingMode::kBincount, RoutingMode::kPerExpert}) {
      // The routing part of one MoE layer forward, in the model's order.
      auto layer = [&] {
        be.gemm(x, false, wr, false, logits, 1.0, 0.0);
        be.router_topk(logits, static_cast<int>(k), idx, w);
        be.histogram(ids, e, counts);
        be.exclusive_scan(counts, offsets);
        be.sort_by_id(ids, offsets, s2a, a2s);
        std::vector<int64_t> c = read_expert_counts(be, counts, e, mode);
        be.permute_rows(x, s2a, static_cast<int>(k), xs);
        return c;
      };
      for (int i = 0; i < warmup; ++i) layer();
      std::vector<double> ms;
      int64_t syncs = 0;
      for (int i = 0; i < iters; ++i) {
        const int64_t before = be.syncs().get(SyncCause::kRouting);
        timer.start();
        std::vector<int64_t> c = layer();
        ms.push_back(timer.stop_ms());
        syncs += be.syncs().get(SyncCause::kRouting) - before;
        int64_t total = 0;
        for (int64_t v : c) total += v;
        HP_CHECK(total == n * k, "routing bench: counts sum to ", total, ", expected ", n * k);
      }
      // The routing decision alone, from logits to host-known counts (what per-expert `where`
      // loops and bincount+argsort replace in PyTorch stacks).
      auto core = [&] {
        be.router_topk(logits, static_cast<int>(k), idx, w);
        be.histogram(ids, e, counts);
        be.exclusive_scan(counts, offsets);
        be.sort_by_id(ids, offsets, s2a, a2s);
        return read_expert_counts(be, counts, e, mode);
      };
      for (int i = 0; i < warmup; ++i) core();
      std::vector<double> core_ms;
      for (int i = 0; i < iters; ++i) {
        timer.start();
        core();
        core_ms.push_back(timer.stop_ms());
      }
      rows.push_back({e, mode == RoutingMode::kBincount ? "bincount" : "per-expert", median(ms),
                      median(core_ms), static_cast<double>(syncs) / iters});
    }
  }
  std::printf(
      "bench routing: backend=%s tokens=%lld top_k=%lld d_model=%lld iters=%d "
      "(warm-up %d)\n",
      be.name().c_str(), static_cast<long long>(n), static_cast<long long>(k),
      static_cast<long long>(d), iters, warmup);
  std::printf("%-8s %-11s %10s %14s %12s %12s\n", "experts", "variant", "layer ms", "vs bincount",
              "routing ms", "syncs/layer");
  Json js = {{"scenario", "routing"}, {"backend", be.name()}, {"tokens", n}, {"top_k", k},
             {"d_model", d},          {"rows", Json::array()}};
  for (size_t i = 0; i < rows.size(); ++i) {
    const RoutingRow& r = rows[i];
    const double base = rows[i - i % 2].ms;
    std::printf("%-8d %-11s %10.3f %13.2fx %12.3f %12.0f\n", r.experts, r.variant.c_str(), r.ms,
                r.ms / base, r.core_ms, r.syncs_per_layer);
    js["rows"].push_back({{"experts", r.experts},
                          {"variant", r.variant},
                          {"ms", json_number(r.ms)},
                          {"routing_ms", json_number(r.core_ms)},
                          {"ratio", json_number(r.ms / base)},
                          {"syncs_per_layer", json_number(r.syncs_per_layer)}});
  }
  if (!o.bench.json.empty()) write_json_file(o.bench.json, js, "bench_json");
  return 0;
}

#if HOTPATH_HAVE_CUDA
namespace {

struct A2aRow {
  std::string variant;
  int64_t tokens;  // 0 for the even sweep
  double mib;      // bytes this rank sends per all-to-all, MiB
  double ms;       // median over iterations, max over ranks
  double algbw;    // GB/s
  double busbw;    // GB/s
  int set;         // rows of one size share a set: ratios compare within it
};

// The reference all-to-all: NCCL used the standard way, independent of the NcclCommunicator
// under test. A plain blocking NCCL communicator of its own over the same ranks, on the
// backend's compute stream (where the timer records), and per all-to-all one group with an
// ncclSend/ncclRecv pair for every peer, this rank included.
class NcclReferenceAllToAll {
 public:
  NcclReferenceAllToAll(Communicator& host, Backend& be) : stream_(cuda_compute_stream(be)) {
    // Launch ordering as for every NcclCommunicator of the process, so both pay the same.
    (void)nccl_launch_order_implicit();
    CUDA_CHECK(cudaSetDevice(cuda_backend_device(be)));
    ncclUniqueId id;
    share_nccl_unique_id(host, &id);
    NCCL_CHECK(ncclCommInitRank(&comm_, host.size(), id, host.rank()));
  }
  ~NcclReferenceAllToAll() {
    if (!comm_) return;
    cudaStreamSynchronize(stream_);  // destructors do not throw: best effort
    ncclCommDestroy(comm_);
  }
  NcclReferenceAllToAll(const NcclReferenceAllToAll&) = delete;
  NcclReferenceAllToAll& operator=(const NcclReferenceAllToAll&) = delete;

  // Rows of `row_bytes` bytes; counts per peer as in Communicator::all_to_all_v.
  void run(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor& recv,
           const std::vector<int64_t>& recv_counts, size_t row_bytes) {
    const char* src = static_cast<const char*>(send.raw());
    char* dst = static_cast<char*>(recv.raw());
    size_t send_off = 0, recv_off = 0;
    NCCL_CHECK(ncclGroupStart());
    for (size_t p = 0; p < send_counts.size(); ++p) {
      const size_t sb = static_cast<size_t>(send_counts[p]) * row_bytes;
      const size_t rb = static_cast<size_t>(recv_counts[p]) * row_bytes;
      if (sb > 0)
        NCCL_CHECK(ncclSend(src + send_off, sb, ncclInt8, static_cast<int>(p), comm_, stream_));
      if (rb > 0)
        NCCL_CHECK(ncclRecv(dst + recv_off, rb, ncclInt8, static_cast<int>(p), comm_, stream_));
      send_off += sb;
      recv_off += rb;
    }
    NCCL_CHECK(ncclGroupEnd());
  }

 private:
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

int run_bench_alltoall(const TrainOptions& o, const RankContext& ctx) {
  auto be_ptr = make_backend(o, ctx.launch.local_rank);
  Backend& be = *be_ptr;
  if (be.device() != Device::kCUDA)
    HP_USER_ERROR(ErrorKind::kConfig,
                  "hotpath bench alltoall: needs device=cuda (NCCL); got "
                  "backend ",
                  be.name());
  HP_CHECK(ctx.groups.world, "bench alltoall: no world communicator");
  // The expert group is the whole world here: every rank owns E / world experts.
  std::shared_ptr<NcclCommunicator> comm = NcclCommunicator::create(*ctx.groups.world, be, "world");
  CommExpertExchange exchange(comm, comm);
  Communicator& host = *ctx.groups.world;
  NcclReferenceAllToAll reference(host, be);
  const int world = comm->size();
  const int experts = 32;
  HP_CHECK(experts % world == 0, "bench alltoall: ", experts, " experts over ", world, " ranks");
  const int warmup = static_cast<int>(std::max<int64_t>(3, o.bench.warmup));
  const int iters = static_cast<int>(std::max<int64_t>(kMinIters, o.bench.steps));
  const double bus_factor = world > 1 ? static_cast<double>(world - 1) / world : 1.0;
  RegionTimer timer(be);

  // Median over iterations, then the slowest rank (a collective ends when its last rank does).
  auto time_op = [&](const std::function<void()>& op) {
    for (int i = 0; i < warmup; ++i) op();
    std::vector<double> ms;
    for (int i = 0; i < iters; ++i) {
      comm->barrier();  // start together: the timed region is the exchange, not the skew
      timer.start();
      op();
      ms.push_back(timer.stop_ms());
    }
    Tensor t = Tensor::host_from(std::vector<double>{median(ms)}, DType::kF64);
    host.all_reduce(t, ReduceOp::kMax);
    return t.data<double>()[0];
  };
  int set = 0;
  auto row = [&](const std::string& v, int64_t tokens, double bytes, double ms) {
    const double algbw = bytes / (ms * 1e-3) / 1e9;
    return A2aRow{v, tokens, bytes / (1 << 20), ms, algbw, algbw * bus_factor, set};
  };

  std::vector<A2aRow> rows;
  for (int64_t tokens : {int64_t{1024}, int64_t{4096}, int64_t{8192}, kTokens, int64_t{32768}}) {
    const int64_t m = tokens * kTopK;
    // Uniform random routing, different on every rank.
    uint64_t seed =
        77 + 1000003ull * static_cast<uint64_t>(comm->rank()) + static_cast<uint64_t>(tokens);
    Tensor ids_host = Tensor::host({m}, DType::kI32);
    for (int64_t i = 0; i < m; ++i)
      ids_host.data<int32_t>()[i] = static_cast<int32_t>(next_random(seed) % experts);
    Tensor ids = be.upload(ids_host);
    Tensor counts = be.empty({experts}, DType::kI32);
    be.histogram(ids, experts, counts);
    const ExchangePlan plan = exchange.plan(be, counts, experts, RoutingMode::kBincount);
    Tensor x = random_rows(be, m, kDModel, DType::kBF16, seed);
    const double row_bytes = static_cast<double>(kDModel) * dtype_size(DType::kBF16);
    // Bytes this rank sends: dispatch sends its assignments, combine returns its experts' rows.
    const double bytes = (plan.local_rows_in + plan.expert_rows) * row_bytes;

    const double ms_ex = time_op([&] {
      Tensor y = exchange.dispatch(be, plan, x);
      Tensor z = exchange.combine(be, plan, y);
    });
    const std::vector<int64_t> send = CommExpertExchange::send_rows(plan);
    const std::vector<int64_t> recv = CommExpertExchange::recv_rows(plan);
    Tensor y = be.empty({plan.expert_rows, kDModel}, DType::kBF16);
    Tensor z = be.empty({plan.local_rows_in, kDModel}, DType::kBF16);
    const double ms_plain = time_op([&] {
      comm->all_to_all_v(x, send, y, recv);
      comm->all_to_all_v(y, recv, z, send);
    });
    // The same two all-to-alls (same counts, same bytes) through plain NCCL.
    const size_t row_size = static_cast<size_t>(kDModel) * dtype_size(DType::kBF16);
    const double ms_ref = time_op([&] {
      reference.run(x, send, y, recv, row_size);
      reference.run(y, recv, z, send, row_size);
    });
    rows.push_back(row("moe_exchange", tokens, bytes, ms_ex));
    rows.push_back(row("all_to_all_v", tokens, bytes, ms_plain));
    rows.push_back(row("nccl_ref", tokens, bytes, ms_ref));
    ++set;
  }
  // Plain even all-to-all, the size nccl-tests quotes (bytes = this rank's send buffer).
  for (int64_t mib : {int64_t{1}, int64_t{16}, int64_t{128}, int64_t{512}}) {
    const int64_t elems = mib * (1 << 20) / 2 / world * world;
    Tensor a = random_rows(be, elems / kDModel, kDModel, DType::kBF16, 9 + mib).reshape({-1});
    const int64_t total = a.numel() - a.numel() % world;
    Tensor send = a.flat_view(0, total);
    Tensor recv = be.empty({total}, DType::kBF16);
    std::vector<int64_t> c(static_cast<size_t>(world), total / world);
    const double ms = time_op([&] { comm->all_to_all_v(send, c, recv, c); });
    const double ms_ref = time_op([&] { reference.run(send, c, recv, c, 2); });
    rows.push_back(row("even", 0, static_cast<double>(total) * 2, ms));
    rows.push_back(row("nccl_ref", 0, static_cast<double>(total) * 2, ms_ref));
    ++set;
  }

  if (ctx.rank() != 0) return 0;
  std::printf(
      "bench alltoall: backend=%s world=%d experts=%d top_k=%d d_model=%lld bf16 "
      "iters=%d (warm-up %d)\n",
      be.name().c_str(), world, experts, kTopK, static_cast<long long>(kDModel), iters, warmup);
  // ratio: the exchange's bus bandwidth over the communicator's plain all_to_all_v of the same
  // bytes; vs_nccl: a row's bus bandwidth over plain NCCL's (nccl_ref) of the same bytes.
  std::printf("%-13s %7s %10s %9s %11s %11s %8s %8s\n", "variant", "tokens", "MiB/rank", "ms",
              "algbw GB/s", "busbw GB/s", "ratio", "vs_nccl");
  Json js = {{"scenario", "alltoall"}, {"world", world},     {"experts", experts},
             {"top_k", kTopK},         {"d_model", kDModel}, {"rows", Json::array()}};
  for (size_t i = 0; i < rows.size(); ++i) {
    const A2aRow& r = rows[i];
    auto busbw_of = [&](const char* variant) {
      for (const A2aRow& q : rows)
        if (q.set == r.set && q.variant == variant) return q.busbw;
      return 0.0;
    };
    auto percent = [](double a, double b) {
      return b > 0 ? str_cat(static_cast<int>(100 * a / b + 0.5), "%") : std::string("-");
    };
    const double plain = busbw_of("all_to_all_v"), nccl = busbw_of("nccl_ref");
    const bool is_ref = r.variant == "nccl_ref";
    const std::string ratio = r.variant == "moe_exchange" ? percent(r.busbw, plain) : "-";
    const std::string vs_nccl = is_ref ? "-" : percent(r.busbw, nccl);
    std::printf("%-13s %7lld %10.1f %9.3f %11.1f %11.1f %8s %8s\n", r.variant.c_str(),
                static_cast<long long>(r.tokens), r.mib, r.ms, r.algbw, r.busbw, ratio.c_str(),
                vs_nccl.c_str());
    Json row = {{"variant", r.variant},
                {"tokens", r.tokens},
                {"mib_per_rank", json_number(r.mib)},
                {"ms", json_number(r.ms)},
                {"algbw_gbs", json_number(r.algbw)},
                {"busbw_gbs", json_number(r.busbw)}};
    if (r.variant == "moe_exchange" && plain > 0) row["vs_all_to_all_v"] = r.busbw / plain;
    if (!is_ref && nccl > 0) row["vs_nccl"] = r.busbw / nccl;
    js["rows"].push_back(row);
  }
  if (!o.bench.json.empty()) write_json_file(o.bench.json, js, "bench_json");
  return 0;
}
#else
int run_bench_alltoall(const TrainOptions&, const RankContext&) {
  HP_USER_ERROR(ErrorKind::kConfig,
                "hotpath bench alltoall: needs NCCL; this hotpath was built without CUDA (build "
                "the cuda preset)");
}
#endif

}  // namespace hp
