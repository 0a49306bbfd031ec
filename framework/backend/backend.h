// The backend op interface: everything the model, optimizer and trainer compute goes through it.
//
// Two implementations: cpu/ (the fp32/fp64 reference, the oracle) and cuda/ (bf16 activations,
// fp32 accumulation). Every op runs on the backend's current compute stream, in issue order;
// streams are ordered by events only. The host waits for the device in five calls only, each
// counting one sync of its SyncCause (metadata, routing, offload, loss, other) in syncs():
// read_to_host, synchronize, event_synchronize, rebuild_metadata (reads max_seqlen back) and
// profile_end (waits for the profiled work). Which of them a training step makes:
// docs/design.md, "The sync budget of one training step". Under a link arbiter the driving
// thread may also wait for a copy-stream event to be issued (set_link_arbiter); that waits for
// no device work and counts none.
//
// Conventions for every op below:
//  - Tensors are contiguous, row-major, on this backend's device (ids/indices int32).
//  - "Activation" tensors have dtype act_dtype(); parameters, gradients, optimizer state and
//    scalar accumulators have master_dtype(); the CPU backend runs with act == master (f32, or
//    f64 for finite-difference tests).
//  - Outputs are written unless marked "+=" (accumulated into). Output tensors are allocated by
//    the caller with the documented shapes.
//  - All ops are deterministic: the same inputs give bitwise-identical outputs.
// Argument contracts: each op is a public non-virtual function that checks what its comment
// below states (shapes, sizes, argument ranges, which tensors may alias), once for every backend,
// before any work, throwing an Error that names the op, the tensor and the shape expected; then it
// calls the backend's implementation, the protected virtual do_<op>. An implementation checks
// only its own policy: dtypes, devices, limits of its kernels, and on the host the values of
// index tensors.
// Thread safety: one host thread drives a backend instance.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "framework/backend/profile.h"
#include "framework/core/fp8.h"
#include "framework/core/sync_counter.h"
#include "framework/core/tensor.h"
#include "framework/data/packed_batch.h"

namespace hp {

class LinkArbiter;         // framework/backend/link_arbiter.h
enum class CopyDirection;  // framework/backend/link_arbiter.h

// The device-resident view of a PackedBatch, uploaded once per batch (no sync) and read by every
// layer.
struct BatchMeta {
  Tensor inputs;      // [N] i32
  Tensor targets;     // [N] i32, -1 ignored
  Tensor positions;   // [N] i32
  Tensor cu_seqlens;  // [n_seqs+1] i32
  int64_t n_seqs = 0;
  int32_t max_seqlen = 0;
  std::shared_ptr<void> backend_extra;  // backend-private derived structures (e.g. tile maps)
};

// RoPE cos/sin tables, [max_positions, head_dim/2] each, master dtype, on the device. YaRN's
// attention factor is folded into both, so q and k rotated by the table carry it.
struct RopeTable {
  Tensor cos;
  Tensor sin;
};

struct AttentionShape {
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // key/value heads (GQA: n_heads % n_kv_heads == 0)
  int head_dim = 0;
  int window = 0;    // 0: full causal; W > 0: keys j with i - W < j <= i
  double scale = 0;  // usually 1/sqrt(head_dim)
};

enum class GluKind { kSwiGLU, kGptOss };
struct GluParams {
  GluKind kind = GluKind::kSwiGLU;
  double alpha = 1.702;  // GPT-OSS only
  double limit = 7.0;    // GPT-OSS only
};

struct AdamWParams {
  double lr = 0;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0;
  int64_t step = 1;         // 1-based, for bias correction
  double grad_scale = 1.0;  // multiplies the gradient first (global-norm clipping)
  // Check only (nonfinite=skip): when set, the op writes nothing to master, m, v or working; it
  // computes the same update with the same arithmetic and sets check_flag[0] (master dtype, on
  // this backend's device; never cleared by the op) to 1 if any new master, m or v value, or the
  // new master in working's dtype (when working is defined; only its dtype is read), would not be
  // finite.
  Tensor* check_flag = nullptr;
  // Gated update: when set, gate (f64, 2 elements, on this backend's device, as update_gate
  // writes it) is read by the device: gate[0] replaces grad_scale, and when gate[1] is 0 the op
  // writes nothing. The update can then be issued before the host has read the gradient norm.
  // Not with check_flag.
  const Tensor* gate = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual Device device() const = 0;
  virtual std::string name() const = 0;
  virtual DType act_dtype() const = 0;
  virtual DType master_dtype() const = 0;
  SyncCounter& syncs() { return syncs_; }

