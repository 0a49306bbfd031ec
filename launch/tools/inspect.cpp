#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>

#include "framework/checkpoint/checkpoint.h"
#include "framework/core/error.h"
#include "framework/model/config.h"
#include "launch/options.h"
#include "launch/tools/tools.h"
#include "launch/train/run_checkpoint.h"

namespace hp {
namespace {

// What HDF5 said, without the call site and the library's function names: "hdf5 error ... at
// FILE:LINE: CALL failed on checkpoint PATH: H5X__fn: what (detail)" -> "what (detail)".
std::string hdf5_reason(const std::string& what, const std::string& path) {
  std::string r = what;
  const std::string marker = "failed on checkpoint " + path + ": ";
  const size_t at = r.find(marker);
  if (at != std::string::npos) r = r.substr(at + marker.size());
  if (r.rfind("H5", 0) == 0) {
    const size_t colon = r.find(": ");
    if (colon != std::string::npos && r.find(' ') > colon) r = r.substr(colon + 2);
  }
  return r;
}

// A file that cannot be opened or walked as a checkpoint: one line naming it, status 2, as eval
// and resume report it.
int corrupt(const std::string& path, const std::string& why) {
  std::cout << "checkpoint: " << path << "\n";
  std::cerr << "hotpath inspect: checkpoint " << path
            << " cannot be read: the file is corrupt or not a hotpath checkpoint (" << why << ")\n";
  return 2;
}

}  // namespace

int inspect_main(const std::vector<std::string>& args) {
  if (args.size() != 1 || args[0] == "--help" || args[0] == "-h") {
    std::cerr << "usage: hotpath inspect CHECKPOINT  (a step_<N>.h5 file, or a checkpoint "
                 "directory: its newest)\n";
    return args.size() == 1 ? 0 : 2;
  }
  const std::string path = resolve_checkpoint_arg(args[0]);
  std::unique_ptr<CheckpointReader> r;
  try {
    r = std::make_unique<CheckpointReader>(path);
  } catch (const UserError& e) {
    // Missing, not a hotpath checkpoint, an unsupported version: said as such.
    std::cerr << "hotpath inspect: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    return corrupt(path, hdf5_reason(e.what(), path));
  }
  int failures = 0;
  std::cout << "checkpoint: " << path << "\n";
  try {
    std::cout << "format: " << r->string_attr("format") << " v" << r->int_attr("format_version")
              << " (hotpath " << r->string_attr("hotpath_version") << ", HDF5 "
              << r->string_attr("hdf5_version") << ")\n";
    std::cout << "step: " << r->int_attr("step") << "\n";
    std::cout << "layout: world=" << r->int_attr("world") << " dp=" << r->int_attr("dp")
              << " ep=" << r->int_attr("ep") << "\n";
    if (r->has_attr("skipped_steps"))
      std::cout << "skipped_steps: " << r->int_attr("skipped_steps") << "\n";
  } catch (const std::exception& e) {
    ++failures;
    std::cout << "attributes: FAILED: " << e.what() << "\n";
  }
  std::vector<DatasetInfo> sets;
  try {
    sets = r->datasets();
  } catch (const std::exception& e) {
    return corrupt(path, "its groups cannot be listed: " + hdf5_reason(e.what(), path));
  }
  int64_t total = 0;
  for (const DatasetInfo& d : sets) total += d.bytes();
  std::cout << "tensors: " << sets.size() << " datasets, " << total << " bytes\n";
  // Completeness: every dataset the saving run listed (from its model config) must be there.
  try {
    if (r->has_attr("datasets")) {
      std::istringstream listed(r->string_attr("datasets"));
      int64_t missing = 0;
      for (std::string name; std::getline(listed, name);) {
        if (name.empty()) continue;
        bool found = false;
        for (const DatasetInfo& d : sets) found = found || d.name == name;
        if (!found) {
          ++missing;
          std::cout << "  " << name << " MISSING (listed by the checkpoint, not in the file)\n";
        }
      }
      if (missing > 0) {
        failures += static_cast<int>(missing);
        std::cout << "completeness: FAILED (" << missing << " datasets missing)\n";
      }
    } else {
      std::cout << "completeness: the file lists no datasets\n";
    }
    // And against the saved model config: the parameter count it implies, in /params and in
    // each AdamW moment.
    if (r->has_attr("model_config")) {
      std::vector<std::string> keys;
      std::istringstream record(r->string_attr("model_config"));
      for (std::string line; std::getline(record, line);)
        if (!line.empty()) keys.push_back("--" + line);
      TrainOptions saved;
      parse_train_options(keys, "inspect", saved);
      const int64_t want = count_params(saved.model).total;
      int64_t params = 0, m = 0, v = 0;
      const auto ends_with = [](const std::string& a, const char* b) {
        const size_t n = std::char_traits<char>::length(b);
        return a.size() >= n && a.compare(a.size() - n, n, b) == 0;
      };
      for (const DatasetInfo& d : sets) {
        const int64_t n = shape_numel(d.shape);
        if (d.name.rfind("/params/", 0) == 0) params += n;
        if (d.name.rfind("/optim/", 0) == 0 && ends_with(d.name, "/m")) m += n;
        if (d.name.rfind("/optim/", 0) == 0 && ends_with(d.name, "/v")) v += n;
      }
      if (params != want || m != want || v != want) {
        ++failures;
        std::cout << "completeness: FAILED: the saved model config has " << want
                  << " parameters; the file holds " << params << " in /params, " << m
                  << " in the first and " << v << " in the second AdamW moments\n";
      } else {
        std::cout << "completeness: ok (" << want << " parameters, as the saved model config)\n";
      }
    }
  } catch (const std::exception& e) {
    ++failures;
    std::cout << "completeness: FAILED: " << e.what() << "\n";
  }
  for (const DatasetInfo& d : sets) {
    std::cout << "  " << d.name << " " << dtype_name(d.dtype) << " " << shape_str(d.shape) << " "
              << d.bytes() << " bytes";
    try {
      int64_t nonfinite = 0;
      const uint64_t h = r->verify(d.name, &nonfinite);
      std::cout << " fnv64=" << std::hex << std::setw(16) << std::setfill('0') << h << std::dec
                << std::setfill(' ');
      if (nonfinite > 0) {
        ++failures;
        std::cout << " NON-FINITE: " << nonfinite << " values are inf or NaN\n";
        continue;
      }
      std::cout << " ok";
      if (d.dtype == DType::kI64 && d.shape[0] <= 8) {
        std::vector<int64_t> v = r->read_i64(d.name);
        std::cout << " =";
        for (int64_t x : v) std::cout << " " << x;
      }
      std::cout << "\n";
    } catch (const std::exception& e) {
      ++failures;
      std::cout << " CORRUPT: " << e.what() << "\n";
    }
  }
  if (failures == 0)
    std::cout << "checksums: ok (" << sets.size() << " datasets verified)\n";
  else
    std::cout << "checksums: FAILED (" << failures << " problems in " << path << ")\n";
  return failures == 0 ? 0 : 1;
}

}  // namespace hp
