#include "launch/train/rank_context.h"

#include <chrono>
#include <vector>

#include "framework/core/error.h"
#include "framework/core/log.h"
#include "launch/train/preflight.h"
#include "parallel/mpi_communicator.h"
#if HOTPATH_HAVE_CUDA
#include "framework/backend/cuda/cuda_backend.h"
#endif

namespace hp {
namespace {

// Whether make_backend() will pick the CPU backend ("auto": CUDA when a GPU is present).
bool uses_cpu_backend(const TrainOptions& o) {
#if HOTPATH_HAVE_CUDA
  return o.device.kind == DeviceKind::kCpu ||
         (o.device.kind == DeviceKind::kAuto && cuda_device_count() == 0);
#else
  return o.device.kind != DeviceKind::kCuda;
#endif
}

}  // namespace

RankContext single_rank_context() {
  RankContext ctx;
  ctx.groups = make_process_groups(create_world(ctx.launch, default_bootstrap(ctx.launch)), 1);
  return ctx;
}

bool any_rank(const RankContext& ctx, bool flag) {
  if (ctx.world() <= 1) return flag;
  Tensor f = Tensor::host_from(std::vector<int32_t>{flag ? 1 : 0}, DType::kI32);
  ctx.groups.world->all_reduce(f, ReduceOp::kMax);
  return f.data<int32_t>()[0] != 0;
}

Job::Job(const TrainOptions& o, int* argc, char*** argv) {
  const LaunchInfo launch = detect_launch();
  set_error_rank(launch.rank);
  LogOptions lo;
  lo.rank = launch.rank;
  configure_logging(lo);
  // `o` passed validate_train_options for launch.world in main, before the ranks meet.
  // Before any allocation: a batch that cannot fit is refused naming the key.
  if (uses_cpu_backend(o))
    check_cpu_memory(o, launch.world, launch.local_world > 0 ? launch.local_world : 1);
  const Bootstrap boot = choose_bootstrap(launch, o.parallel.bootstrap, uses_cpu_backend(o));
  if (boot.kind == Bootstrap::Kind::kMpi) mpi_ = std::make_unique<MpiSession>(argc, argv);
  CommOptions co;
  co.timeout =
      std::chrono::milliseconds(static_cast<int64_t>(o.parallel.collective_timeout_s * 1000));
  ctx_.launch = launch;
  ctx_.groups = make_process_groups(create_world(launch, boot, co), o.parallel.ep_size);
}

Job::~Job() = default;

void Job::abort(const char* reason, int exit_code) noexcept {
  MpiCommunicator::set_abort_exit_code(exit_code);
  if (ctx_.groups.world && ctx_.groups.world->size() > 1) ctx_.groups.world->abort(reason);
}

}  // namespace hp