  // ---- step profiling (framework/backend/profile.h) ----------------------------------------
  // The phase and op family that work issued from now on belongs to; set through PhaseScope and
  // FamilyScope. Cheap when no profile is being collected.
  void mark(StepPhase phase, OpFamily family) {
    if (profiling_) on_mark(phase_, family_);
    phase_ = phase;
    family_ = family;
    if (profiling_) after_mark();
  }
  StepPhase phase() const { return phase_; }
  OpFamily op_family() const { return family_; }
  // Collects a StepProfile of the work issued between the two calls. profile_end waits for that
  // work to finish (one sync of cause other) and returns where its time went. The default
  // measures host time between marks, exact for a backend that computes on the calling thread.
  virtual void profile_begin();
  virtual StepProfile profile_end();

  // ---- memory -----------------------------------------------------------------------------
  virtual Allocator& allocator() = 0;
  // Most device memory in use at once since the backend started, in allocator blocks (0 on the
  // host backend).
  virtual int64_t device_peak_bytes() const { return 0; }
  Tensor empty(Shape shape, DType dtype) {
    return Tensor::empty(allocator(), std::move(shape), dtype);
  }
  Tensor zeros(Shape shape, DType dtype);
  // Every element of t (defined) = value.
  void fill(Tensor& t, double value);
  // t[i] = std * philox_normal(key, offset + i) (framework/core/rng.h), rounded to t's float
  // dtype: the same bits on every backend, so parameters are initialized where they live.
  void fill_normal(Tensor& t, uint64_t key, int64_t offset, double std);
  // Same dtype and numel; src and dst may live on different devices (stream-ordered, no sync).
  void copy(const Tensor& src, Tensor& dst);
  // Same numel, same device, any float dtypes (rounding to nearest even).
  void convert(const Tensor& src, Tensor& dst);
  // New device tensor holding a host tensor's contents (no sync).
  Tensor upload(const Tensor& host);
  // Blocking read into a host tensor of src's dtype and numel; counts one sync of `cause`.
  void read_to_host(const Tensor& src, Tensor& host_dst, SyncCause cause);
  // Waits for all issued work; counts one sync of `cause`.
  virtual void synchronize(SyncCause cause) = 0;

  // ---- streams and events ------------------------------------------------------------------
  // Ops run on the current stream (set_stream; compute by default). The copy stream carries
  // offload/reload traffic and the comm stream collectives; events order them, and only
  // event_synchronize blocks the host (counting one sync of its cause). A backend that executes
  // on the host in issue order (cpu) has every stream on the host thread: events are complete
  // when recorded, and these defaults are exact for it.
  enum class StreamKind { kCompute, kCopy, kComm };
  struct Event {
    virtual ~Event() = default;
  };
  virtual void set_stream(StreamKind s) { stream_ = s; }
  StreamKind stream() const { return stream_; }
  virtual std::shared_ptr<Event> record_event(StreamKind s) { return std::make_shared<Event>(); }
  virtual void wait_event(StreamKind waiter, const Event& e) {}
  virtual void event_synchronize(const Event& e, SyncCause cause) { syncs_.add(cause); }

  // ---- host staging memory and the host link (optional; defaults fit every backend) ----------
  // Host memory of `bytes` for asynchronous copies with this device (page-locked on the GPU),
  // owned by the returned storage; null when it cannot be had (the caller falls back to pageable
  // memory). Called at start, never on the hot path. Default: ordinary host memory.
  virtual std::shared_ptr<Storage> pinned_host_storage(size_t bytes);
  // Paces copy-stream copies to a simulated host link of `gbps` GB/s (1e9 bytes/s; 0 = as fast
  // as memory allows). Only a backend whose device memory is host memory simulates (cpu);
  // others ignore it.
  virtual void set_simulated_link_gbps(double gbps) {}
  // The device's PCI bus id ("0000:1b:00.0"), which locates its host link; "" for a backend
  // without one (cpu).
  virtual std::string pci_bus_id() const { return ""; }
  // Host-link arbitration (docs/architecture.md, "Rule 2: the host link is shared fairly").
  // With an arbiter set, every copy on the copy stream is cut into chunks of at most
  // arbiter->chunk_bytes(); each chunk is issued only with a grant of its direction and
  // released once it has completed. Grants are waited for by a
  // thread of the backend that issues the copy stream's work in order (cpu: the copy worker),
  // never by the thread that drives the backend, which blocks only where it waits for a
  // copy-stream event that has not been issued yet (the event then waits for the grants of the
  // copies before it). The same bytes move in the same stream order, so results do not change.
  // While an arbiter is set, only copies and events may go on the copy stream. Setting one
  // (or null, to detach) first waits until the copy stream's work has been issued and has
  // completed; the arbiter must stay alive until it is detached or the backend is destroyed.
  virtual void set_link_arbiter(LinkArbiter* arbiter) {}
  // copy(), labelled with the direction it crosses the host link in (kReload: host -> device):
  // the label an arbiter grants its chunks under. A plain copy() on the copy stream counts as a
  // reload when its destination is device memory, else as an offload (on the cpu backend, whose
  // device memory is host memory, always an offload). Same dtype and numel.
  void copy_over_link(const Tensor& src, Tensor& dst, CopyDirection dir);

