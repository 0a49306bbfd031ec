#include "framework/backend/cuda/cudnn_attention.h"

#if HOTPATH_HAVE_CUDNN

#include <cuda_runtime.h>
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "framework/backend/cuda/candidate_timer.h"
#include "framework/backend/cuda/cuda_check.h"
#include "framework/backend/cuda/mark_written.h"
#include "framework/core/error.h"
#include "framework/core/rng.h"

// The frontend resolves every cuDNN symbol through this handle
// (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}

namespace hp::cuda {
namespace fe = cudnn_frontend;

namespace {

#define FE_CHECK(expr)                                                        \
  do {                                                                        \
    fe::error_t hp_fe_rc_ = (expr);                                           \
    if (!hp_fe_rc_.is_good())                                                 \
      HP_FAIL(ErrorKind::kCuda, #expr, " failed: ", hp_fe_rc_.get_message()); \
  } while (0)

#define CUDNN_CALL(expr)                                                                       \
  do {                                                                                         \
    const cudnnStatus_t hp_dnn_rc_ = (expr);                                                   \
    if (hp_dnn_rc_ != CUDNN_STATUS_SUCCESS)                                                    \
      HP_FAIL(ErrorKind::kCuda, #expr, " failed: ", fe::detail::get_error_string(hp_dnn_rc_)); \
  } while (0)

enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
  kSeqQ,
  kSeqKV,
  kOffQkv,
  kOffO,
  kOffLse
};

int64_t next_pow2(int64_t x, int64_t lo) {
  int64_t p = lo;
  while (p < x) p *= 2;
  return p;
}

struct Key {
  bool backward, deterministic, ragged;
  int64_t b, s, total;  // total: packed tokens (sizes cuDNN's ragged workspaces)
  int hq, hkv, d, window;
  float scale;
  bool operator==(const Key& o) const { return std::memcmp(this, &o, sizeof(Key)) == 0; }
};
struct KeyHash {
  size_t operator()(const Key& k) const { return hash64_bytes(&k, sizeof(Key)); }
};

}  // namespace

struct CudnnAttention::Impl {
  // A forward graph's plans being timed: plan[i]'s runs are the timer's candidate i.
  struct Tuning {
    std::vector<int64_t> plan;
    CandidateTimer timer;
  };
  struct Entry {
    std::shared_ptr<fe::graph::Graph> graph;
    int64_t plans = 1;      // plans built (all of the heuristic's where tuning, else its first)
    int64_t plan = -1;      // what runs: -1 the heuristic's choice, else the fastest plan's index
    int64_t workspace = 0;  // bytes, the largest any built plan needs
    bool tuned = false;     // the plans have been compared (or there is nothing to compare)
    std::unique_ptr<Tuning> tuning;  // while the timings are outstanding
  };
  static constexpr int kTuneRuns = 2;

  cudnnHandle_t handle = nullptr;
  bool autotune = false;
  int64_t tuned = 0;
  std::unordered_map<Key, Entry, KeyHash> graphs;

  // Q, K, V: head blocks of qkv[N, Ht, D]. Under ragged offsets the batch stride is irrelevant;
  // without them (every sequence s tokens) sequence i starts at token i s.
  static std::shared_ptr<fe::graph::Tensor_attributes> qkv_tensor(
      fe::graph::Graph& g, const char* name, int64_t uid, const Key& k, int heads,
      std::shared_ptr<fe::graph::Tensor_attributes> off) {
    const int64_t row = static_cast<int64_t>(k.hq + 2 * k.hkv) * k.d;
    auto t = g.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({k.b, heads, k.s, k.d})
                          .set_stride({k.s * row, k.d, row, 1}));
    if (off) t->set_ragged_offset(off);
    return t;
  }
  static std::shared_ptr<fe::graph::Tensor_attributes> int_tensor(fe::graph::Graph& g,
                                                                  const char* name, int64_t uid,
                                                                  int64_t n) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({n, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(fe::DataType_t::INT32));
  }

