// Model::backward(.., leave_unreached) against the zero-filling backward, on any backend: two
// copies of one MoE model with more experts than a micro-batch reaches take two micro-batches of
// gradient (different tokens, so that an expert skipped by the first may be reached by the
// second), one filling the unreached experts' gradients with zeros, the other leaving them
// unwritten over gradient memory that starts as NaN. Then:
//  - a flagged expert's filled gradient is zero (a reached one's may be zero too: a token without a
//    target at a sequence's end sends none back), as many are flagged as the tokens guarantee,
//    and every unflagged slice has the filled copy's bits;
//  - grad_sum_squares and two AdamW steps give the same bits on both copies (a flagged slice's NaN
//    would poison them if it were read);
//  - fill_unreached_grads leaves the gradients bitwise equal and the flags cleared;
//  - a hook that reads each layer's gradients cannot be combined with leaving them unwritten.
// The backend must give the same bits for the same work twice (on the GPU: deterministic=true).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "framework/model/grad_ready.h"
#include "framework/model/model.h"
#include "optim/adamw.h"
#include "tests/common/fixtures.h"

namespace hp::test {

// Host f32 words of t (f32 or bf16 on any device).
inline std::vector<uint32_t> words_of(Backend& be, const Tensor& t) {
  std::vector<uint32_t> out;
  append_bits(host_f32(be, t), out);
  return out;
}

inline void check_unreached_experts(Backend& be, const ModelConfig& cfg, int64_t tokens) {
  // Two micro-batches of `tokens` reach at most 2 * tokens * top_k experts of a layer.
  const int64_t guaranteed = cfg.n_experts - 2 * tokens * cfg.top_k;
  ASSERT_GT(guaranteed, 0) << "too many tokens for the experts: none is sure to be unreached";
  ModelOptions opts;
  opts.max_positions = tokens;
  Model fill(cfg, opts, be), leave(cfg, opts, be);
  fill.init_params(23);
  leave.init_params(23);
  const PackedBatch batches[2] = {synthetic_batch(cfg, 5, tokens, 1, 8.0),
                                  synthetic_batch(cfg, 6, tokens, 1, 8.0)};
  const double scale = 1.0 / static_cast<double>(tokens);
  for (auto& p : leave.params().all()) be.fill(p->grad, std::nan(""));
  std::vector<char> first_flags;  // the leaving copy's flags after the first micro-batch
  for (Model* m : {&fill, &leave}) {
    m->zero_grads();
    for (const PackedBatch& b : batches) {
      BatchMeta meta = be.upload_batch(b);
      Tensor aux = be.zeros({1}, be.master_dtype()), lm = be.zeros({1}, be.master_dtype());
      m->forward(meta, aux, Pass::kTrain);
      m->loss(scale, lm);
      m->backward(nullptr, m == &leave);
      if (m == &leave && first_flags.empty()) {
        for (auto& p : m->params().all())
          first_flags.insert(first_flags.end(), p->grad_zero_experts.begin(),
                             p->grad_zero_experts.end());
      }
    }
  }
  // Experts skipped by the first micro-batch and reached by the second: their gradient is
  // written (not added to the NaN underneath).
  std::vector<char> last_flags;
  for (auto& p : leave.params().all())
    last_flags.insert(last_flags.end(), p->grad_zero_experts.begin(), p->grad_zero_experts.end());
  ASSERT_EQ(first_flags.size(), last_flags.size());
  int reached_after_skip = 0;
  for (size_t i = 0; i < first_flags.size(); ++i)
    reached_after_skip += first_flags[i] && !last_flags[i] ? 1 : 0;
  EXPECT_GT(reached_after_skip, 0);
  int flagged = 0;
  for (size_t i = 0; i < fill.params().all().size(); ++i) {
    const Param& f = *fill.params().all()[i];
    const Param& l = *leave.params().all()[i];
    SCOPED_TRACE(f.name);
    EXPECT_TRUE(f.grad_zero_experts.empty());
    const bool matrix = f.group == ParamGroup::kExpert && f.shape.size() == 3;
    if (!matrix) {
      EXPECT_TRUE(l.grad_zero_experts.empty());
      expect_same_bits(words_of(be, f.grad), words_of(be, l.grad), "gradient");
      continue;
    }
    ASSERT_EQ(static_cast<int64_t>(l.grad_zero_experts.size()), f.shape[0]);
    for (int64_t le = 0; le < f.shape[0]; ++le) {
      const std::vector<uint32_t> filled = words_of(be, f.grad[le]);
      bool zero = true;
      for (uint32_t w : filled) zero = zero && w == 0;
      if (l.expert_grad_unwritten(le)) {
        EXPECT_TRUE(zero) << "expert " << le << " is flagged but its filled gradient is not zero";
        ++flagged;
      } else {
        expect_same_bits(filled, words_of(be, l.grad[le]), "expert " + std::to_string(le));
      }
    }
  }
  EXPECT_GE(flagged, 2 * cfg.n_layers * guaranteed);  // w1 and w2 of each unreached expert

  std::vector<uint32_t> bits[2];
  int side = 0;
  for (Model* m : {&fill, &leave}) {
    Tensor acc = be.zeros({2}, be.master_dtype());
    grad_sum_squares(be, m->params(), acc);
    bits[side] = words_of(be, acc);
    AdamW opt(AdamWConfig{});
    for (int64_t step = 1; step <= 2; ++step) opt.step(be, m->params(), step, 1e-2, 0.5);
    for (auto& p : m->params().all())
      for (const Tensor* t : {&p->master, &p->m, &p->v, &p->work}) {
        const std::vector<uint32_t> w = words_of(be, *t);
        bits[side].insert(bits[side].end(), w.begin(), w.end());
      }
    ++side;
  }
  EXPECT_TRUE(std::isfinite(reinterpret_cast<const float&>(bits[1][0])));
  expect_same_bits(bits[0], bits[1], "gradient sums of squares, then parameters and moments");

  leave.fill_unreached_grads();
  for (size_t i = 0; i < fill.params().all().size(); ++i) {
    const Param& f = *fill.params().all()[i];
    const Param& l = *leave.params().all()[i];
    EXPECT_TRUE(l.grad_zero_experts.empty()) << l.name;
    expect_same_bits(words_of(be, f.grad), words_of(be, l.grad), l.name + " after the fill");
  }

  // A reduction hook reads every layer's gradients: leaving some unwritten is refused.
  struct Hook final : GradReadyHook {
    void layer_ready(int) override {}
  } hook;
  BatchMeta meta = be.upload_batch(batches[0]);
  Tensor aux = be.zeros({1}, be.master_dtype()), lm = be.zeros({1}, be.master_dtype());
  leave.zero_grads();
  leave.forward(meta, aux, Pass::kTrain);
  leave.loss(scale, lm);
  std::string what;
  try {
    leave.backward(&hook, true);
  } catch (const std::exception& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("leave_unreached needs no grad_ready hook"), std::string::npos) << what;
}

}  // namespace hp::test
