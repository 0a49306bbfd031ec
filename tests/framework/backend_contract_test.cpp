// The argument contracts of the backend interface (backend.h, "Argument contracts"): every op with
// a documented shape, size, range or aliasing rule refuses a call that breaks it at the interface,
// naming the op and the tensor, before the backend's implementation is reached. A recording
// backend shows which implementations were called; the CPU backend shows that the error it gives
// is the interface's.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/backend/link_arbiter.h"
#include "framework/core/error.h"
#include "framework/model/model.h"

namespace hp {
namespace {

// Records the name of every implementation called; computes nothing.
class RecordingBackend final : public Backend {
 public:
  std::vector<std::string> calls;

  Device device() const override { return Device::kCPU; }
  std::string name() const override { return "recording"; }
  DType act_dtype() const override { return DType::kF32; }
  DType master_dtype() const override { return DType::kF32; }
  Allocator& allocator() override { return host_allocator(); }
  void synchronize(SyncCause) override { calls.push_back("synchronize"); }

 protected:
  void do_fill(Tensor&, double) override { calls.push_back("fill"); }
  void do_fill_normal(Tensor&, uint64_t, int64_t, double) override {
    calls.push_back("fill_normal");
  }
  void do_copy(const Tensor&, Tensor&) override { calls.push_back("copy"); }
  void do_convert(const Tensor&, Tensor&) override { calls.push_back("convert"); }
  void do_read_to_host(const Tensor&, Tensor&, SyncCause) override {
    calls.push_back("read_to_host");
  }
  void do_copy_over_link(const Tensor&, Tensor&, CopyDirection) override {
    calls.push_back("copy_over_link");
  }
  BatchMeta do_upload_batch(const PackedBatch&) override {
    calls.push_back("upload_batch");
    return {};
  }
  void do_rebuild_metadata(BatchMeta&) override { calls.push_back("rebuild_metadata"); }
  void do_gemm(const Tensor&, bool, const Tensor&, bool, Tensor&, double, double) override {
    calls.push_back("gemm");
  }
  void do_gemm_bias(const Tensor&, bool, const Tensor&, bool, Tensor&, const Tensor&) override {
    calls.push_back("gemm_bias");
  }
  void do_gemm_add(const Tensor&, bool, const Tensor&, bool, const Tensor&, Tensor&,
                   const Tensor&) override {
    calls.push_back("gemm_add");
  }
  void do_gemm_group(const std::vector<GemmProblem>&, bool, bool, double) override {
    calls.push_back("gemm_group");
  }
  void do_gemm_fp8(const Tensor&, bool, const Tensor&, bool, Tensor&, double, const Tensor&,
                   const Tensor&, const Fp8Gemm&) override {
    calls.push_back("gemm_fp8");
  }
  void do_gemm_fp8_group(const std::vector<GemmProblem>&, bool, bool, double,
                         const Fp8Gemm&) override {
    calls.push_back("gemm_fp8_group");
  }
  void do_add_bias(Tensor&, const Tensor&) override { calls.push_back("add_bias"); }
  void do_bias_grad(const Tensor&, Tensor&) override { calls.push_back("bias_grad"); }
  void do_bias_grad_segments(const Tensor&, const std::vector<RowSegment>&) override {
    calls.push_back("bias_grad_segments");
  }
  void do_add(const Tensor&, const Tensor&, Tensor&) override { calls.push_back("add"); }
  void do_axpy(double, const Tensor&, Tensor&) override { calls.push_back("axpy"); }
  void do_rmsnorm_fwd(const Tensor&, const Tensor&, double, Tensor&, Tensor&) override {
    calls.push_back("rmsnorm_fwd");
  }
  void do_rmsnorm_bwd(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&,
                      bool) override {
    calls.push_back("rmsnorm_bwd");
  }
  void do_rope(Tensor&, int, const Tensor&, const RopeTable&, bool) override {
    calls.push_back("rope");
  }
  void do_qk_norm_fwd(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, double,
                      Tensor&, Tensor&) override {
    calls.push_back("qk_norm_fwd");
  }
  void do_qk_norm_bwd(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, const Tensor&,
                      const Tensor&, Tensor&, Tensor&, Tensor&) override {
    calls.push_back("qk_norm_bwd");
  }
  void do_qk_norm_rope_fwd(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, double,
                           const Tensor&, const RopeTable&, Tensor&, Tensor&) override {
    calls.push_back("qk_norm_rope_fwd");
  }
  void do_qk_norm_rope_bwd(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                           const Tensor&, const Tensor&, const RopeTable&, const Tensor&, Tensor&,
                           Tensor&, Tensor&) override {
    calls.push_back("qk_norm_rope_bwd");
  }
  void do_attention_fwd(const Tensor&, const Tensor&, const BatchMeta&, const AttentionShape&,
                        Tensor&, Tensor&) override {
    calls.push_back("attention_fwd");
  }
  void do_attention_bwd(const Tensor&, const Tensor&, const BatchMeta&, const AttentionShape&,
                        const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) override {
    calls.push_back("attention_bwd");
  }
  void do_glu_fwd(const Tensor&, const GluParams&, Tensor&) override { calls.push_back("glu_fwd"); }
  void do_glu_bwd(const Tensor&, const Tensor&, const GluParams&, Tensor&) override {
    calls.push_back("glu_bwd");
  }
  void do_router_topk(const Tensor&, int, Tensor&, Tensor&) override {
    calls.push_back("router_topk");
  }
  void do_router_topk_bwd(const Tensor&, const Tensor&, const Tensor&, Tensor&) override {
    calls.push_back("router_topk_bwd");
  }
  void do_router_aux_loss(const Tensor&, const Tensor&, int, double, Tensor&, Tensor&) override {
    calls.push_back("router_aux_loss");
  }
  void do_histogram(const Tensor&, int, Tensor&) override { calls.push_back("histogram"); }
  void do_exclusive_scan(const Tensor&, Tensor&) override { calls.push_back("exclusive_scan"); }
  void do_sort_by_id(const Tensor&, const Tensor&, Tensor&, Tensor&) override {
    calls.push_back("sort_by_id");
  }
  void do_permute_rows(const Tensor&, const Tensor&, int, Tensor&) override {
    calls.push_back("permute_rows");
  }
  void do_permute_rows_bwd(const Tensor&, const Tensor&, int, Tensor&) override {
    calls.push_back("permute_rows_bwd");
  }
  void do_unpermute_combine(const Tensor&, const Tensor&, const Tensor&, Tensor&) override {
    calls.push_back("unpermute_combine");
  }
  void do_unpermute_combine_bwd(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&,
                                Tensor&) override {
    calls.push_back("unpermute_combine_bwd");
  }
  void do_embedding_fwd(const Tensor&, const Tensor&, Tensor&) override {
    calls.push_back("embedding_fwd");
  }
  void do_embedding_bwd(const Tensor&, const Tensor&, Tensor&) override {
    calls.push_back("embedding_bwd");
  }
  void do_cross_entropy(Tensor&, const Tensor&, double, Tensor&) override {
    calls.push_back("cross_entropy");
  }
  void do_sum_squares(const Tensor&, Tensor&) override { calls.push_back("sum_squares"); }
  void do_update_gate(const Tensor&, const Tensor&, double, Tensor&) override {
    calls.push_back("update_gate");
  }
  void do_adamw(Tensor&, const Tensor&, Tensor&, Tensor&, const AdamWParams&, Tensor&) override {
    calls.push_back("adamw");
  }
};

Tensor f32(Shape s) { return Tensor::host(std::move(s), DType::kF32); }
Tensor i32(Shape s) { return Tensor::host(std::move(s), DType::kI32); }

// One call of an op: `valid` keeps its contract, `broken` breaks one rule of it.
struct Case {
  std::string op;        // the op, named in the error
  std::string fragment;  // what else the error names (the tensor, the rule)
  std::function<void(Backend&, bool valid)> call;
};

// A packed batch of two sequences, 3 and 2 tokens.
PackedBatch small_batch() {
  PackedBatch b;
  b.rows = 1;
  b.seq_len = 5;
  b.inputs = {1, 2, 3, 4, 5};
  b.targets = {2, 3, -1, 5, -1};
  b.positions = {0, 1, 2, 0, 1};
  b.cu_seqlens = {0, 3, 5};
  b.max_seqlen = 3;
  return b;
}

// The metadata upload_batch makes of small_batch, as tensors of the right shapes.
BatchMeta small_meta() {
  BatchMeta m;
  m.inputs = i32({5});
  m.targets = i32({5});
  m.positions = i32({5});
  m.cu_seqlens = i32({3});
  m.n_seqs = 2;
  m.max_seqlen = 3;
  return m;
}

std::vector<Case> cases() {
  // Shapes: M = 2 rows, N = 5 columns, K = 3; attention N = 5 tokens, Hq = 2, Hkv = 1, D = 4.
  std::vector<Case> c;
  c.push_back({"fill", "'t' is undefined", [](Backend& be, bool ok) {
                 Tensor t = ok ? f32({2}) : Tensor();
                 be.fill(t, 1.0);
               }});
  c.push_back({"fill_normal", "'t' is undefined", [](Backend& be, bool ok) {
                 Tensor t = ok ? f32({2}) : Tensor();
                 be.fill_normal(t, 1, 0, 1.0);
               }});
  c.push_back({"copy", "same dtype and numel", [](Backend& be, bool ok) {
                 Tensor dst = f32({ok ? 4 : 3});
                 be.copy(f32({4}), dst);
               }});
  c.push_back({"copy_over_link", "same dtype and numel", [](Backend& be, bool ok) {
                 Tensor dst = ok ? f32({4}) : i32({4});
                 be.copy_over_link(f32({4}), dst, CopyDirection::kReload);
               }});
  c.push_back({"convert", "differ in numel", [](Backend& be, bool ok) {
                 Tensor dst = Tensor::host({ok ? 4 : 5}, DType::kBF16);
                 be.convert(f32({4}), dst);
               }});
  c.push_back({"read_to_host", "same dtype and numel", [](Backend& be, bool ok) {
                 Tensor dst = f32({ok ? 4 : 2});
                 be.read_to_host(f32({4}), dst, SyncCause::kOther);
               }});
  c.push_back({"upload_batch", "they must match", [](Backend& be, bool ok) {
                 PackedBatch b = small_batch();
                 if (!ok) b.targets.pop_back();
                 be.upload_batch(b);
               }});
  c.push_back({"upload_batch", "cu_seqlens decreases", [](Backend& be, bool ok) {
                 PackedBatch b = small_batch();
                 if (!ok) b.cu_seqlens = {0, 4, 3, 5};
                 be.upload_batch(b);
               }});
  c.push_back({"rebuild_metadata", "'positions'", [](Backend& be, bool ok) {
                 BatchMeta m = small_meta();
                 if (!ok) m.positions = i32({5, 1});
                 be.rebuild_metadata(m);
               }});
  c.push_back({"gemm", "does not fit c", [](Backend& be, bool ok) {
                 Tensor c = f32({2, 5});
                 be.gemm(f32({2, 3}), false, f32({ok ? 3 : 4, 5}), false, c, 1, 0);
               }});
  c.push_back({"gemm", "does not fit c", [](Backend& be, bool ok) {
                 Tensor c = f32({2, ok ? 5 : 4});
                 be.gemm(f32({3, 2}), true, f32({5, 3}), true, c, 1, 0);
               }});
  c.push_back({"gemm_bias", "'bias'", [](Backend& be, bool ok) {
                 Tensor c = f32({2, 5});
                 be.gemm_bias(f32({2, 3}), false, f32({3, 5}), false, c, f32({ok ? 5 : 2}));
               }});
  c.push_back({"gemm_add", "must match c", [](Backend& be, bool ok) {
                 Tensor c = f32({2, 5});
                 be.gemm_add(f32({2, 3}), false, f32({3, 5}), false, f32({ok ? 2 : 5, ok ? 5 : 2}),
                             c, Tensor());
               }});
  c.push_back(
      {"gemm_add", "r must not alias c", [](Backend& be, bool ok) {
         Tensor c = f32({2, 5});
         be.gemm_add(f32({2, 3}), false, f32({3, 5}), false, ok ? f32({2, 5}) : c, c, Tensor());
       }});
  c.push_back({"gemm_group", "overlap", [](Backend& be, bool ok) {
                 Tensor out = f32({4, 5});
                 std::vector<Backend::GemmProblem> ps{
                     {f32({2, 3}), f32({3, 5}), out.slice(0, 2), {}},
                     {f32({2, 3}), f32({3, 5}), out.slice(ok ? 2 : 1, ok ? 4 : 3), {}}};
                 be.gemm_group(ps, false, false, 0.0);
               }});
  c.push_back(
      {"gemm_group", "a bias needs beta == 0", [](Backend& be, bool ok) {
         std::vector<Backend::GemmProblem> ps{{f32({2, 3}), f32({3, 5}), f32({2, 5}), f32({5})}};
         be.gemm_group(ps, false, false, ok ? 0.0 : 1.0);
       }});
  c.push_back({"gemm_group", "does not fit c", [](Backend& be, bool ok) {
                 std::vector<Backend::GemmProblem> ps{
                     {f32({2, 3}), f32({3, 5}), f32({2, 5}), {}},
                     {f32({2, 3}), f32({3, 5}), f32({ok ? 2 : 3, 5}), {}}};
                 be.gemm_group(ps, false, false, 0.0);
               }});
  c.push_back({"gemm_fp8", "does not fit c", [](Backend& be, bool ok) {
                 Tensor c = f32({2, ok ? 5 : 4});
                 be.gemm_fp8(f32({3, 2}), true, f32({5, 3}), true, c, 0, {}, {}, {});
               }});
  c.push_back({"gemm_fp8", "a bias or r needs beta == 0", [](Backend& be, bool ok) {
                 Tensor c = f32({2, 5});
                 be.gemm_fp8(f32({2, 3}), false, f32({3, 5}), false, c, ok ? 0 : 1, f32({5}), {},
                             {});
               }});
  c.push_back({"gemm_fp8", "r must not alias c", [](Backend& be, bool ok) {
                 Tensor c = f32({2, 5});
                 be.gemm_fp8(f32({2, 3}), false, f32({3, 5}), false, c, 0, {},
                             ok ? f32({2, 5}) : c, {});
               }});
  c.push_back({"gemm_fp8_group", "overlap", [](Backend& be, bool ok) {
                 Tensor out = f32({4, 5});
                 std::vector<Backend::GemmProblem> ps{
                     {f32({2, 3}), f32({3, 5}), out.slice(0, 2), {}},
                     {f32({2, 3}), f32({3, 5}), out.slice(ok ? 2 : 1, ok ? 4 : 3), {}}};
                 be.gemm_fp8_group(ps, false, false, 0.0, {});
               }});
  c.push_back({"add_bias", "'bias'", [](Backend& be, bool ok) {
                 Tensor y = f32({2, 5});
                 be.add_bias(y, f32({ok ? 5 : 2}));
               }});
  c.push_back({"bias_grad", "'db'", [](Backend& be, bool ok) {
                 Tensor db = f32({ok ? 5 : 2});
                 be.bias_grad(f32({2, 5}), db);
               }});
  c.push_back({"bias_grad_segments", "outside dy", [](Backend& be, bool ok) {
                 be.bias_grad_segments(f32({4, 5}), {{0, 2, f32({5})}, {2, ok ? 2 : 3, f32({5})}});
               }});
  c.push_back({"add", "differ in numel", [](Backend& be, bool ok) {
                 Tensor out = f32({ok ? 6 : 5});
                 be.add(f32({6}), f32({2, 3}), out);
               }});
  c.push_back({"axpy", "differ in numel", [](Backend& be, bool ok) {
                 Tensor y = f32({ok ? 6 : 7});
                 be.axpy(0.5, f32({6}), y);
               }});
  c.push_back({"rmsnorm_fwd", "'rstd'", [](Backend& be, bool ok) {
                 Tensor y = f32({2, 5}), rstd = f32({ok ? 2 : 5});
                 be.rmsnorm_fwd(f32({2, 5}), f32({5}), 1e-6, y, rstd);
               }});
  c.push_back({"rmsnorm_fwd", "eps >= 0", [](Backend& be, bool ok) {
                 Tensor y = f32({2, 5}), rstd = f32({2});
                 be.rmsnorm_fwd(f32({2, 5}), f32({5}), ok ? 1e-6 : -1.0, y, rstd);
               }});
  c.push_back({"rmsnorm_bwd", "'dw'", [](Backend& be, bool ok) {
                 Tensor dx = f32({2, 5}), dw = f32({ok ? 5 : 2});
                 be.rmsnorm_bwd(f32({2, 5}), f32({5}), f32({2}), f32({2, 5}), dx, dw, false);
               }});
  c.push_back({"rope", "'table.sin'", [](Backend& be, bool ok) {
                 Tensor x = f32({5, 3, 4});
                 be.rope(x, 2, i32({5}), RopeTable{f32({8, 2}), f32({8, ok ? 2 : 4})}, false);
               }});
  c.push_back({"rope", "even head_dim", [](Backend& be, bool ok) {
                 Tensor x = f32({5, 3, 4});
                 be.rope(x, ok ? 3 : 4, i32({5}), RopeTable{f32({8, 2}), f32({8, 2})}, false);
               }});
  c.push_back({"qk_norm_fwd", "n_heads + 2 n_kv_heads", [](Backend& be, bool ok) {
                 const int64_t h = ok ? 4 : 3;
                 Tensor out = f32({5, h, 4}), rstd = f32({5, 3});
                 be.qk_norm_fwd(f32({5, h, 4}), f32({4}), f32({4}), 2, 1, 1e-6, out, rstd);
               }});
  c.push_back({"qk_norm_bwd", "'dkw'", [](Backend& be, bool ok) {
                 Tensor din = f32({5, 4, 4}), dqw = f32({4}), dkw = f32({ok ? 4 : 2});
                 be.qk_norm_bwd(f32({5, 4, 4}), f32({4}), f32({4}), 2, 1, f32({5, 3}),
                                f32({5, 4, 4}), din, dqw, dkw);
               }});
  c.push_back({"qk_norm_rope_fwd", "'table.sin'", [](Backend& be, bool ok) {
                 Tensor out = f32({5, 4, 4}), rstd = f32({5, 3});
                 be.qk_norm_rope_fwd(f32({5, 4, 4}), f32({4}), f32({4}), 2, 1, 1e-6, i32({5}),
                                     RopeTable{f32({8, 2}), f32({8, ok ? 2 : 4})}, out, rstd);
               }});
  c.push_back(
      {"qk_norm_rope_bwd", "din must be dout itself or not overlap it", [](Backend& be, bool ok) {
         Tensor buf = f32({6, 4, 4}), dqw = f32({4}), dkw = f32({4});
         Tensor dout = buf.slice(0, 5), din = ok ? dout : buf.slice(1, 6);
         be.qk_norm_rope_bwd(f32({5, 4, 4}), f32({4}), f32({4}), 2, 1, f32({5, 3}), i32({5}),
                             RopeTable{f32({8, 2}), f32({8, 2})}, dout, din, dqw, dkw);
       }});
  c.push_back(
      {"attention_fwd", "'lse'", [](Backend& be, bool ok) {
         Tensor out = f32({5, 2, 4}), lse = f32({5, ok ? 2 : 3});
         be.attention_fwd(f32({5, 4, 4}), Tensor(), small_meta(), {2, 1, 4, 0, 0.5}, out, lse);
       }});
  c.push_back({"attention_fwd", "'meta.cu_seqlens'", [](Backend& be, bool ok) {
                 Tensor out = f32({5, 2, 4}), lse = f32({5, 2});
                 BatchMeta m = small_meta();
                 if (!ok) m.n_seqs = 1;
                 be.attention_fwd(f32({5, 4, 4}), Tensor(), m, {2, 1, 4, 0, 0.5}, out, lse);
               }});
  c.push_back({"attention_fwd", "bad shape", [](Backend& be, bool ok) {
                 Tensor out = f32({5, 2, 4}), lse = f32({5, 2});
                 AttentionShape s{2, 1, 4, ok ? 0 : -1, 0.5};
                 be.attention_fwd(f32({5, 4, 4}), Tensor(), small_meta(), s, out, lse);
               }});
  c.push_back({"attention_bwd", "dqkv must not alias qkv", [](Backend& be, bool ok) {
                 Tensor qkv = f32({5, 4, 4});
                 Tensor dqkv = ok ? f32({5, 4, 4}) : qkv, dsinks = f32({2});
                 be.attention_bwd(qkv, f32({2}), small_meta(), {2, 1, 4, 0, 0.5}, f32({5, 2, 4}),
                                  f32({5, 2}), f32({5, 2, 4}), dqkv, dsinks);
               }});
  c.push_back({"attention_bwd", "'dsinks'", [](Backend& be, bool ok) {
                 Tensor dqkv = f32({5, 4, 4}), dsinks = f32({ok ? 2 : 1});
                 be.attention_bwd(f32({5, 4, 4}), f32({2}), small_meta(), {2, 1, 4, 0, 0.5},
                                  f32({5, 2, 4}), f32({5, 2}), f32({5, 2, 4}), dqkv, dsinks);
               }});
  c.push_back({"glu_fwd", "even width", [](Backend& be, bool ok) {
                 Tensor a = f32({2, 3});
                 be.glu_fwd(f32({2, ok ? 6 : 7}), GluParams{}, a);
               }});
  c.push_back({"glu_bwd", "'dh'", [](Backend& be, bool ok) {
                 Tensor dh = f32({2, ok ? 6 : 3});
                 be.glu_bwd(f32({2, 6}), f32({2, 3}), GluParams{}, dh);
               }});
  c.push_back({"router_topk", "k = 6", [](Backend& be, bool ok) {
                 const int k = ok ? 2 : 6;
                 Tensor idx = i32({3, k}), w = f32({3, k});
                 be.router_topk(f32({3, 5}), k, idx, w);
               }});
  c.push_back({"router_topk_bwd", "'dw'", [](Backend& be, bool ok) {
                 Tensor dl = f32({3, 5});
                 be.router_topk_bwd(i32({3, 2}), f32({3, 2}), f32({3, ok ? 2 : 1}), dl);
               }});
  c.push_back({"router_aux_loss", "'counts'", [](Backend& be, bool ok) {
                 Tensor loss = f32({1}), dl = f32({3, 5});
                 be.router_aux_loss(f32({3, 5}), i32({ok ? 5 : 6}), 2, 0.01, loss, dl);
               }});
  c.push_back({"histogram", "'counts'", [](Backend& be, bool ok) {
                 Tensor counts = i32({ok ? 4 : 5});
                 be.histogram(i32({6}), 4, counts);
               }});
  c.push_back({"exclusive_scan", "'offsets'", [](Backend& be, bool ok) {
                 Tensor offsets = i32({ok ? 5 : 4});
                 be.exclusive_scan(i32({4}), offsets);
               }});
  c.push_back({"sort_by_id", "'assign_to_sorted'", [](Backend& be, bool ok) {
                 Tensor s2a = i32({6}), a2s = i32({ok ? 6 : 5});
                 be.sort_by_id(i32({6}), i32({5}), s2a, a2s);
               }});
  c.push_back({"permute_rows", "'out'", [](Backend& be, bool ok) {
                 Tensor out = f32({6, ok ? 5 : 4});
                 be.permute_rows(f32({3, 5}), i32({6}), 2, out);
               }});
  c.push_back({"permute_rows", "must be positive", [](Backend& be, bool ok) {
                 Tensor out = f32({6, 5});
                 be.permute_rows(f32({3, 5}), i32({6}), ok ? 2 : 0, out);
               }});
  c.push_back({"permute_rows_bwd", "'dout'", [](Backend& be, bool ok) {
                 Tensor dx = f32({3, 5});
                 be.permute_rows_bwd(f32({ok ? 6 : 5, 5}), i32({6}), 2, dx);
               }});
  c.push_back({"unpermute_combine", "'assign_to_sorted'", [](Backend& be, bool ok) {
                 Tensor out = f32({3, 5});
                 be.unpermute_combine(f32({6, 5}), i32({ok ? 6 : 3}), f32({3, 2}), out);
               }});
  c.push_back({"unpermute_combine_bwd", "'dw'", [](Backend& be, bool ok) {
                 Tensor dy = f32({6, 5}), dw = f32({3, ok ? 2 : 1});
                 be.unpermute_combine_bwd(f32({3, 5}), f32({6, 5}), i32({6}), f32({3, 2}), dy, dw);
               }});
  c.push_back({"embedding_fwd", "'out'", [](Backend& be, bool ok) {
                 Tensor out = f32({ok ? 4 : 3, 5});
                 be.embedding_fwd(f32({7, 5}), i32({4}), out);
               }});
  c.push_back({"embedding_bwd", "'dout'", [](Backend& be, bool ok) {
                 Tensor dtable = f32({7, 5});
                 be.embedding_bwd(f32({4, ok ? 5 : 6}), i32({4}), dtable);
               }});
  c.push_back({"cross_entropy", "'targets'", [](Backend& be, bool ok) {
                 Tensor logits = f32({3, 7}), loss = f32({1});
                 be.cross_entropy(logits, i32({ok ? 3 : 4}), 1.0, loss);
               }});
  c.push_back({"sum_squares", "'acc'", [](Backend& be, bool ok) {
                 Tensor acc = f32({ok ? 1 : 2});
                 be.sum_squares(f32({9}), acc);
               }});
  c.push_back({"adamw", "'m'", [](Backend& be, bool ok) {
                 Tensor w = f32({2, 3}), m = f32({ok ? 2 : 3, ok ? 3 : 2}), v = f32({2, 3});
                 Tensor none;
                 be.adamw(w, f32({2, 3}), m, v, AdamWParams{}, none);
               }});
  c.push_back({"adamw", "'working'", [](Backend& be, bool ok) {
                 Tensor w = f32({2, 3}), m = f32({2, 3}), v = f32({2, 3});
                 Tensor working = Tensor::host({ok ? 6 : 5}, DType::kBF16);
                 be.adamw(w, f32({2, 3}), m, v, AdamWParams{}, working);
               }});
  c.push_back({"adamw", "gate", [](Backend& be, bool ok) {
                 Tensor w = f32({2, 3}), m = f32({2, 3}), v = f32({2, 3}), none;
                 Tensor gate = Tensor::host({2}, ok ? DType::kF64 : DType::kF32);
                 AdamWParams p;
                 p.gate = &gate;
                 be.adamw(w, f32({2, 3}), m, v, p, none);
               }});
  c.push_back({"adamw", "not gated", [](Backend& be, bool ok) {
                 Tensor w = f32({2, 3}), m = f32({2, 3}), v = f32({2, 3}), none;
                 Tensor gate = Tensor::host({2}, DType::kF64), flag = f32({1});
                 AdamWParams p;
                 p.gate = &gate;
                 if (!ok) p.check_flag = &flag;
                 be.adamw(w, f32({2, 3}), m, v, p, none);
               }});
  c.push_back({"update_gate", "'gate'", [](Backend& be, bool ok) {
                 Tensor gate = Tensor::host({ok ? 2 : 3}, DType::kF64);
                 be.update_gate(f32({4}), f32({2}), 1.0, gate);
               }});
  c.push_back({"update_gate", "at least one element", [](Backend& be, bool ok) {
                 Tensor gate = Tensor::host({2}, DType::kF64);
                 be.update_gate(f32({4}), f32({ok ? 2 : 0}), 1.0, gate);
               }});
  c.push_back({"adamw", "1-based", [](Backend& be, bool ok) {
                 Tensor w = f32({2, 3}), m = f32({2, 3}), v = f32({2, 3}), none;
                 AdamWParams p;
                 p.step = ok ? 1 : 0;
                 be.adamw(w, f32({2, 3}), m, v, p, none);
               }});
  return c;
}

// The error a call throws ("" when it throws none).
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(BackendContract, BrokenContractsStopAtTheInterface) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.op + " / " + c.fragment);
    RecordingBackend be;
    const std::string what = error_of([&] { c.call(be, false); });
    ASSERT_FALSE(what.empty()) << "no error";
    EXPECT_NE(what.find(c.op + ": "), std::string::npos) << what;
    EXPECT_NE(what.find(c.fragment), std::string::npos) << what;
    EXPECT_NE(what.find("framework/backend/backend.cpp"), std::string::npos) << what;
    EXPECT_TRUE(be.calls.empty()) << "the implementation " << be.calls.front() << " was reached";
  }
}