  Entry& graph(const Key& k) {
    auto it = graphs.find(k);
    if (it != graphs.end()) return it->second;
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    // Sequences of different lengths: ragged offsets and a padding mask by their lengths. A batch
    // of equal ones is a plain [B, H, S, D] problem, for which cuDNN has faster kernels.
    std::shared_ptr<fe::graph::Tensor_attributes> off_qkv, off_o, off_lse, seq_q, seq_kv;
    if (k.ragged) {
      off_qkv = int_tensor(*g, "off_qkv", kOffQkv, k.b + 1);
      off_o = int_tensor(*g, "off_o", kOffO, k.b + 1);
      off_lse = int_tensor(*g, "off_lse", kOffLse, k.b + 1);
      seq_q = int_tensor(*g, "seq_q", kSeqQ, k.b);
      seq_kv = int_tensor(*g, "seq_kv", kSeqKV, k.b);
    }
    auto q = qkv_tensor(*g, "q", kQ, k, k.hq, off_qkv);
    auto kk = qkv_tensor(*g, "k", kK, k, k.hkv, off_qkv);
    auto v = qkv_tensor(*g, "v", kV, k, k.hkv, off_qkv);
    const std::vector<int64_t> o_dim{k.b, k.hq, k.s, k.d};
    const std::vector<int64_t> o_stride{k.s * k.hq * k.d, k.d, static_cast<int64_t>(k.hq) * k.d, 1};
    const std::vector<int64_t> l_dim{k.b, k.hq, k.s, 1};
    // The statistics: the backend's lse[N, Hq] under ragged offsets; a packed [B, Hq, S] scratch
    // without them (cuDNN before 9.26 takes no other layout there; transposed on the way).
    const std::vector<int64_t> l_stride = k.ragged ? std::vector<int64_t>{k.s * k.hq, 1, k.hq, 1}
                                                   : std::vector<int64_t>{k.hq * k.s, k.s, 1, 1};
    if (!k.backward) {
      auto opts = fe::graph::SDPA_attributes()
                      .set_name("attention_fwd")
                      .set_generate_stats(true)
                      .set_attn_scale(k.scale)
                      .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                      .set_diagonal_band_right_bound(0);
      if (k.ragged)
        opts.set_max_total_seq_len_q(k.total)
            .set_max_total_seq_len_kv(k.total)
            .set_padding_mask(true)
            .set_seq_len_q(seq_q)
            .set_seq_len_kv(seq_kv);
      if (k.window > 0) opts.set_diagonal_band_left_bound(k.window);
      auto [o, stats] = g->sdpa(q, kk, v, opts);
      o->set_output(true).set_uid(kO).set_dim(o_dim).set_stride(o_stride);
      stats->set_output(true)
          .set_uid(kStats)
          .set_data_type(fe::DataType_t::FLOAT)
          .set_dim(l_dim)
          .set_stride(l_stride);
      if (k.ragged) {
        o->set_ragged_offset(off_o);
        stats->set_ragged_offset(off_lse);
      }
    } else {
      auto tensor = [&](const char* name, int64_t uid, std::vector<int64_t> dim,
                        std::vector<int64_t> stride,
                        std::shared_ptr<fe::graph::Tensor_attributes> off, bool f32) {
        auto t = g->tensor(
            fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(
                stride));
        if (off) t->set_ragged_offset(off);
        if (f32) t->set_data_type(fe::DataType_t::FLOAT);
        return t;
      };
      auto o = tensor("o", kO, o_dim, o_stride, off_o, false);
      auto d_o = tensor("do", kDO, o_dim, o_stride, off_o, false);
      auto stats = tensor("stats", kStats, l_dim, l_stride, off_lse, true);
      auto opts = fe::graph::SDPA_backward_attributes()
                      .set_name("attention_bwd")
                      .set_attn_scale(k.scale)
                      .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                      .set_diagonal_band_right_bound(0)
                      .set_deterministic_algorithm(k.deterministic);
      if (k.ragged)
        opts.set_max_total_seq_len_q(k.total)
            .set_max_total_seq_len_kv(k.total)
            .set_padding_mask(true)
            .set_seq_len_q(seq_q)
            .set_seq_len_kv(seq_kv);
      if (k.window > 0) opts.set_diagonal_band_left_bound(k.window);
      auto [dq, dk, dv] = g->sdpa_backward(q, kk, v, o, d_o, stats, opts);
      const int64_t row = static_cast<int64_t>(k.hq + 2 * k.hkv) * k.d;
      for (auto [t, uid, heads] : {std::make_tuple(dq, kDQ, k.hq), std::make_tuple(dk, kDK, k.hkv),
                                   std::make_tuple(dv, kDV, k.hkv)}) {
        t->set_output(true)
            .set_uid(uid)
            .set_dim({k.b, heads, k.s, k.d})
            .set_stride({k.s * row, k.d, row, 1});
        if (k.ragged) t->set_ragged_offset(off_qkv);
      }
    }
    // The heuristic offers the forward several plans (tile shapes); with tuning, all are built
    // and timed at the graph's first run. The backward has one.
    const bool tune = autotune && !k.backward;
    FE_CHECK(
        g->build(handle, {fe::HeurMode_t::A},
                 tune ? fe::BuildPlanPolicy_t::ALL : fe::BuildPlanPolicy_t::HEURISTICS_CHOICE));
    Entry e;
    e.graph = g;
    FE_CHECK(g->get_workspace_size(e.workspace));
    if (tune) {
      e.plans = g->get_execution_plan_count();
      for (int64_t i = 0; i < e.plans; ++i) {
        int64_t ws = 0;
        if (g->get_workspace_size_plan_at_index(i, ws).is_good())
          e.workspace = std::max(e.workspace, ws);
      }
    }
    e.tuned = e.plans < 2;
    return graphs.emplace(k, std::move(e)).first->second;
  }

