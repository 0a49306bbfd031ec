// The hotpath executable: one subcommand per job, each run as one rank of the job.
//
//   hotpath train ...   -> run_train (launch/train/trainer.cpp) -> Trainer::step, the step
//
// Exit status: 0 done; 2 a user's mistake (bad option, config, input), with a message naming it;
// 1 a failure at run time; 75 preempted after saving a checkpoint (requeue). A failure on any
// rank aborts the job's communicators, so no peer waits forever.
#include <cstdio>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "framework/core/error.h"
#include "framework/core/hdf5_util.h"
#include "framework/core/log.h"
#include "framework/model/config.h"
#include "launch/bench/bench_step.h"
#include "launch/cpu_threads.h"
#include "launch/json.h"
#include "launch/options.h"
#include "launch/tools/tools.h"
#include "launch/train/components.h"
#include "launch/train/fault_injection.h"
#include "launch/train/memory_plan.h"
#include "launch/train/preemption.h"
#include "launch/train/preflight.h"
#include "launch/train/rank_context.h"
#include "launch/train/trainer.h"
#include "parallel/launch_env.h"

namespace hp {
namespace {

constexpr const char* kUsage =
    "usage: hotpath <command> [options]\n"
    "\n"
    "commands:\n"
    "  train --config FILE [--key=value ...]   train a model (--dry-run: validate and count)\n"
    "  bench <scenario> --config FILE [...]    time hot-path variants side by side:\n"
    "                                          step, metadata, routing, alltoall, offload,\n"
    "                                          attention, gemm\n"
    "  eval --config FILE --checkpoint C [--data D] [--batches N]\n"
    "                                          mean loss of a checkpoint: eval_loss=... "
    "tokens=...\n"
    "  inspect CHECKPOINT                      step, layout, tensors and checksums of a "
    "checkpoint\n"
    "  data synth --out FILE.{bin,h5} [...]     write synthetic documents as a token file\n"
    "  import-hf DIR --out FILE.h5              a Hugging Face checkpoint as a hotpath one\n"
    "  export-hf CKPT --out DIR [--dtype bf16]  a hotpath checkpoint as a Hugging Face one\n"
    "  --version                                print the version\n"
    "\n"
    "'hotpath <command> --help' lists every option with its default.\n";

// --dry-run, on options validated for the planned `world`: print parameter counts and the memory
// plan of one rank; exit 2 (before any allocation) when it does not fit the device or, on the CPU
// backend, when one rank needs more than this host's memory (the check a run makes).
int dry_run(const TrainOptions& o, int world) {
  const ParamCounts pc = count_params(o.model);
  std::printf("params: total=%lld active=%lld\n", static_cast<long long>(pc.total),
              static_cast<long long>(pc.active));
  const bool cuda = o.device.kind != DeviceKind::kCpu;
  const MemoryPlan plan = plan_memory(o, layout_of(o, world), cuda);
  const int64_t device = planned_device_bytes(o, visible_device_bytes(o, 0));
  std::fputs(format_plan(plan, device).c_str(), stdout);
  std::fflush(stdout);
  if (!o.plan_json.empty()) write_json_file(o.plan_json, plan_json(plan, device), "plan_json");
  require_plan_fits(o, plan, device, /*with_plan=*/false);
  if (!cuda) check_cpu_memory(o, world, 1);
  if (preemption_requested()) {
    log_warn("preemption signal during the dry run; exit status ", kRequeueExitCode);
    return kRequeueExitCode;
  }
  return 0;
}

int run(std::vector<std::string> args, int* argc, char*** argv) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::cout << kUsage;
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "--version" || args[0] == "version") {
    std::cout << "hotpath " << HOTPATH_VERSION << "\n";
    return 0;
  }
  const std::string cmd = args[0];
  args.erase(args.begin());
  // Only a training run stops at a step boundary for SIGUSR1/SIGTERM; everything else ends on
  // them as it always did.
  if (cmd != "train") restore_default_signal_actions();
  if (cmd == "data") return data_tool_main(args);
  if (cmd == "inspect") return inspect_main(args);
  if (cmd == "import-hf") return import_hf_main(args);
  if (cmd == "export-hf") return export_hf_main(args);
  if (cmd != "train" && cmd != "eval" && cmd != "bench") {
    std::cerr << "hotpath: unknown command '" << cmd << "'\n\n" << kUsage;
    return 2;
  }
  std::string scenario;  // bench: the first argument
  if (cmd == "bench") {
    if (args.empty() || args[0].rfind("--", 0) == 0)
      HP_USER_ERROR(ErrorKind::kUser,
                    "hotpath bench: name a scenario first (step, metadata, routing, alltoall, "
                    "offload, attention, gemm), e.g. 'hotpath bench step --config FILE'");
    scenario = args[0];
    args.erase(args.begin());
  }
  TrainOptions o;
  if (!parse_train_options(args, scenario.empty() ? cmd : "bench " + scenario, o)) return 0;
  if (o.config_path.empty() && o.model.vocab_size == 0)
    HP_USER_ERROR(ErrorKind::kConfig, "hotpath ", cmd,
                  ": no model: give --config FILE (e.g. --config examples/configs/tiny-moe.ini) "
                  "or the model keys on the command line");
  // Flags of the dry run only: refused elsewhere rather than ignored.
  if (!(cmd == "train" && o.dry_run) && (o.plan_world > 0 || !o.plan_json.empty()))
    HP_USER_ERROR(ErrorKind::kConfig, "hotpath ", cmd, ": ",
                  o.plan_world > 0 ? str_cat("--plan_world=", o.plan_world)
                                   : str_cat("--plan_json=", o.plan_json),
                  " plans a layout without running it and needs --dry-run (hotpath train "
                  "--dry-run ...); without --dry-run it would be ignored");
  if (cmd != "eval" && o.eval.force)
    HP_USER_ERROR(ErrorKind::kConfig, "hotpath ", cmd,
                  ": --force only lets hotpath eval --dump_logits replace an existing file");
  // The one validation of the options, before any work: a dry run's for the world it plans, a
  // run's for the launch's world (the launcher's environment says it before the ranks meet).
  // Everything after this receives the validated options.
  const bool dry = cmd == "train" && o.dry_run;
  const LaunchInfo launch = detect_launch();
  const int world = dry ? (o.plan_world > 0 ? o.plan_world : 1) : launch.world;
  validate_train_options(o, world);
  if (dry) return dry_run(o, world);
  // Outputs are checked before the ranks meet, so a run that cannot save does not start.
  check_outputs_writable(o, scenario.empty() ? cmd : "bench", launch.rank);
  Job job(o, argc, argv);  // this process as one rank: launch, rendezvous, process groups
  log_info(describe_cpu_threads());
  try {
    if (cmd == "train") return run_train(o, job.context());
    if (cmd == "eval") return run_eval(o, job.context());
    return run_bench(scenario, o, job.context());
  } catch (const UserError& e) {
    job.abort(e.what(), 2);  // the status of a single process (main)
    throw;
  } catch (const std::exception& e) {
    job.abort(e.what(), 1);
    throw;
  }
}

}  // namespace
}  // namespace hp

int main(int argc, char** argv) {
  // Before anything else: SIGUSR1/SIGTERM only set a flag (a training run stops for them before
  // its first step or at a step boundary, exit status 75). One that arrives while they are
  // blocked stays pending and is delivered when they are unblocked.
  hp::install_preemption_handlers();
  hp::maybe_inject_startup_signal();  // tests: HOTPATH_FAULT=sigterm:RANK:0
  hp::apply_omp_defaults();           // threads per rank (launch/cpu_threads.h)
  hp::unblock_preemption_signals();
  hp::h5_skip_exit_handler();
  try {
    return hp::run(std::vector<std::string>(argv + 1, argv + argc), &argc, &argv);
  } catch (const hp::UserError& e) {
    hp::log_error(e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    hp::log_error(
        "out of host memory (std::bad_alloc): lower batch_tokens, seq_len or the model size");
    return 1;
  } catch (const std::exception& e) {
    hp::log_error(e.what());
    return 1;
  }
}
