// A backend for the FP8 tests that runs every op on another backend (the CPU reference) and
// records, for each GEMM, which op computed it, the output's address, the FP8 spec and whether
// its b operand was held (Backend::hold_fp8_weights): which products of a model step are FP8
// and which are not. It can also report another FP8 recipe than the backend below it (the
// recipe a GPU would give).
#pragma once

#include <string>
#include <vector>

#include "framework/backend/backend.h"

namespace hp::test {

class Fp8ForwardingBackend final : public Backend {
 public:
  struct Gemm {
    std::string op;            // gemm, gemm_bias, gemm_add, gemm_group, gemm_fp8, gemm_fp8_group
    const void* c = nullptr;   // the output's first element
    Fp8Gemm spec;              // the FP8 ops' spec
    bool b_held = false;       // b was among the held weights (same storage and shape)
  };
  std::vector<Gemm> gemms;
  // hold_fp8_weights and release_fp8_weights calls, and the weights held now.
  int64_t holds = 0, releases = 0;
  std::vector<Tensor> held;
  // glu_fwd_fp8 and glu_bwd_fp8 calls, cross_entropy_fp8 calls, and how many of the tensors
  // they hand on the next FP8 product took as its op(a) (a itself, not transposed).
  int64_t glu_fp8 = 0, ce_fp8 = 0, handed_taken = 0;

  explicit Fp8ForwardingBackend(Backend& inner) : in_(inner), recipe_(inner.fp8_recipe()) {}
  void set_fp8_recipe(fp8::Recipe r) { recipe_ = r; }

  Device device() const override { return in_.device(); }
  std::string name() const override { return "forwarding(" + in_.name() + ")"; }
  DType act_dtype() const override { return in_.act_dtype(); }
  DType master_dtype() const override { return in_.master_dtype(); }
  Allocator& allocator() override { return in_.allocator(); }
  void synchronize(SyncCause cause) override {
    syncs_.add(cause);
    in_.synchronize(cause);
  }
  bool has_fp8_gemms() const override { return in_.has_fp8_gemms(); }
  fp8::Recipe fp8_recipe() const override { return recipe_; }

