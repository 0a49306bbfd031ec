// GradSync on the cpu backend, ranks as threads over TCP loopback: dense gradients are summed
// over the world and expert gradients over dp, layer by layer as the hook reports them and the
// rest in finish(), step after step, without a host sync. Asking for the comm stream changes
// nothing on the cpu (its events are complete when recorded) and gives the same bits.
// The NCCL path (comm stream, events) is covered by tests/gpu/nccl_test.cpp.
#include "parallel/grad_sync.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "framework/backend/backend.h"
#include "parallel/launch_env.h"
#include "parallel/process_groups.h"
#include "parallel/store_communicator.h"
#include "tests/parallel/tcp_threads.h"

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
  test::run_tcp_threads(world_size, [&](const CommPtr& world) {
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
  test::run_tcp_threads(2, [&](const CommPtr& world) {
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

}  // namespace
}  // namespace hp
