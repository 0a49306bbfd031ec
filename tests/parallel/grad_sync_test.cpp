// GradSync on the cpu backend, ranks as threads with an in-process data path (thread_comm.h):
// dense gradients are summed over the world and expert gradients over dp, layer by layer as the hook reports them and the
// rest in finish(), step after step, without a host sync. Asking for the comm stream changes
// nothing on the cpu (its events are complete when recorded) and gives the same bits.
// The NCCL path (comm stream, events) is covered by tests/gpu/nccl_test.cpp.
// With a Zero1 (optimizer_sharding=zero1) each sharded gradient is reduce-scattered: the shard
// holds bitwise the rows of the all-reduced gradient; the gradient-norm partials, the update and
// the all-gather of the working copies give the same bits as the unsharded path; the bf16 wire
// sums bf16-rounded addends in fp32, in rank order.
#include "parallel/grad_sync.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "framework/backend/backend.h"
#include "parallel/launch_env.h"
#include "parallel/process_groups.h"
#include "parallel/store_communicator.h"
#include "parallel/zero1.h"
#include "tests/parallel/thread_comm.h"

namespace hp {
namespace {

using CommPtr = std::shared_ptr<Communicator>;
using namespace std::chrono_literals;

struct Spec {
  const char* name;
  ParamGroup group;
  int64_t numel;
};
// Layer 2 is never reported by the hook: finish() must reduce it.
const std::vector<Spec> kSpecs = {
    {"embed", ParamGroup::kDense, 40},
    {"layers.0.attn.wqkv", ParamGroup::kDense, 96},
    {"layers.0.moe.w1", ParamGroup::kExpert, 64},
    {"layers.0.norm", ParamGroup::kDense, 8},
    {"layers.1.attn.wqkv", ParamGroup::kDense, 96},
    {"layers.1.moe.w1", ParamGroup::kExpert, 64},
    {"layers.2.moe.b1", ParamGroup::kExpert, 16},
    {"final_norm", ParamGroup::kDense, 8},
};

// Small integers: every order of summation gives the same float, so expectations are exact.
float grad_value(int step, int rank, size_t param, int64_t i) {
  return static_cast<float>((step * 7 + rank * 13 + static_cast<int>(param) * 5 + i) % 23 - 11);
}

// Every rank's gradients after `steps` steps of GradSync (layers 1, 0, -1 reported).
std::vector<std::vector<float>> reduce_steps(const CommPtr& world, int ep_size,
                                             Backend::StreamKind stream, int steps) {
  auto be = make_cpu_backend();
  ProcessGroups groups = make_process_groups(world, ep_size);
  ParamRegistry reg;
  for (const Spec& s : kSpecs) {
    Param p;
    p.name = s.name;
    p.shape = {s.numel};
    p.global_shape = p.shape;
    p.group = s.group;
    p.grad = be->zeros(p.shape, DType::kF32);
    reg.add(std::move(p));
  }
  GradSync sync(*be, reg, groups, stream);
  EXPECT_EQ(sync.stream(), stream);
  for (int step = 0; step < steps; ++step) {
    be->syncs().reset();
    for (size_t k = 0; k < reg.all().size(); ++k) {
      Param& p = *reg.all()[k];
      for (int64_t i = 0; i < p.numel(); ++i)
        p.grad.data<float>()[i] = grad_value(step, world->rank(), k, i);
    }
    for (int layer : {1, 0, -1}) sync.layer_ready(layer);
    sync.finish();
    EXPECT_EQ(be->syncs().total(), 0) << "step " << step;
  }
  std::vector<std::vector<float>> out;
  for (auto& p : reg.all())
    out.emplace_back(p->grad.data<float>(), p->grad.data<float>() + p->numel());
  return out;
}

TEST(GradSync, DenseOverWorldExpertsOverDpOnEitherStream) {
  const int world_size = 4, ep_size = 2, steps = 2;
  test::run_thread_ranks(world_size, [&](const CommPtr& world) {
    const int rank = world->rank();
    const GroupLayout layout = GroupLayout::make(world_size, ep_size);
    const auto on_compute = reduce_steps(world, ep_size, Backend::StreamKind::kCompute, steps);
    const auto on_comm = reduce_steps(world, ep_size, Backend::StreamKind::kComm, steps);
    for (size_t k = 0; k < kSpecs.size(); ++k) {
      const bool expert = kSpecs[k].group == ParamGroup::kExpert;
      std::vector<int> ranks;
      if (expert) {
        ranks = layout.dp_group(rank);
      } else {
        for (int r = 0; r < world_size; ++r) ranks.push_back(r);
      }
      for (int64_t i = 0; i < kSpecs[k].numel; ++i) {
        float want = 0;
        for (int r : ranks) want += grad_value(steps - 1, r, k, i);
        ASSERT_EQ(on_compute[k][static_cast<size_t>(i)], want)
            << kSpecs[k].name << "[" << i << "] rank " << rank;
      }
      EXPECT_EQ(on_comm[k], on_compute[k]) << kSpecs[k].name << " rank " << rank;
    }
  });
}

TEST(GradSync, SingleRankGroupsReduceNothing) {
  test::run_thread_ranks(2, [&](const CommPtr& world) {
    // ep_size 2 over 2 ranks: dp groups have one rank, so expert gradients stay as they are.
    const auto got = reduce_steps(world, 2, Backend::StreamKind::kComm, 1);
    for (size_t k = 0; k < kSpecs.size(); ++k) {
      if (kSpecs[k].group != ParamGroup::kExpert) continue;
      for (int64_t i = 0; i < kSpecs[k].numel; ++i)
        ASSERT_EQ(got[k][static_cast<size_t>(i)], grad_value(0, world->rank(), k, i))
            << kSpecs[k].name;
    }
  });
}

// Random floats of varied magnitudes (every rank can compute every rank's values): sums of these
// depend on the order of the additions, so the comparisons below check the order too.
float random_grad(int step, int rank, size_t param, int64_t i) {
  uint64_t x = (static_cast<uint64_t>(step) << 48) ^ (static_cast<uint64_t>(rank) << 40) ^
               (static_cast<uint64_t>(param) << 32) ^ static_cast<uint64_t>(i);
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  const double unit = static_cast<double>(x >> 11) / static_cast<double>(uint64_t{1} << 53);
  return static_cast<float>((unit - 0.5) * std::ldexp(1.0, static_cast<int>(x & 7)));
}

float to_bf16_and_back(float f) { return static_cast<float>(bf16(f)); }

struct Ranked {
  std::unique_ptr<Backend> be = make_cpu_backend();
  ProcessGroups groups;
  ParamRegistry reg;
};

// Parameters of kSpecs with masters, moments and gradients (random, for `step`) on this rank.
void make_params(Ranked& r, const CommPtr& world, int ep_size, int step,
                 const std::vector<Spec>& specs = kSpecs) {
  r.groups = make_process_groups(world, ep_size);
  for (size_t k = 0; k < specs.size(); ++k) {
    Param p;
    p.name = specs[k].name;
    p.shape = {specs[k].numel};
    p.global_shape = p.shape;
    p.group = specs[k].group;
    p.master = r.be->zeros(p.shape, DType::kF32);
    for (int64_t i = 0; i < p.numel(); ++i)
      p.master.data<float>()[i] = random_grad(99, 0, k, i);  // the same on every rank
    p.work = p.master;
    p.m = r.be->zeros(p.shape, DType::kF32);
    p.v = r.be->zeros(p.shape, DType::kF32);
    p.grad = r.be->zeros(p.shape, DType::kF32);
    for (int64_t i = 0; i < p.numel(); ++i)
      p.grad.data<float>()[i] = random_grad(step, world->rank(), k, i);
    r.reg.add(std::move(p));
  }
}

std::vector<float> values(const Tensor& t) {
  return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}

TEST(GradSync, Zero1ShardsHoldTheAllReducedRowsBitwise) {
  const int world_size = 4, ep_size = 2;
  test::run_thread_ranks(world_size, [&](const CommPtr& world) {
    Ranked plain, sharded;
    make_params(plain, world, ep_size, 1);
    make_params(sharded, world, ep_size, 1);
    Zero1 zero1(*sharded.be, sharded.reg, sharded.groups);
    // Every tensor of kSpecs divides over its group (world 4, dp 2).
    EXPECT_EQ(zero1.sharded_count(), static_cast<int>(kSpecs.size()));
    const OptimizerStateBytes full = optimizer_state_bytes(plain.reg);
    const OptimizerStateBytes part = optimizer_state_bytes(sharded.reg);
    EXPECT_EQ(full.dense, 4 * part.dense);
    EXPECT_EQ(full.expert, 2 * part.expert);
    GradSync a(*plain.be, plain.reg, plain.groups);
    GradSync b(*sharded.be, sharded.reg, sharded.groups, Backend::StreamKind::kCompute, &zero1);
    for (int layer : {1, 0, -1}) {
      a.layer_ready(layer);
      b.layer_ready(layer);
    }
    a.finish();
    b.finish();
    for (size_t k = 0; k < kSpecs.size(); ++k) {
      const Param& p = *plain.reg.all()[k];
      const Param& q = *sharded.reg.all()[k];
      ASSERT_TRUE(q.sharded()) << q.name;
      const std::vector<float> want =
          values(p.grad.slice(q.shard_begin, q.shard_begin + q.shard_rows));
      EXPECT_EQ(values(zero1.grad_shard(q)), want) << q.name << " rank " << world->rank();
    }
    // Gradient-norm partials: the same bits from the shards as from the all-reduced rows.
    Tensor acc_a = plain.be->zeros({2}, DType::kF32), acc_b = sharded.be->zeros({2}, DType::kF32);
    partitioned_grad_sum_squares(*plain.be, plain.reg, plain.groups, nullptr, acc_a);
    partitioned_grad_sum_squares(*sharded.be, sharded.reg, sharded.groups, &zero1, acc_b);
    EXPECT_EQ(values(acc_a), values(acc_b));
    EXPECT_GT(acc_a.data<float>()[0], 0.0f);
    // An update that writes each shard's reduced gradient into its master: after the
    // all-gather every rank's working copy is the whole reduced gradient.
    zero1.step([&](Param& p, const Tensor& grad, Tensor& working) {
      EXPECT_FALSE(working.defined()) << "f32 working copies are gathered from the masters";
      sharded.be->copy(grad, p.master);
    });
    zero1.wait_params();
    for (size_t k = 0; k < kSpecs.size(); ++k)
      EXPECT_EQ(values(sharded.reg.all()[k]->work), values(plain.reg.all()[k]->grad))
          << kSpecs[k].name << " rank " << world->rank();
  });
}

TEST(GradSync, Bf16WireSumsRoundedAddendsInRankOrder) {
  const int world_size = 4, ep_size = 2;
  test::run_thread_ranks(world_size, [&](const CommPtr& world) {
    const GroupLayout layout = GroupLayout::make(world_size, ep_size);
    for (bool shard : {false, true}) {
      Ranked r;
      make_params(r, world, ep_size, 2);
      std::unique_ptr<Zero1> zero1;
      if (shard) zero1 = std::make_unique<Zero1>(*r.be, r.reg, r.groups);
      GradSync sync(*r.be, r.reg, r.groups, Backend::StreamKind::kCompute, zero1.get(),
                    DType::kBF16);
      sync.finish();
      for (size_t k = 0; k < kSpecs.size(); ++k) {
        const Param& p = *r.reg.all()[k];
        std::vector<int> ranks;
        if (kSpecs[k].group == ParamGroup::kExpert) {
          ranks = layout.dp_group(world->rank());
        } else {
          for (int q = 0; q < world_size; ++q) ranks.push_back(q);
        }
        const int64_t begin = shard ? p.shard_begin : 0;
        const int64_t rows = shard ? p.shard_rows : p.numel();
        const std::vector<float> got = values(shard ? zero1->grad_shard(p) : p.grad);
        for (int64_t i = 0; i < rows; ++i) {
          float want = 0;
          bool first = true;
          for (int q : ranks) {
            const float x = to_bf16_and_back(random_grad(2, q, k, begin + i));
            want = first ? x : want + x;
            first = false;
          }
          // The all-reduce sends the sums back in bf16; the shard keeps its fp32 sum.
          if (!shard) want = to_bf16_and_back(want);
          ASSERT_EQ(got[static_cast<size_t>(i)], want)
              << p.name << "[" << begin + i << "] rank " << world->rank()
              << (shard ? " (reduce-scatter)" : " (all-reduce)");
        }
      }
    }
  });
}

TEST(GradSync, Zero1LeavesIndivisibleTensorsReplicated) {
  // Over a world of 4: 6 rows do not split, 12 do; the unsharded tensor is all-reduced, counted
  // once in the norm partials and updated whole on every rank.
  const std::vector<Spec> specs = {{"layers.0.odd", ParamGroup::kDense, 6},
                                   {"layers.0.even", ParamGroup::kDense, 12}};
  test::run_thread_ranks(4, [&](const CommPtr& world) {
    Ranked plain, sharded;
    make_params(plain, world, 1, 3, specs);
    make_params(sharded, world, 1, 3, specs);
    Zero1 zero1(*sharded.be, sharded.reg, sharded.groups);
    EXPECT_EQ(zero1.sharded_count(), 1);
    const Param& odd = *sharded.reg.all()[0];
    const Param& even = *sharded.reg.all()[1];
    EXPECT_FALSE(odd.sharded());
    EXPECT_TRUE(even.sharded());
    EXPECT_EQ(even.shard_rows, 3);
    EXPECT_EQ(even.shard_begin, 3 * world->rank());
    EXPECT_EQ(optimizer_state_bytes(sharded.reg).dense, (3 * 6 + 3 * 3) * 4);
    GradSync a(*plain.be, plain.reg, plain.groups);
    GradSync b(*sharded.be, sharded.reg, sharded.groups, Backend::StreamKind::kCompute, &zero1);
    a.finish();
    b.finish();
    EXPECT_EQ(values(odd.grad), values(plain.reg.all()[0]->grad));
    Tensor acc_a = plain.be->zeros({2}, DType::kF32), acc_b = sharded.be->zeros({2}, DType::kF32);
    partitioned_grad_sum_squares(*plain.be, plain.reg, plain.groups, nullptr, acc_a);
    partitioned_grad_sum_squares(*sharded.be, sharded.reg, sharded.groups, &zero1, acc_b);
    EXPECT_EQ(values(acc_a), values(acc_b));
    int updated_whole = 0;
    zero1.step([&](Param& p, const Tensor& grad, Tensor&) {
      if (p.numel() == p.master.numel()) ++updated_whole;
      sharded.be->copy(grad, p.master);
    });
    EXPECT_EQ(updated_whole, 1);
    for (size_t k = 0; k < specs.size(); ++k)
      EXPECT_EQ(values(sharded.reg.all()[k]->work), values(plain.reg.all()[k]->grad))
          << specs[k].name;
  });
}

}  // namespace
}  // namespace hp
