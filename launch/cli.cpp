#include "launch/cli.h"

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "framework/core/error.h"
#include "framework/core/log.h"
#include "framework/model/config.h"
#include "launch/options.h"
#include "launch/tools.h"
#include "launch/trainer.h"

namespace hp {
namespace {

constexpr const char* kUsage =
    "usage: hotpath <command> [options]\n"
    "\n"
    "commands:\n"
    "  train --config FILE [--key=value ...]   train a model (--dry-run: validate and count)\n"
    "  bench <scenario> --config FILE [...]    time hot-path variants side by side (step)\n"
    "  data synth --out FILE.{bin,h5} [...]     write synthetic documents as a token file\n"
    "  --version                                print the version\n"
    "\n"
    "'hotpath <command> --help' lists every option with its default.\n";

int train_main(const std::vector<std::string>& args) {
  TrainOptions o;
  if (!parse_train_options(args, "train", o)) return 0;
  if (o.dry_run) {
    validate_train_options(o, 1);
    const ParamCounts pc = count_params(o.model);
    std::printf("params: total=%lld active=%lld\n", static_cast<long long>(pc.total),
                static_cast<long long>(pc.active));
    return 0;
  }
  return run_train(o);
}

int bench_main(const std::vector<std::string>& args) {
  if (args.empty() || args[0].rfind("--", 0) == 0)
    HP_USER_ERROR(ErrorKind::kUser, "hotpath bench: name a scenario first (available: step), e.g. "
                                    "'hotpath bench step --config FILE'");
  TrainOptions o;
  std::vector<std::string> rest(args.begin() + 1, args.end());
  if (!parse_train_options(rest, "bench " + args[0], o)) return 0;
  return run_bench(args[0], o);
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
    if (cmd == "train") return train_main(rest);
    if (cmd == "bench") return bench_main(rest);
    if (cmd == "data") return data_tool_main(rest);
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
