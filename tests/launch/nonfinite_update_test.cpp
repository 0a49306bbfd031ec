// nonfinite=skip and an update that would itself make the weights non-finite: the AdamW op's
// check-only mode computes the update without writing it and flags what the update would write;
// the trainer runs it before every update under skip (one extra read), never under abort. And
// `hotpath inspect` of a file that is no checkpoint says so, with status 2.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "framework/checkpoint/checkpoint.h"
#include "launch/options.h"
#include "launch/tools/tools.h"
#include "launch/train/trainer.h"
#include "optim/adamw.h"
#include "tests/common/damaged_checkpoint.h"
#include "tests/common/launch_fixtures.h"

namespace fs = std::filesystem;

namespace hp {
namespace {

TrainOptions tiny_run(NonfinitePolicy policy, double lr) {
  TrainOptions o = test::small_dense_options();
  o.run.steps = 4;
  o.run.log_every = 100;
  o.run.nonfinite = policy;
  o.optimizer.warmup_steps = 0;
  o.optimizer.lr = lr;
  return o;
}

bool all_finite(Model& m) {
  for (auto& p : m.params().all()) {
    const float* w = p->master.data<float>();
    for (int64_t i = 0; i < p->master.numel(); ++i)
      if (!std::isfinite(w[i])) return false;
  }
  return true;
}

// lr = 1e39: finite as a double, but every weight's update leaves the float range.
constexpr double kOverflowLr = 1e39;

TEST(UpdateCheck, SkipNeverAppliesAnUpdateThatWouldOverflow) {
  Trainer t(tiny_run(NonfinitePolicy::kSkip, kOverflowLr), single_rank_context());
  const std::vector<std::vector<char>> before = test::state_bytes(t.model());
  for (int64_t step = 1; step <= 2; ++step) {
    const StepStats s = t.step();
    EXPECT_TRUE(std::isfinite(s.loss));  // the loss and gradients are fine; the update is not
    EXPECT_TRUE(s.skipped);
    EXPECT_FALSE(s.finite);
    EXPECT_TRUE(t.last_update_overflowed());
    EXPECT_EQ(s.skipped_steps, step);
    EXPECT_EQ(t.steps_done(), step);
    EXPECT_EQ(test::state_bytes(t.model()), before);  // bitwise: masters and both moments
    // The check's one read, besides the step's loss read.
    EXPECT_EQ(s.syncs.get(SyncCause::kLoss), 1);
    EXPECT_EQ(s.syncs.get(SyncCause::kOther), 1);
  }
}

TEST(UpdateCheck, SkipAppliesAFiniteUpdateAsAbortDoes) {
  Trainer skip(tiny_run(NonfinitePolicy::kSkip, 1e-2), single_rank_context());
  Trainer abort(tiny_run(NonfinitePolicy::kAbort, 1e-2), single_rank_context());
  for (int i = 0; i < 2; ++i) {
    const StepStats a = skip.step(), b = abort.step();
    EXPECT_FALSE(a.skipped);
    EXPECT_FALSE(skip.last_update_overflowed());
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(test::state_bytes(skip.model()), test::state_bytes(abort.model()));
  }
}

// One rank under abort issues its update before the step's read, gated on the device; under skip
// the host decides first. With clipping in force (grad_clip far below the norm) both give the
// same bits: the gate holds the host's clip coefficient.
TEST(UpdateCheck, GatedUpdateClipsAsTheHostDecidedOneDoes) {
  TrainOptions so = tiny_run(NonfinitePolicy::kSkip, 1e-2),
               ao = tiny_run(NonfinitePolicy::kAbort, 1e-2);
  so.optimizer.grad_clip = ao.optimizer.grad_clip = 1e-3;
  Trainer skip(so, single_rank_context());
  Trainer abort(ao, single_rank_context());
  for (int i = 0; i < 3; ++i) {
    const StepStats a = skip.step(), b = abort.step();
    EXPECT_GT(b.grad_norm, 10 * ao.optimizer.grad_clip);
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(a.grad_norm, b.grad_norm);
    EXPECT_EQ(test::state_bytes(skip.model()), test::state_bytes(abort.model()));
  }
}

TEST(UpdateCheck, AbortRunsNoCheckAndNoExtraSync) {
  Trainer t(tiny_run(NonfinitePolicy::kAbort, kOverflowLr), single_rank_context());
  const StepStats s = t.step();
  EXPECT_TRUE(s.finite);  // applied, as before: the next step's loss is what stops the run
  EXPECT_FALSE(all_finite(t.model()));
  EXPECT_EQ(s.syncs.get(SyncCause::kLoss), 1);
  EXPECT_EQ(s.syncs.get(SyncCause::kOther), 0);
}

TEST(UpdateCheck, MaxSkippedStepsInARowStopTheRun) {
  TrainOptions o = tiny_run(NonfinitePolicy::kSkip, kOverflowLr);
  o.run.steps = 20;
  o.run.max_skipped_steps = 2;
  std::string message;
  try {
    run_train(o, single_rank_context());
  } catch (const UserError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("stopping at step 3: 3 steps in a row were skipped"), std::string::npos)
      << message;
  EXPECT_NE(message.find("max_skipped_steps=2"), std::string::npos) << message;
  EXPECT_NE(message.find("lower lr"), std::string::npos) << message;
}

// The check-only mode of the CPU backend's op against the update itself, on random tensors: it
// writes nothing but the flag, and flags exactly when the update writes a non-finite value.
TEST(UpdateCheck, CheckOnlyModeFlagsWhatTheUpdateWouldWrite) {
  auto be = make_cpu_backend(DType::kF32);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int64_t n = 1031;
  auto random = [&](float scale) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = normal(rng) * scale;
    return v;
  };
  const AdamW opt(AdamWConfig{0.9, 0.95, 1e-8, 0.1});
  struct Case {
    double lr, grad_scale;
    float weight_scale, grad_size;
    DType working;
    bool expect_bad;
  };
  const float fmax = std::numeric_limits<float>::max();
  for (const Case& c : {
           Case{1e-3, 1.0, 1.f, 1.f, DType::kF32, false},
           Case{1e39, 1.0, 1.f, 1.f, DType::kF32, true},    // the weights leave the float range
           Case{1e-3, 1.0, 1.f, 1e20f, DType::kF32, true},  // g*g leaves it: v is inf
           Case{1e-3, 1e-30, 1.f, 1e20f, DType::kF32, false},
           // Finite in f32, rounded up to inf in a bf16 working copy.
           Case{1e-30, 1.0, fmax * 0.9999f, 1.f, DType::kBF16, true},
           Case{1e-30, 1.0, fmax * 0.9999f, 1.f, DType::kF32, false},
       }) {
    SCOPED_TRACE(testing::Message()
                 << "lr=" << c.lr << " grad_scale=" << c.grad_scale << " weights~" << c.weight_scale
                 << " grads~" << c.grad_size << " working=" << dtype_name(c.working));
    std::vector<float> w = random(1.f), g = random(c.grad_size), m = random(0.1f), v = random(0.1f);
    for (float& x : v) x = std::fabs(x);
    if (c.weight_scale > 1.f) std::fill(w.begin(), w.end(), c.weight_scale);
    Tensor master = Tensor::host_from(w, DType::kF32), grad = Tensor::host_from(g, DType::kF32);
    Tensor tm = Tensor::host_from(m, DType::kF32), tv = Tensor::host_from(v, DType::kF32);
    Tensor working = Tensor::host({n}, c.working);
    Tensor flag = Tensor::host_from(std::vector<float>{0.f}, DType::kF32);
    opt.check_update(*be, master, grad, tm, tv, true, 3, c.lr, c.grad_scale, working, flag);
    EXPECT_EQ(std::memcmp(master.data<float>(), w.data(), w.size() * 4), 0);
    EXPECT_EQ(std::memcmp(tm.data<float>(), m.data(), m.size() * 4), 0);
    EXPECT_EQ(std::memcmp(tv.data<float>(), v.data(), v.size() * 4), 0);
    EXPECT_EQ(flag.data<float>()[0], c.expect_bad ? 1.f : 0.f);
    // The update itself: non-finite somewhere exactly when flagged.
    opt.update(*be, master, grad, tm, tv, true, 3, c.lr, c.grad_scale, working);
    bool bad = false;
    for (int64_t i = 0; i < n; ++i)
      bad = bad || !std::isfinite(master.data<float>()[i]) || !std::isfinite(tm.data<float>()[i]) ||
            !std::isfinite(tv.data<float>()[i]);
    if (c.working == DType::kBF16) {
      std::vector<double> wk = to_double_vector(working);
      for (double x : wk) bad = bad || !std::isfinite(x);
    }
    EXPECT_EQ(bad, c.expect_bad);
  }
}

std::string inspect_stderr(const std::string& path, int* rc) {
  testing::internal::CaptureStderr();
  testing::internal::CaptureStdout();
  *rc = inspect_main({path});
  testing::internal::GetCapturedStdout();
  return testing::internal::GetCapturedStderr();
}

TEST(InspectCorrupt, AFileThatIsNoCheckpointIsNamedAsCorrupt) {
  const fs::path dir = test::fresh_temp_dir("inspect_corrupt");
  // Not HDF5 at all.
  const std::string garbage = (dir / "garbage.h5").string();
  std::ofstream(garbage) << "not an HDF5 file, whatever its name says\n";
  // A checkpoint whose group header (the link message of /params) is damaged: the groups
  // cannot be listed, though the file opens.
  const std::string damaged = (dir / "damaged.h5").string();
  test::write_damaged_checkpoint(damaged);
  for (const std::string& path : {garbage, damaged}) {
    int rc = 0;
    const std::string err = inspect_stderr(path, &rc);
    EXPECT_EQ(rc, 2) << path;
    EXPECT_NE(err.find("checkpoint " + path +
                       " cannot be read: the file is corrupt or not a hotpath checkpoint"),
              std::string::npos)
        << err;
    EXPECT_EQ(err.find(".cpp:"), std::string::npos) << err;  // no call sites
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace hp