  // ---- packed batch metadata (rule 1) --------------------------------------------------------
  // inputs, targets and positions of one length N; cu_seqlens runs from 0 to N, never
  // decreasing.
  BatchMeta upload_batch(const PackedBatch& batch);
  // The per-layer baseline: rebuilds cu_seqlens from positions (1-d) on the device and reads
  // max_seqlen back. Counts one sync of cause metadata.
  void rebuild_metadata(BatchMeta& meta);

  // ---- dense math ---------------------------------------------------------------------------
  // c = alpha * op(a) @ op(b) + beta * c, 2-D: op(a) [M,K], op(b) [K,N], c [M,N]. op(x) = x^T
  // when the flag is set.
  void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, double alpha,
            double beta);
  // c = op(a) @ op(b) + bias[N] on every row, 2-D. Default: gemm, then add_bias; a backend may
  // fuse the two (rounding once where the default rounds twice).
  void gemm_bias(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                 const Tensor& bias);
  // c = op(a) @ op(b) (+ bias[N] on every row where bias is defined) + r, 2-D, r of c's shape and
  // dtype and not aliasing c: a layer's output onto its residual. Default: gemm or gemm_bias,
  // then add; a backend may fuse them (reading r in the product's epilogue, rounding once).
  void gemm_add(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& r,
                Tensor& c, const Tensor& bias);
  // A group of products that share the transposes and beta, such as the experts of a MoE layer:
  // for each problem, c = op(a) @ op(b) + beta * c (shapes as gemm), then + bias[N] where bias
  // is defined (beta must be 0 then; as gemm_bias). The c's must not overlap. The backend may
  // run the problems in any order or at once (deterministic all the same). Default: one after
  // another.
  struct GemmProblem {
    Tensor a, b, c, bias;
  };
  void gemm_group(const std::vector<GemmProblem>& problems, bool trans_a, bool trans_b,
                  double beta);
  // ---- FP8 GEMMs (docs/design.md, "FP8 training"; numerics in framework/core/fp8.h) ---------
  // How the two operands of an FP8 product are quantized, each along the contraction dimension
  // K of op(a) [M,K] and op(b) [K,N]: the recipe and each operand's role (kBlock128: kData 1x128
  // blocks along K, kWeight 128x128 tiles of the stored matrix, the same tiles whether it is
  // used transposed or not; kMx32: 1x32 blocks along K for both). The products of a layer:
  // forward y = x W and input gradient dX = dY W^T take {kData, kWeight}; weight gradient
  // dW = X^T dY takes {kData, kData}, both blocked along the token dimension.
  struct Fp8Gemm {
    fp8::Recipe recipe = fp8::Recipe::kBlock128;
    fp8::Role a = fp8::Role::kData;
    fp8::Role b = fp8::Role::kWeight;
  };
  // c = Q(op(a)) @ Q(op(b)) + beta * c (+ bias[N] on every row where bias is defined) (+ r where
  // r is defined), 2-D, shapes as gemm; Q quantizes to E4M3 with the spec's block scales. With a
  // bias or r, beta must be 0; r has c's shape and dtype and does not alias c. A backend without
  // FP8 GEMMs fails (the options refuse precision=fp8 for it first). CPU: the reference
  // emulation, each block's products summed exactly, the scaled block sums accumulated in fp64,
  // beta * c, bias and r added, and the result rounded once to c's dtype.
  void gemm_fp8(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                double beta, const Tensor& bias, const Tensor& r, const Fp8Gemm& spec);
  // Whether gemm_fp8 and gemm_fp8_group run on this backend (the model refuses precision=fp8
  // where they do not, naming the key). Default: false; the CPU reference: true.
  virtual bool has_fp8_gemms() const { return false; }
  // The recipe this backend's FP8 GEMMs take (the model's specs carry it; asked only where
  // has_fp8_gemms() is true). Default: kBlock128 (Hopper's); the CPU reference emulates any.
  virtual fp8::Recipe fp8_recipe() const { return fp8::Recipe::kBlock128; }
  // gemm_group's problems (same rules, biases included) as FP8 products of one spec. Default:
  // gemm_fp8 one problem after another.
  void gemm_fp8_group(const std::vector<GemmProblem>& problems, bool trans_a, bool trans_b,
                      double beta, const Fp8Gemm& spec);
  // Quantized copies of weights that FP8 products will take as their b operand (gemm_fp8 and
  // gemm_fp8_group under `spec`, whether op(b) is W or W^T), made now and kept until
  // release_fp8_weights(): a later product whose b is one of them (the same storage, shape and
  // dtype, `spec`'s recipe) takes the held codes instead of quantizing it again, bit for bit the
  // same operand. The caller must not write a held weight before releasing it. Each weight is
  // 2-D, f32 or bf16, on this backend. Default (and the CPU reference): nothing is held, every
  // product quantizes its operands.
  void hold_fp8_weights(const std::vector<Tensor>& weights, const Fp8Gemm& spec);
  // Frees every held copy (a no-op where none is held).
  void release_fp8_weights() { do_release_fp8_weights(); }
  // y[M,N] += b[N] broadcast over rows.
  void add_bias(Tensor& y, const Tensor& bias);
  // db[N] += sum over rows of dy[M,N].
  void bias_grad(const Tensor& dy, Tensor& db);
  // bias_grad over row segments of one dy[M,N], in order: for each, its db[N] += sum over rows
  // [begin, begin + rows) of dy (0 <= begin, 0 <= rows, begin + rows <= M), as
  // bias_grad(dy.slice(begin, begin + rows), db) gives it. A backend may run them in few launches
  // (the MoE layer has one segment per expert).
  struct RowSegment {
    int64_t begin = 0, rows = 0;
    Tensor db;
  };
  void bias_grad_segments(const Tensor& dy, const std::vector<RowSegment>& segments);
  // out = a + b, one numel (out may alias a or b).
  void add(const Tensor& a, const Tensor& b, Tensor& out);
  // y += alpha * x, one numel.
  void axpy(double alpha, const Tensor& x, Tensor& y);