// The same calls within their contracts reach exactly the implementation of their op (so the
// cases above fail for the rule they break and nothing else).
TEST(BackendContract, KeptContractsReachTheImplementation) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.op + " / " + c.fragment);
    RecordingBackend be;
    const std::string what = error_of([&] { c.call(be, true); });
    EXPECT_EQ(what, "");
    EXPECT_EQ(be.calls, std::vector<std::string>{c.op});
  }
}

// The CPU backend gives the interface's error for every broken contract: none reaches its own
// checks.
TEST(BackendContract, CpuBackendGivesTheInterfaceError) {
  auto be = make_cpu_backend(DType::kF32);
  int refused = 0;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.op + " / " + c.fragment);
    const std::string what = error_of([&] { c.call(*be, false); });
    EXPECT_NE(what.find(c.op + ": "), std::string::npos) << what;
    EXPECT_NE(what.find(c.fragment), std::string::npos) << what;
    EXPECT_NE(what.find("framework/backend/backend.cpp"), std::string::npos) << what;
    refused += what.empty() ? 0 : 1;
  }
  EXPECT_EQ(refused, static_cast<int>(cases().size()));
  // Every op whose contract backend.h states has a case.
  std::vector<std::string> ops;
  for (const Case& c : cases()) ops.push_back(c.op);
  for (const char* op : {"fill",
                         "fill_normal",
                         "copy",
                         "copy_over_link",
                         "convert",
                         "read_to_host",
                         "upload_batch",
                         "rebuild_metadata",
                         "gemm",
                         "gemm_bias",
                         "gemm_add",
                         "gemm_group",
                         "gemm_fp8",
                         "gemm_fp8_group",
                         "add_bias",
                         "bias_grad",
                         "bias_grad_segments",
                         "add",
                         "axpy",
                         "rmsnorm_fwd",
                         "rmsnorm_bwd",
                         "rope",
                         "qk_norm_fwd",
                         "qk_norm_bwd",
                         "qk_norm_rope_fwd",
                         "qk_norm_rope_bwd",
                         "attention_fwd",
                         "attention_bwd",
                         "glu_fwd",
                         "glu_bwd",
                         "router_topk",
                         "router_topk_bwd",
                         "router_aux_loss",
                         "histogram",
                         "exclusive_scan",
                         "sort_by_id",
                         "permute_rows",
                         "permute_rows_bwd",
                         "unpermute_combine",
                         "unpermute_combine_bwd",
                         "embedding_fwd",
                         "embedding_bwd",
                         "cross_entropy",
                         "sum_squares",
                         "update_gate",
                         "adamw"}) {
    EXPECT_NE(std::find(ops.begin(), ops.end(), op), ops.end()) << op << " has no case";
  }
}

// A backend without FP8 GEMMs (the default) reaches no FP8 product: the model refuses
// precision=fp8 on it before any work, naming the key; the CPU reference has them.
TEST(BackendContract, ModelRefusesFp8OnABackendWithoutFp8Gemms) {
  RecordingBackend be;
  EXPECT_FALSE(be.has_fp8_gemms());
  EXPECT_TRUE(make_cpu_backend(DType::kF32)->has_fp8_gemms());
  ModelConfig cfg;
  cfg.vocab_size = 11;
  cfg.d_model = 8;
  cfg.n_layers = 1;
  cfg.n_heads = 2;
  cfg.n_kv_heads = 1;
  cfg.head_dim = 4;
  cfg.ffn_dim = 8;
  ModelOptions opts;
  opts.precision = GemmPrecision::kFP8;
  try {
    Model model(cfg, opts, be);
    FAIL() << "precision=fp8 was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("config key 'precision'"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(be.calls.empty()) << be.calls.front() << " ran first";
}

}  // namespace
}  // namespace hp