 protected:
  void do_fill(Tensor& t, double v) override { in_.fill(t, v); }
  void do_fill_normal(Tensor& t, uint64_t key, int64_t off, double std) override {
    in_.fill_normal(t, key, off, std);
  }
  void do_copy(const Tensor& s, Tensor& d) override { in_.copy(s, d); }
  void do_convert(const Tensor& s, Tensor& d) override { in_.convert(s, d); }
  void do_read_to_host(const Tensor& s, Tensor& d, SyncCause cause) override {
    syncs_.add(cause);
    in_.read_to_host(s, d, cause);
  }
  BatchMeta do_upload_batch(const PackedBatch& b) override { return in_.upload_batch(b); }
  void do_rebuild_metadata(BatchMeta& m) override { in_.rebuild_metadata(m); }
  void do_gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, double alpha,
               double beta) override {
    gemms.push_back({"gemm", c.raw(), {}});
    in_.gemm(a, ta, b, tb, c, alpha, beta);
  }
  void do_gemm_bias(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c,
                    const Tensor& bias) override {
    gemms.push_back({"gemm_bias", c.raw(), {}});
    in_.gemm_bias(a, ta, b, tb, c, bias);
  }
  void do_gemm_add(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& r, Tensor& c,
                   const Tensor& bias) override {
    gemms.push_back({"gemm_add", c.raw(), {}});
    in_.gemm_add(a, ta, b, tb, r, c, bias);
  }
  void do_gemm_group(const std::vector<GemmProblem>& ps, bool ta, bool tb, double beta) override {
    for (const GemmProblem& p : ps) gemms.push_back({"gemm_group", p.c.raw(), {}});
    in_.gemm_group(ps, ta, tb, beta);
  }
  void do_gemm_fp8(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, double beta,
                   const Tensor& bias, const Tensor& r, const Fp8Gemm& spec) override {
    gemms.push_back({"gemm_fp8", c.raw(), spec, is_held(b)});
    take_handed(a, ta);
    in_.gemm_fp8(a, ta, b, tb, c, beta, bias, r, spec);
  }
  void do_gemm_fp8_group(const std::vector<GemmProblem>& ps, bool ta, bool tb, double beta,
                         const Fp8Gemm& spec) override {
    for (const GemmProblem& p : ps) {
      gemms.push_back({"gemm_fp8_group", p.c.raw(), spec, is_held(p.b)});
      take_handed(p.a, ta);
    }
    in_.gemm_fp8_group(ps, ta, tb, beta, spec);
  }
  void do_glu_fwd_fp8(const Tensor& h, const GluParams& p, Tensor& a,
                      const Fp8Gemm& spec) override {
    ++glu_fp8;
    handed_ = a;
    in_.glu_fwd_fp8(h, p, a, spec);
  }
  void do_glu_bwd_fp8(const Tensor& h, const Tensor& da, const GluParams& p, Tensor& dh,
                      const Fp8Gemm& spec) override {
    ++glu_fp8;
    handed_ = dh;
    in_.glu_bwd_fp8(h, da, p, dh, spec);
  }
  void do_hold_fp8_weights(const std::vector<Tensor>& w, const Fp8Gemm& spec) override {
    ++holds;
    held.insert(held.end(), w.begin(), w.end());
    in_.hold_fp8_weights(w, spec);
  }
  void do_release_fp8_weights() override {
    ++releases;
    held.clear();
    in_.release_fp8_weights();
  }
  void do_add_bias(Tensor& y, const Tensor& bias) override { in_.add_bias(y, bias); }
  void do_bias_grad(const Tensor& dy, Tensor& db) override { in_.bias_grad(dy, db); }
  void do_bias_grad_segments(const Tensor& dy, const std::vector<RowSegment>& s) override {
    in_.bias_grad_segments(dy, s);
  }
  void do_add(const Tensor& a, const Tensor& b, Tensor& out) override { in_.add(a, b, out); }
  void do_axpy(double alpha, const Tensor& x, Tensor& y) override { in_.axpy(alpha, x, y); }
  void do_rmsnorm_fwd(const Tensor& x, const Tensor& w, double eps, Tensor& y,
                      Tensor& rstd) override {
    in_.rmsnorm_fwd(x, w, eps, y, rstd);
  }
  void do_rmsnorm_bwd(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                      Tensor& dx, Tensor& dw, bool acc) override {
    in_.rmsnorm_bwd(x, w, rstd, dy, dx, dw, acc);
  }
  void do_rope(Tensor& x, int n, const Tensor& pos, const RopeTable& t, bool inv) override {
    in_.rope(x, n, pos, t, inv);
  }
  void do_qk_norm_fwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw, int64_t hq,
                      int64_t hkv, double eps, Tensor& out, Tensor& rstd) override {
    in_.qk_norm_fwd(qkv, qw, kw, hq, hkv, eps, out, rstd);
  }
  void do_qk_norm_bwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw, int64_t hq,
                      int64_t hkv, const Tensor& rstd, const Tensor& dout, Tensor& din,
                      Tensor& dqw, Tensor& dkw) override {
    in_.qk_norm_bwd(qkv, qw, kw, hq, hkv, rstd, dout, din, dqw, dkw);
  }
  void do_attention_fwd(const Tensor& qkv, const Tensor& sinks, const BatchMeta& meta,
                        const AttentionShape& s, Tensor& out, Tensor& lse) override {
    in_.attention_fwd(qkv, sinks, meta, s, out, lse);
  }
  void do_attention_bwd(const Tensor& qkv, const Tensor& sinks, const BatchMeta& meta,
                        const AttentionShape& s, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dqkv, Tensor& dsinks) override {
    in_.attention_bwd(qkv, sinks, meta, s, out, lse, dout, dqkv, dsinks);
  }
  void do_glu_fwd(const Tensor& h, const GluParams& p, Tensor& a) override {
    in_.glu_fwd(h, p, a);
  }
  void do_glu_bwd(const Tensor& h, const Tensor& da, const GluParams& p, Tensor& dh) override {
    in_.glu_bwd(h, da, p, dh);
  }
  void do_router_topk(const Tensor& logits, int k, Tensor& idx, Tensor& w) override {
    in_.router_topk(logits, k, idx, w);
  }
  void do_router_topk_bwd(const Tensor& idx, const Tensor& w, const Tensor& dw,
                          Tensor& dlogits) override {
    in_.router_topk_bwd(idx, w, dw, dlogits);
  }
  void do_router_aux_loss(const Tensor& logits, const Tensor& counts, int k, double coef,
                          Tensor& loss, Tensor& dlogits) override {
    in_.router_aux_loss(logits, counts, k, coef, loss, dlogits);
  }
  void do_histogram(const Tensor& ids, int n_bins, Tensor& counts) override {
    in_.histogram(ids, n_bins, counts);
  }
  void do_exclusive_scan(const Tensor& counts, Tensor& offsets) override {
    in_.exclusive_scan(counts, offsets);
  }
  void do_sort_by_id(const Tensor& ids, const Tensor& offsets, Tensor& s2a,
                     Tensor& a2s) override {
    in_.sort_by_id(ids, offsets, s2a, a2s);
  }
  void do_permute_rows(const Tensor& x, const Tensor& s2a, int k, Tensor& out) override {
    in_.permute_rows(x, s2a, k, out);
  }
  void do_permute_rows_bwd(const Tensor& dout, const Tensor& s2a, int k, Tensor& dx) override {
    in_.permute_rows_bwd(dout, s2a, k, dx);
  }
  void do_unpermute_combine(const Tensor& y, const Tensor& a2s, const Tensor& w,
                            Tensor& out) override {
    in_.unpermute_combine(y, a2s, w, out);
  }
  void do_unpermute_combine_bwd(const Tensor& dout, const Tensor& y, const Tensor& a2s,
                                const Tensor& w, Tensor& dy, Tensor& dw) override {
    in_.unpermute_combine_bwd(dout, y, a2s, w, dy, dw);
  }
  void do_embedding_fwd(const Tensor& table, const Tensor& ids, Tensor& out) override {
    in_.embedding_fwd(table, ids, out);
  }
  void do_embedding_bwd(const Tensor& dout, const Tensor& ids, Tensor& dtable) override {
    in_.embedding_bwd(dout, ids, dtable);
  }
  void do_cross_entropy(Tensor& logits, const Tensor& targets, double scale,
                        Tensor& loss) override {
    in_.cross_entropy(logits, targets, scale, loss);
  }
  void do_cross_entropy_fp8(Tensor& logits, const Tensor& targets, double scale, Tensor& loss,
                            const Fp8Gemm& spec) override {
    ++ce_fp8;
    handed_ = logits;
    in_.cross_entropy_fp8(logits, targets, scale, loss, spec);
  }
  void do_sum_squares(const Tensor& x, Tensor& acc) override { in_.sum_squares(x, acc); }
  void do_update_gate(const Tensor& checked, const Tensor& sumsq, double max_norm,
                      Tensor& gate) override {
    in_.update_gate(checked, sumsq, max_norm, gate);
  }
  void do_adamw(Tensor& master, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p,
                Tensor& working) override {
    in_.adamw(master, grad, m, v, p, working);
  }

 private:
  void take_handed(const Tensor& a, bool ta) {
    if (handed_.defined() && !ta && a.raw() == handed_.raw() && a.shape() == handed_.shape())
      ++handed_taken;
    handed_ = Tensor();
  }
  bool is_held(const Tensor& b) const {
    for (const Tensor& w : held)
      if (w.raw() == b.raw() && w.shape() == b.shape() && w.dtype() == b.dtype()) return true;
    return false;
  }
  Backend& in_;
  fp8::Recipe recipe_;
  Tensor handed_;  // the last glu_*_fp8 or cross_entropy_fp8 output, until the next FP8 product
};

}  // namespace hp::test