  // Runs the graph (its fastest plan once known). At a tuned graph's first run, each plan first
  // runs once untimed and kTuneRuns times between events (a forward may run again: it only
  // writes its outputs); a later run that finds the last event complete picks the fastest.
  // Nothing waits for the timings.
  void run(Entry& e, std::unordered_map<int64_t, void*>& pack, Allocator& alloc,
           CUstream_st* stream) {
    fe::graph::Graph& g = *e.graph;
    const int64_t ws = e.workspace;
    Tensor workspace = ws > 0 ? Tensor::empty(alloc, {(ws + 3) / 4}, DType::kI32) : Tensor();
    void* wp = ws > 0 ? workspace.raw() : nullptr;
    CUDNN_CALL(fe::detail::set_stream(handle, stream));
    // cuDNN's kernels hand partial results to each other through the workspace (the backward's
    // per-query-head dK/dV, reduced over each group by fmha_reduce_head_ragged) with TMA stores
    // that initcheck does not see; declared written, as the outputs are (mark_written.h).
    if (ws > 0) mark_written(wp, static_cast<size_t>(ws), stream);
    if (e.tuning) finish_tuning(e);
    if (!e.tuned && !e.tuning) start_tuning(e, pack, wp, stream);
    if (e.plan < 0)
      FE_CHECK(g.execute(handle, pack, wp));
    else
      FE_CHECK(g.execute_plan_at_index(handle, pack, wp, e.plan));
  }

  void start_tuning(Entry& e, std::unordered_map<int64_t, void*>& pack, void* wp,
                    CUstream_st* stream) {
    auto t = std::make_unique<Tuning>();
    for (int64_t i = 0; i < e.plans; ++i) {
      // A plan that did not build, or does not run here, is left out.
      if (!e.graph->execute_plan_at_index(handle, pack, wp, i).is_good()) continue;
      t->plan.push_back(i);
      t->timer.begin(stream);
      for (int r = 0; r < kTuneRuns; ++r)
        FE_CHECK(e.graph->execute_plan_at_index(handle, pack, wp, i));
      t->timer.end(stream);
    }
    e.tuned = t->plan.size() < 2;
    if (!e.tuned) e.tuning = std::move(t);
  }

  void finish_tuning(Entry& e) {
    const int best = e.tuning->timer.fastest();
    if (best < 0) return;
    e.plan = e.tuning->plan[static_cast<size_t>(best)];
    e.tuned = true;
    e.tuning.reset();
    ++tuned;
  }
};

std::unique_ptr<CudnnAttention> CudnnAttention::create(std::string* why) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (!fe::cudnn_dlhandle) {
    for (const char* lib : {"libcudnn.so.9", "libcudnn.so"}) {
      fe::cudnn_dlhandle = dlopen(lib, RTLD_NOW | RTLD_GLOBAL);
      if (fe::cudnn_dlhandle) break;
    }
    if (!fe::cudnn_dlhandle) {
      const char* err = dlerror();
      *why = std::string("libcudnn.so.9 not found (") + (err ? err : "?") + ")";
      return nullptr;
    }
  }
  const size_t version = fe::detail::get_backend_version();
  if (version < 90500) {
    *why = "cuDNN " + std::to_string(version) + " is older than 9.5";
    return nullptr;
  }
  std::unique_ptr<CudnnAttention> a(new CudnnAttention);
  a->impl_ = std::make_unique<Impl>();
  const cudnnStatus_t rc = fe::detail::create_handle(&a->impl_->handle);
  if (rc != CUDNN_STATUS_SUCCESS) {
    *why = std::string("cudnnCreate failed: ") + fe::detail::get_error_string(rc);
    return nullptr;
  }
  return a;
}

CudnnAttention::~CudnnAttention() {
  if (impl_ && impl_->handle) fe::detail::destroy_handle(impl_->handle);
}

int64_t CudnnAttention::graphs_built() const { return static_cast<int64_t>(impl_->graphs.size()); }

