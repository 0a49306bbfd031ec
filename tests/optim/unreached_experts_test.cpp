// Unreached experts' gradients left unwritten on the CPU reference: the optimizer's bits are those
// of the zero-filling backward (tests/common/unreached_experts.h).
#include <gtest/gtest.h>

#include "framework/backend/backend.h"
#include "tests/common/unreached_experts.h"

namespace hp {
namespace {

TEST(UnreachedExperts, LeftUnwrittenTheOptimizerGivesTheBitsOfZeroFills) {
  auto be = make_cpu_backend(DType::kF32);
  ModelConfig c;
  c.vocab_size = 29;
  c.d_model = 8;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 4;
  c.init_std = 0.5;
  // 6 tokens a micro-batch, 2 experts each: at most 24 of 32 experts reached in a layer.
  test::check_unreached_experts(*be, test::gptoss_like_moe(c, 32, 2, 6, 3), 6);
}

}  // namespace
}  // namespace hp