  // ---- normalization and position ---------------------------------------------------------
  // Rows of x[M,D] (D > 0, eps >= 0): y[M,D] = x / sqrt(mean(x^2) + eps) * w[D]; rstd[M] keeps
  // 1/sqrt(...) for backward.
  void rmsnorm_fwd(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd);
  // x[M,D], w[D], rstd[M], dy[M,D]: dx[M,D] written (accumulate_dx: dx += , the residual's
  // gradient folded in; dx may alias dy); dw[D] += .
  void rmsnorm_bwd(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                   Tensor& dx, Tensor& dw, bool accumulate_dx);
  // In place on the first `n_rot_heads` heads (0 <= n_rot_heads <= H) of x[N,H,D], D even:
  // half-split rotation by the angle of positions[N], read from table.cos and table.sin, each
  // [P, D/2]. inverse = true applies the transpose (the backward of the forward rotation).
  void rope(Tensor& x, int n_rot_heads, const Tensor& positions, const RopeTable& table,
            bool inverse);

  // Qwen3's per-head RMSNorm of q and k inside qkv[N, Hq+2Hkv, D] (Hq, Hkv > 0): q heads use
  // qw[D], k heads kw[D]; out[N, Hq+2Hkv, D] gets the normalized q and k heads and a copy of the
  // v heads; rstd[N, Hq+Hkv] (master dtype).
  void qk_norm_fwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw, int64_t n_heads,
                   int64_t n_kv_heads, double eps, Tensor& out, Tensor& rstd);
  // rstd[N, Hq+Hkv], dout[N, Hq+2Hkv, D]: din[N, Hq+2Hkv, D] written (v heads: dout copied; din
  // may alias dout); dqw[D] += , dkw[D] += .
  void qk_norm_bwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw, int64_t n_heads,
                   int64_t n_kv_heads, const Tensor& rstd, const Tensor& dout, Tensor& din,
                   Tensor& dqw, Tensor& dkw);
  // qk_norm_fwd, then rope of out's q and k heads (n_rot_heads = Hq+Hkv, forward): the same
  // arguments as the two ops (D even; positions[N]; table.cos, table.sin [P, D/2]); out must not
  // overlap qkv. Default: those two ops; a backend may fuse them (the same bits).
  void qk_norm_rope_fwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw, int64_t n_heads,
                        int64_t n_kv_heads, double eps, const Tensor& positions,
                        const RopeTable& table, Tensor& out, Tensor& rstd);
  // Its backward: rope inverse of dout's q and k heads, then qk_norm_bwd (din written; dqw[D] += ,
  // dkw[D] += ). din may be dout itself (in place), else must not overlap it, and dout is left
  // as it was; din must not overlap qkv. Default: dout copied into din, rope inverse and
  // qk_norm_bwd in place there; a backend may fuse them (the same bits).
  void qk_norm_rope_bwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw, int64_t n_heads,
                        int64_t n_kv_heads, const Tensor& rstd, const Tensor& positions,
                        const RopeTable& table, const Tensor& dout, Tensor& din, Tensor& dqw,
                        Tensor& dkw);

  // ---- attention ----------------------------------------------------------------------------
  // qkv[N, Hq + 2*Hkv, D] holds q heads, then k heads, then v heads (shape: Hq, Hkv, D > 0, Hq a
  // multiple of Hkv, window >= 0, a finite scale). Causal within each sequence of meta (never
  // across; meta.positions of N entries, meta.cu_seqlens of meta.n_seqs + 1), optional sliding
  // window, optional sinks[Hq] (learned logits that join the softmax denominator). out[N,Hq,D];
  // lse[N,Hq] (master dtype) = log(exp(sink) + sum exp(z)).
  void attention_fwd(const Tensor& qkv, const Tensor& sinks, const BatchMeta& meta,
                     const AttentionShape& shape, Tensor& out, Tensor& lse);
  // out[N,Hq,D], lse[N,Hq] and dout[N,Hq,D] as forward left them: dqkv[N, Hq+2Hkv, D] written
  // (not aliasing qkv); dsinks[Hq] += (ignored when sinks is undefined).
  void attention_bwd(const Tensor& qkv, const Tensor& sinks, const BatchMeta& meta,
                     const AttentionShape& shape, const Tensor& out, const Tensor& lse,
                     const Tensor& dout, Tensor& dqkv, Tensor& dsinks);

  // ---- feed-forward activations -------------------------------------------------------------
  // h[M, 2F] = [g | u] -> a[M, F]. SwiGLU: silu(g)*u. GPT-OSS: g=min(g,L), u=clamp(u,-L,L),
  // a = g*sigmoid(alpha*g)*(u+1).
  void glu_fwd(const Tensor& h, const GluParams& p, Tensor& a);
  // da[M, F]: dh[M, 2F] written.
  void glu_bwd(const Tensor& h, const Tensor& da, const GluParams& p, Tensor& dh);
  // glu_fwd, and a handed on quantized (`spec`'s data operand, as gemm_fp8 quantizes op(a) = a)
  // to the next gemm_fp8 call, which takes those codes where its op(a) is a (same storage,
  // shape and dtype, not transposed) instead of quantizing a; any other next FP8 product drops
  // them. glu_bwd_fp8 likewise for dh. Same bits as glu_fwd / glu_bwd followed by the product.
  // Default (and the CPU reference): glu_fwd / glu_bwd alone.
  void glu_fwd_fp8(const Tensor& h, const GluParams& p, Tensor& a, const Fp8Gemm& spec);
  void glu_bwd_fp8(const Tensor& h, const Tensor& da, const GluParams& p, Tensor& dh,
                   const Fp8Gemm& spec);

  // ---- mixture-of-experts routing (rule 3) --------------------------------------------------
  // For each row of logits[N,E]: the k largest (1 <= k <= E; ties: lower expert id first),
  // idx[N,k] in descending logit order, w[N,k] = softmax over the k picked logits.
  void router_topk(const Tensor& logits, int k, Tensor& idx, Tensor& w);
  // idx[N,k], w[N,k], dw[N,k]: dlogits[N,E] written: the softmax-over-picked backward at the
  // picked entries, 0 elsewhere.
  void router_topk_bwd(const Tensor& idx, const Tensor& w, const Tensor& dw, Tensor& dlogits);
  // Load-balancing loss coef*E*sum_e f_e*P_e with f_e = counts[e]/(N*k) (counts[E], k >= 1) and
  // P_e the mean over the N rows of softmax(logits[N,E])_e. loss[1] += value; dlogits[N,E] += its
  // gradient.
  void router_aux_loss(const Tensor& logits, const Tensor& counts, int k, double coef, Tensor& loss,
                       Tensor& dlogits);
  // counts[n_bins] = number of each id in ids[M] (n_bins >= 0).
  void histogram(const Tensor& ids, int n_bins, Tensor& counts);
  // counts[n] -> offsets[n+1]: offsets[0] = 0, offsets[i+1] = offsets[i] + counts[i].
  void exclusive_scan(const Tensor& counts, Tensor& offsets);
  // Stable sort of assignments a = 0..M-1 by ids[M], using offsets[n_bins+1] from
  // exclusive_scan: sorted_to_assign[j] = a at sorted position j; assign_to_sorted[a] = j (both
  // [M]).
  void sort_by_id(const Tensor& ids, const Tensor& offsets, Tensor& sorted_to_assign,
                  Tensor& assign_to_sorted);
  // out[j] = x[sorted_to_assign[j] / k]   (x[N,D], sorted_to_assign[M], out[M,D], k >= 1).
  void permute_rows(const Tensor& x, const Tensor& sorted_to_assign, int k, Tensor& out);
  // dx[N,D] = sum over j with sorted_to_assign[j]/k == t of dout[j]   (dout[M,D], k >= 1); a
  // row no j names is zero. Written, not added to: dx need not be initialized.
  void permute_rows_bwd(const Tensor& dout, const Tensor& sorted_to_assign, int k, Tensor& dx);
  // out[t] = sum_s w[t,s] * y[assign_to_sorted[t*k+s]]   (y[M,D], w[N,k], assign_to_sorted[N*k],
  // out[N,D]).
  void unpermute_combine(const Tensor& y, const Tensor& assign_to_sorted, const Tensor& w,
                         Tensor& out);
  // dout[N,D]: dy[M,D] written (rows no assignment reads are zero); dw[N,k] written.
  // assign_to_sorted names each row of y once at most (sort_by_id's is a permutation).
  void unpermute_combine_bwd(const Tensor& dout, const Tensor& y, const Tensor& assign_to_sorted,
                             const Tensor& w, Tensor& dy, Tensor& dw);

  // ---- embedding and loss -------------------------------------------------------------------
  // out[N,D] = table[ids[t]]   (table[V,D], ids[N]).
  void embedding_fwd(const Tensor& table, const Tensor& ids, Tensor& out);
  // dtable[V,D] += scatter of dout[N,D] rows by ids[N].
  void embedding_bwd(const Tensor& dout, const Tensor& ids, Tensor& dtable);
  // Rows of logits[n,V] with targets[n] (-1: ignored). loss[1] += sum of -log softmax at the
  // target over valid rows; logits are overwritten by grad_scale * (softmax - onehot) for valid
  // rows and 0 for ignored rows.
  void cross_entropy(Tensor& logits, const Tensor& targets, double grad_scale, Tensor& loss);
  // cross_entropy, and the gradient it writes into logits handed on quantized (`spec`'s data
  // operand) to the next gemm_fp8 call as glu_fwd_fp8 hands on its output (the unembedding's
  // input gradient dlogits W^T takes it). Same bits as cross_entropy followed by the product.
  // Default (and the CPU reference): cross_entropy alone.
  void cross_entropy_fp8(Tensor& logits, const Tensor& targets, double grad_scale, Tensor& loss,
                         const Fp8Gemm& spec);

  // ---- optimizer ----------------------------------------------------------------------------
  // acc[1] += sum(x^2) (acc in master dtype).
  void sum_squares(const Tensor& x, Tensor& acc);
  // Decoupled-weight-decay Adam with bias correction (p.step >= 1) on master/m/v; grad, m and v
  // have master's shape; grad is scaled by p.grad_scale first. When `working` is defined (of
  // master's numel) it receives master converted to its dtype. With p.check_flag set (at least
  // one element): the check-only mode above (nothing written but the flag).
  void adamw(Tensor& master, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p,
             Tensor& working);
  // acc[1] += the sum over every x of xs (each defined) of sum(x^2). Deterministic; a backend may
  // add in an order of its own (not necessarily the bits of sum_squares over each x in turn).
  // `unwritten`, when not empty, has one flag per x: a flagged x counts as zeros (its memory is
  // not read), with the bits its zeros would give. Default: sum_squares over each unflagged x in
  // turn.
  void sum_squares_many(const std::vector<Tensor>& xs, Tensor& acc,
                        const std::vector<char>& unwritten = {});
  // The gate of a gated update (AdamWParams::gate), computed on the device: gate[0] =
  // clip_coefficient(sqrt(sum of sumsq's elements, added in order in f64), max_norm)
  // (framework/core/clip.h: the host's arithmetic, the same bits), gate[1] = 1 when every element
  // of `checked` is finite, else 0. checked and sumsq: master dtype, at least one element each;
  // gate: f64 [2].
  void update_gate(const Tensor& checked, const Tensor& sumsq, double max_norm, Tensor& gate);
  // One tensor of adamw_many: adamw's master, grad, m, v and working (undefined: none), and
  // whether the update's weight decay applies to it. grad_zero: the gradient is zero and grad's
  // memory is not read (the bits of adamw with a zero-filled grad).
  struct AdamWEntry {
    Tensor master, grad, m, v, working;
    bool weight_decay = false;
    bool grad_zero = false;
  };
  // adamw on every entry with p's hyperparameters (p.weight_decay where the entry's
  // weight_decay is set, else 0), each entry's results bitwise those of adamw on it alone. Each
  // entry holds adamw's contract; no tensor an entry writes (master, m, v, working) overlaps a
  // tensor of another entry. No check-only mode (p.check_flag must be null). A backend may update
  // the entries in any order or at once. Default: adamw on each entry in turn.
  void adamw_many(const std::vector<AdamWEntry>& entries, const AdamWParams& p);

 protected:
  // ---- the implementations ------------------------------------------------------------------
  // Each is called by the public op of its name once the op's contract (above) holds; it checks
  // its own dtype and device policy. The defaults compose other public ops.
  virtual void do_fill(Tensor& t, double value) = 0;
  virtual void do_fill_normal(Tensor& t, uint64_t key, int64_t offset, double std) = 0;
  virtual void do_copy(const Tensor& src, Tensor& dst) = 0;
  virtual void do_convert(const Tensor& src, Tensor& dst) = 0;
  virtual void do_read_to_host(const Tensor& src, Tensor& host_dst, SyncCause cause) = 0;
  // Default: do_copy.
  virtual void do_copy_over_link(const Tensor& src, Tensor& dst, CopyDirection dir);
  virtual BatchMeta do_upload_batch(const PackedBatch& batch) = 0;
  virtual void do_rebuild_metadata(BatchMeta& meta) = 0;
  virtual void do_gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                       double alpha, double beta) = 0;
  virtual void do_gemm_bias(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                            const Tensor& bias);
  virtual void do_gemm_add(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                           const Tensor& r, Tensor& c, const Tensor& bias);
  virtual void do_gemm_group(const std::vector<GemmProblem>& problems, bool trans_a, bool trans_b,
                             double beta);
  // Default: an error (a backend without FP8 GEMMs).
  virtual void do_gemm_fp8(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                           double beta, const Tensor& bias, const Tensor& r, const Fp8Gemm& spec);
  virtual void do_gemm_fp8_group(const std::vector<GemmProblem>& problems, bool trans_a,
                                 bool trans_b, double beta, const Fp8Gemm& spec);
  virtual void do_hold_fp8_weights(const std::vector<Tensor>&, const Fp8Gemm&) {}
  virtual void do_release_fp8_weights() {}
  virtual void do_add_bias(Tensor& y, const Tensor& bias) = 0;
  virtual void do_bias_grad(const Tensor& dy, Tensor& db) = 0;
  virtual void do_bias_grad_segments(const Tensor& dy, const std::vector<RowSegment>& segments);
  virtual void do_add(const Tensor& a, const Tensor& b, Tensor& out) = 0;
  virtual void do_axpy(double alpha, const Tensor& x, Tensor& y) = 0;
  virtual void do_rmsnorm_fwd(const Tensor& x, const Tensor& w, double eps, Tensor& y,
                              Tensor& rstd) = 0;
  virtual void do_rmsnorm_bwd(const Tensor& x, const Tensor& w, const Tensor& rstd,
                              const Tensor& dy, Tensor& dx, Tensor& dw, bool accumulate_dx) = 0;
  virtual void do_rope(Tensor& x, int n_rot_heads, const Tensor& positions, const RopeTable& table,
                       bool inverse) = 0;
  // Default: an error (a backend without qk_norm).
  virtual void do_qk_norm_fwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw,
                              int64_t n_heads, int64_t n_kv_heads, double eps, Tensor& out,
                              Tensor& rstd);
  virtual void do_qk_norm_bwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw,
                              int64_t n_heads, int64_t n_kv_heads, const Tensor& rstd,
                              const Tensor& dout, Tensor& din, Tensor& dqw, Tensor& dkw);
  // Default: the public ops each is documented to compose (above).
  virtual void do_qk_norm_rope_fwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw,
                                   int64_t n_heads, int64_t n_kv_heads, double eps,
                                   const Tensor& positions, const RopeTable& table, Tensor& out,
                                   Tensor& rstd);
  virtual void do_qk_norm_rope_bwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw,
                                   int64_t n_heads, int64_t n_kv_heads, const Tensor& rstd,
                                   const Tensor& positions, const RopeTable& table,
                                   const Tensor& dout, Tensor& din, Tensor& dqw, Tensor& dkw);
  virtual void do_attention_fwd(const Tensor& qkv, const Tensor& sinks, const BatchMeta& meta,
                                const AttentionShape& shape, Tensor& out, Tensor& lse) = 0;
  virtual void do_attention_bwd(const Tensor& qkv, const Tensor& sinks, const BatchMeta& meta,
                                const AttentionShape& shape, const Tensor& out, const Tensor& lse,
                                const Tensor& dout, Tensor& dqkv, Tensor& dsinks) = 0;
  virtual void do_glu_fwd(const Tensor& h, const GluParams& p, Tensor& a) = 0;
  virtual void do_glu_bwd(const Tensor& h, const Tensor& da, const GluParams& p, Tensor& dh) = 0;
  virtual void do_glu_fwd_fp8(const Tensor& h, const GluParams& p, Tensor& a, const Fp8Gemm&) {
    do_glu_fwd(h, p, a);
  }
  virtual void do_glu_bwd_fp8(const Tensor& h, const Tensor& da, const GluParams& p, Tensor& dh,
                              const Fp8Gemm&) {
    do_glu_bwd(h, da, p, dh);
  }
  virtual void do_router_topk(const Tensor& logits, int k, Tensor& idx, Tensor& w) = 0;
  virtual void do_router_topk_bwd(const Tensor& idx, const Tensor& w, const Tensor& dw,
                                  Tensor& dlogits) = 0;
  virtual void do_router_aux_loss(const Tensor& logits, const Tensor& counts, int k, double coef,
                                  Tensor& loss, Tensor& dlogits) = 0;
  virtual void do_histogram(const Tensor& ids, int n_bins, Tensor& counts) = 0;
  virtual void do_exclusive_scan(const Tensor& counts, Tensor& offsets) = 0;
  virtual void do_sort_by_id(const Tensor& ids, const Tensor& offsets, Tensor& sorted_to_assign,
                             Tensor& assign_to_sorted) = 0;
  virtual void do_permute_rows(const Tensor& x, const Tensor& sorted_to_assign, int k,
                               Tensor& out) = 0;
  virtual void do_permute_rows_bwd(const Tensor& dout, const Tensor& sorted_to_assign, int k,
                                   Tensor& dx) = 0;
  virtual void do_unpermute_combine(const Tensor& y, const Tensor& assign_to_sorted,
                                    const Tensor& w, Tensor& out) = 0;
  virtual void do_unpermute_combine_bwd(const Tensor& dout, const Tensor& y,
                                        const Tensor& assign_to_sorted, const Tensor& w, Tensor& dy,
                                        Tensor& dw) = 0;
  virtual void do_embedding_fwd(const Tensor& table, const Tensor& ids, Tensor& out) = 0;
  virtual void do_embedding_bwd(const Tensor& dout, const Tensor& ids, Tensor& dtable) = 0;
  virtual void do_cross_entropy(Tensor& logits, const Tensor& targets, double grad_scale,
                                Tensor& loss) = 0;
  virtual void do_cross_entropy_fp8(Tensor& logits, const Tensor& targets, double grad_scale,
                                    Tensor& loss, const Fp8Gemm&) {
    do_cross_entropy(logits, targets, grad_scale, loss);
  }
  virtual void do_sum_squares(const Tensor& x, Tensor& acc) = 0;
  virtual void do_update_gate(const Tensor& checked, const Tensor& sumsq, double max_norm,
                              Tensor& gate) = 0;
  virtual void do_adamw(Tensor& master, const Tensor& grad, Tensor& m, Tensor& v,
                        const AdamWParams& p, Tensor& working) = 0;
  virtual void do_sum_squares_many(const std::vector<Tensor>& xs, Tensor& acc,
                                   const std::vector<char>& unwritten);
  virtual void do_adamw_many(const std::vector<AdamWEntry>& entries, const AdamWParams& p);

  // Called on a mark while profiling: before the change with the marks being left, and after it.
  virtual void on_mark(StepPhase phase, OpFamily family);
  virtual void after_mark() {}

  SyncCounter syncs_;
  StreamKind stream_ = StreamKind::kCompute;
  bool profiling_ = false;
  StepPhase phase_ = StepPhase::kOther;
  OpFamily family_ = OpFamily::kOther;

 private:
  // Host-time profile (the default implementation).
  double host_t0_ = 0, host_last_ = 0;
  StepProfile host_profile_;
  // The addresses, sizes and dtypes of the last adamw_many list whose contract was checked: the
  // optimizer passes the same list every step, and its checks (an address sort among them)
  // would otherwise hold back the update's first launch on the host each step.
  std::vector<int64_t> adamw_many_checked_;
};

// The CPU reference backend; dtype is kF32 (training) or kF64 (gradient checks).
std::unique_ptr<Backend> make_cpu_backend(DType dtype = DType::kF32);

}  // namespace hp