void CudnnAttention::set_autotune(bool on) { impl_->autotune = on; }

int64_t CudnnAttention::graphs_tuned() const { return impl_->tuned; }

std::string CudnnAttention::version() const {
  const size_t v = fe::detail::get_backend_version();
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

int64_t CudnnAttention::deterministic_workspace_bytes(const CudnnBatch& b, const AttnArgs& a) {
  // cuDNN 9.x's atomic-free backward on Hopper keeps dP in a bf16 workspace of
  // B x Hq x S x S (S rounded up to 64).
  const int64_t s = (b.s + 63) / 64 * 64;
  return b.b * a.hq * s * s * 2;
}

bool CudnnAttention::supports(const AttnArgs& a) const {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const int64_t row = static_cast<int64_t>(a.hq + 2 * a.hkv) * a.head_dim;
  return (a.head_dim == 64 || a.head_dim == 128) && aligned(a.qkv) &&
         a.n_tokens * row < (int64_t{1} << 31);
}

CudnnBatch CudnnAttention::make_batch(const AttnArgs& a, const int32_t* cu_seqlens, int64_t n_seqs,
                                      int64_t max_seqlen, Allocator& alloc, CUstream_st* stream) {
  CudnnBatch b;
  if (n_seqs * max_seqlen == a.n_tokens && max_seqlen % 64 == 0) {
    // Every sequence is max_seqlen long (no sequence is longer, and together they cover the
    // tokens): rows of one document each, as long-document data gives. (Lengths of whole 64-token
    // tiles only: the shapes measured.)
    b.ragged = false;
    b.b = n_seqs;
    b.s = max_seqlen;
    return b;
  }
  // Buckets keep the number of graphs small: powers of two for the sequence count and the
  // longest sequence (extra sequences have length 0; kernels skip what lies past a length).
  b.b = next_pow2(n_seqs, 1);
  b.s = next_pow2(max_seqlen, 64);
  b.offsets = Tensor::empty(alloc, {b.b + 3 * (b.b + 1)}, DType::kI32);
  launch_cudnn_offsets(cu_seqlens, n_seqs, b.b, static_cast<int64_t>(a.hq + 2 * a.hkv) * a.head_dim,
                       static_cast<int64_t>(a.hq) * a.head_dim, a.hq, b.offsets.data<int32_t>(),
                       stream);
  return b;
}

namespace {
Key key_for(const AttnArgs& a, const CudnnBatch& b, bool backward, bool deterministic) {
  Key k;
  std::memset(&k, 0, sizeof(k));  // padding bytes take part in the hash
  k.backward = backward;
  k.deterministic = deterministic;
  k.ragged = b.ragged;
  k.b = b.b;
  k.s = b.s;
  k.total = a.n_tokens;
  k.hq = a.hq;
  k.hkv = a.hkv;
  k.d = a.head_dim;
  k.window = a.window;
  k.scale = a.scale;
  return k;
}

void add_common(std::unordered_map<int64_t, void*>& pack, const AttnArgs& a, const CudnnBatch& b,
                void* qkv) {
  auto* base = static_cast<__nv_bfloat16*>(qkv);
  pack[kQ] = base;
  pack[kK] = base + static_cast<int64_t>(a.hq) * a.head_dim;
  pack[kV] = base + static_cast<int64_t>(a.hq + a.hkv) * a.head_dim;
  if (!b.ragged) return;
  int32_t* off = const_cast<int32_t*>(b.offsets.data<int32_t>());
  pack[kSeqQ] = off;
  pack[kSeqKV] = off;
  pack[kOffQkv] = off + b.b;
  pack[kOffO] = off + b.b + (b.b + 1);
  pack[kOffLse] = off + b.b + 2 * (b.b + 1);
}
}  // namespace

void CudnnAttention::forward(const AttnArgs& a, const CudnnBatch& b, void* out, float* lse,
                             Allocator& alloc, CUstream_st* stream) {
  Impl::Entry& g = impl_->graph(key_for(a, b, false, false));
  std::unordered_map<int64_t, void*> pack;
  add_common(pack, a, b, const_cast<void*>(a.qkv));
  pack[kO] = out;
  Tensor stats_bhsd;
  if (!b.ragged) stats_bhsd = Tensor::empty(alloc, {a.n_tokens, a.hq}, DType::kF32);
  pack[kStats] = b.ragged ? lse : stats_bhsd.data<float>();
  impl_->run(g, pack, alloc, stream);
  const size_t rows = static_cast<size_t>(a.n_tokens) * static_cast<size_t>(a.hq);
  mark_written(out, rows * static_cast<size_t>(a.head_dim) * 2, stream);  // bf16
  if (!b.ragged) {
    mark_written(stats_bhsd.raw(), rows * sizeof(float), stream);
    launch_lse_bhsd(stats_bhsd.data<float>(), b.b, b.s, a.hq, lse, false, stream);
  }
  mark_written(lse, rows * sizeof(float), stream);
  if (a.sinks)
    launch_sink_forward_fixup(out, lse, a.sinks, a.sinks_t, a.n_tokens, a.hq, a.head_dim, stream);
}

void CudnnAttention::backward(const AttnArgs& a, const CudnnBatch& b, const void* out,
                              const float* lse, const void* dout, void* dqkv, float* dsinks,
                              bool deterministic, Allocator& alloc, CUstream_st* stream) {
  Impl::Entry& g = impl_->graph(key_for(a, b, true, deterministic));
  std::unordered_map<int64_t, void*> pack;
  add_common(pack, a, b, const_cast<void*>(a.qkv));
  Tensor dout_scaled, lse_ns;
  const void* d_o = dout;
  const float* stats = lse;
  if (a.sinks) {
    dout_scaled = Tensor::empty(alloc, {a.n_tokens, a.hq, a.head_dim}, DType::kBF16);
    lse_ns = Tensor::empty(alloc, {a.n_tokens, a.hq}, DType::kF32);
    launch_sink_backward_prep(out, dout, lse, a.sinks, a.sinks_t, a.n_tokens, a.hq, a.head_dim,
                              dout_scaled.raw(), lse_ns.data<float>(), dsinks, alloc, stream);
    d_o = dout_scaled.raw();
    stats = lse_ns.data<float>();
  }
  Tensor stats_bhsd;
  if (!b.ragged) {
    stats_bhsd = Tensor::empty(alloc, {a.n_tokens, a.hq}, DType::kF32);
    launch_lse_bhsd(stats, b.b, b.s, a.hq, stats_bhsd.data<float>(), true, stream);
    stats = stats_bhsd.data<float>();
  }
  pack[kO] = const_cast<void*>(out);
  pack[kDO] = const_cast<void*>(d_o);
  pack[kStats] = const_cast<float*>(stats);
  auto* dbase = static_cast<__nv_bfloat16*>(dqkv);
  pack[kDQ] = dbase;
  pack[kDK] = dbase + static_cast<int64_t>(a.hq) * a.head_dim;
  pack[kDV] = dbase + static_cast<int64_t>(a.hq + a.hkv) * a.head_dim;
  impl_->run(g, pack, alloc, stream);
  mark_written(dqkv,
               static_cast<size_t>(a.n_tokens) * static_cast<size_t>(a.hq + 2 * a.hkv) *
                   static_cast<size_t>(a.head_dim) * 2,
               stream);
}

}  // namespace hp::cuda

