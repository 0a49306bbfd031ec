#include "launch/cli.h"

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "framework/core/error.h"
#include "framework/core/log.h"
#include "framework/model/config.h"
#include "launch/bench/bench_step.h"
#include "launch/checkpointing.h"
#include "launch/options.h"
#include "launch/tools.h"
#include "launch/trainer.h"
#include "parallel/mpi_communicator.h"

namespace hp {
namespace {

constexpr const char* kUsage =
    "usage: hotpath <command> [options]\n"
    "\n"
    "commands:\n"
    "  train --config FILE [--key=value ...]   train a model (--dry-run: validate and count)\n"
    "  bench <scenario> --config FILE [...]    time hot-path variants side by side:\n"
    "                                          step, metadata, routing, alltoall, offload\n"
    "  eval --config FILE --checkpoint C [--data D] [--batches N]\n"
    "                                          mean loss of a checkpoint: eval_loss=... "
    "tokens=...\n"
    "  inspect CHECKPOINT                      step, layout, tensors and checksums of a "
    "checkpoint\n"
    "  data synth --out FILE.{bin,h5} [...]     write synthetic documents as a token file\n"
    "  --version                                print the version\n"
    "\n"
    "'hotpath <command> --help' lists every option with its default.\n";

// Runs `body` as one rank of the job: finds the launch, meets the other ranks, builds the process
// groups. A failure on any rank is logged with its rank and tears the whole job down (no rank
// waits forever for a peer that has died).
template <typename Body>
int with_rank_context(const TrainOptions& o, int* argc, char*** argv, Body body) {
  LaunchInfo launch = detect_launch();
  set_error_rank(launch.rank);
  LogOptions lo;
  lo.rank = launch.rank;
  configure_logging(lo);
  // Options are checked on every rank before any collective: a bad config fails fast everywhere.
  validate_train_options(o, launch.world);
  Bootstrap boot = o.bootstrap.empty() ? default_bootstrap(launch) : parse_bootstrap(o.bootstrap);
  std::unique_ptr<MpiSession> mpi;
  if (boot.kind == Bootstrap::Kind::kMpi) mpi = std::make_unique<MpiSession>(argc, argv);
  CommOptions co;
  co.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.collective_timeout_s * 1000));
  RankContext ctx;
  ctx.launch = launch;
  ctx.groups = make_process_groups(create_world(launch, boot, co), o.ep_size);
  try {
    return body(ctx);
  } catch (const std::exception& e) {
    if (ctx.groups.world && ctx.groups.world->size() > 1) ctx.groups.world->abort(e.what());
    throw;
  }
}

int train_main(const std::vector<std::string>& args, int* argc, char*** argv) {
  TrainOptions o;
  if (!parse_train_options(args, "train", o)) return 0;
  if (o.dry_run) {
    validate_train_options(o, 1);
    const ParamCounts pc = count_params(o.model);
    std::printf("params: total=%lld active=%lld\n", static_cast<long long>(pc.total),
                static_cast<long long>(pc.active));
    return 0;
  }
  return with_rank_context(o, argc, argv,
                           [&](const RankContext& ctx) { return run_train(o, ctx); });
}

int eval_main(const std::vector<std::string>& args, int* argc, char*** argv) {
  TrainOptions o;
  if (!parse_train_options(args, "eval", o)) return 0;
  return with_rank_context(o, argc, argv, [&](const RankContext& ctx) { return run_eval(o, ctx); });
}

int bench_main(const std::vector<std::string>& args, int* argc, char*** argv) {
  if (args.empty() || args[0].rfind("--", 0) == 0)
    HP_USER_ERROR(
        ErrorKind::kUser,
        "hotpath bench: name a scenario first (step, metadata, routing, alltoall, offload), e.g. "
        "'hotpath bench step --config FILE'");
  TrainOptions o;
  std::vector<std::string> rest(args.begin() + 1, args.end());
  if (!parse_train_options(rest, "bench " + args[0], o)) return 0;
  return with_rank_context(o, argc, argv,
                           [&](const RankContext& ctx) { return run_bench(args[0], o, ctx); });
}

}  // namespace

int run_cli(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
      std::cout << kUsage;
      return args.empty() ? 2 : 0;
    }
    if (args[0] == "--version" || args[0] == "version") {
      std::cout << "hotpath " << HOTPATH_VERSION << "\n";
      return 0;
    }
    const std::string cmd = args[0];
    std::vector<std::string> rest(args.begin() + 1, args.end());
    if (cmd == "train") return train_main(rest, &argc, &argv);
    if (cmd == "bench") return bench_main(rest, &argc, &argv);
    if (cmd == "data") return data_tool_main(rest);
    if (cmd == "eval") return eval_main(rest, &argc, &argv);
    if (cmd == "inspect") return inspect_main(rest);
    std::cerr << "hotpath: unknown command '" << cmd << "'\n\n" << kUsage;
    return 2;
  } catch (const UserError& e) {
    log_error(e.what());
    return 2;
  } catch (const std::exception& e) {
    log_error(e.what());
    return 1;
  }
}

}  // namespace hp