#else  // built without the cuDNN frontend: the backend keeps its own kernels

#include "framework/core/error.h"

namespace hp::cuda {

struct CudnnAttention::Impl {};

std::unique_ptr<CudnnAttention> CudnnAttention::create(std::string* why) {
  *why = "built without the cuDNN frontend headers (see the CMake status line 'cuDNN attention')";
  return nullptr;
}
CudnnAttention::~CudnnAttention() = default;
std::string CudnnAttention::version() const { return ""; }
int64_t CudnnAttention::graphs_built() const { return 0; }
void CudnnAttention::set_autotune(bool) {}
int64_t CudnnAttention::graphs_tuned() const { return 0; }
int64_t CudnnAttention::deterministic_workspace_bytes(const CudnnBatch&, const AttnArgs&) {
  return 0;
}
bool CudnnAttention::supports(const AttnArgs&) const { return false; }
CudnnBatch CudnnAttention::make_batch(const AttnArgs&, const int32_t*, int64_t, int64_t, Allocator&,
                                      CUstream_st*) {
  HP_FAIL(ErrorKind::kInternal, "cuDNN attention is not built in");
}
void CudnnAttention::forward(const AttnArgs&, const CudnnBatch&, void*, float*, Allocator&,
                             CUstream_st*) {
  HP_FAIL(ErrorKind::kInternal, "cuDNN attention is not built in");
}
void CudnnAttention::backward(const AttnArgs&, const CudnnBatch&, const void*, const float*,
                              const void*, void*, float*, bool, Allocator&, CUstream_st*) {
  HP_FAIL(ErrorKind::kInternal, "cuDNN attention is not built in");
}

}  // namespace hp::cuda

#endif
