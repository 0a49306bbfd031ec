// hotpath import-hf and export-hf (docs/hf.md).
#include <boost/program_options.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "framework/checkpoint/checkpoint.h"
#include "framework/core/error.h"
#include "launch/hf/hf_convert.h"
#include "launch/hf/safetensors.h"
#include "launch/tools/tools.h"
#include "launch/train/checkpoint.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace hp {
namespace {

void parse(const std::vector<std::string>& args, const po::options_description& opts,
           const po::positional_options_description& pos, const char* cmd, po::variables_map& vm) {
  try {
    po::store(po::command_line_parser(args).options(opts).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    HP_USER_ERROR(ErrorKind::kUser, "hotpath ", cmd, ": ", e.what());
  }
}

// Writes `text` to `path` through path.tmp and a rename.
void write_text_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << text;
    f.flush();
    if (!f) {
      std::remove(tmp.c_str());
      HP_FAIL(ErrorKind::kIo, "cannot write ", tmp);
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    HP_FAIL(ErrorKind::kIo, "cannot rename ", tmp, " to ", path);
  }
}

}  // namespace

int import_hf_main(const std::vector<std::string>& args) {
  std::string dir, out, config_out;
  po::options_description opts("hotpath import-hf DIR --out FILE.h5");
  opts.add_options()("help,h", "print this help")("dir", po::value(&dir),
                                                  "Hugging Face checkpoint directory")(
      "out", po::value(&out), "the hotpath checkpoint to write (.h5)")(
      "config_out", po::value(&config_out),
      "the equivalent hotpath config file (default: --out with .ini for .h5)");
  po::positional_options_description pos;
  pos.add("dir", 1);
  po::variables_map vm;
  parse(args, opts, pos, "import-hf", vm);
  if (vm.count("help")) {
    std::cout << "usage: hotpath import-hf DIR --out FILE.h5 [--config_out FILE.ini]\n" << opts;
    return 0;
  }
  if (dir.empty() || out.empty())
    HP_USER_ERROR(ErrorKind::kUser, "hotpath import-hf: DIR and --out FILE.h5 are required");
  if (config_out.empty()) {
    fs::path p(out);
    config_out = p.replace_extension(".ini").string();
  }
  HfImport imp = read_hf_checkpoint(dir);
  std::string ini = str_cat("# ", imp.architecture, " imported from ", dir,
                            imp.mxfp4 ? " (MXFP4 experts dequantized to fp32)" : "", "\n",
                            "# max_position_embeddings = ", imp.max_positions, "\n");
  ini += model_config_ini(imp.model);
  if (imp.eot_token >= 0 && imp.eot_token < imp.model.vocab_size)
    ini += str_cat("eot_token = ", imp.eot_token, "\n");
  write_imported_checkpoint(out, imp, ini);
  write_text_file(config_out, ini);
  int64_t n = 0;
  for (const auto& t : imp.params) n += static_cast<int64_t>(t.data.size());
  std::cout << "imported " << imp.architecture << " from " << dir << ": " << imp.params.size()
            << " tensors, " << n << " parameters -> " << out << " (config " << config_out << ")\n";
  return 0;
}

int export_hf_main(const std::vector<std::string>& args) {
  std::string ckpt, out, dtype = "bf16", config;
  int64_t shard_mib = 4096, max_positions = 0;
  int32_t eot = -1;
  po::options_description opts("hotpath export-hf CKPT --out DIR");
  opts.add_options()("help,h", "print this help")(
      "checkpoint", po::value(&ckpt), "hotpath checkpoint file, or directory (its newest)")(
      "out", po::value(&out), "the directory to create")(
      "dtype", po::value(&dtype)->default_value(dtype), "tensor dtype: bf16 | f32")(
      "shard_mib", po::value(&shard_mib)->default_value(shard_mib),
      "largest shard size in MiB (a tensor larger than that gets a shard of its own)")(
      "config", po::value(&config),
      "hotpath config file of the model (default: the one recorded in the checkpoint)")(
      "max_positions", po::value(&max_positions)->default_value(0),
      "config.json max_position_embeddings (0: YaRN's factor x original context, else 4096)")(
      "eot_token", po::value(&eot)->default_value(-1),
      "config.json eos_token_id (-1: the config's eot_token, whose own -1 means vocab_size - 1)");
  po::positional_options_description pos;
  pos.add("checkpoint", 1);
  po::variables_map vm;
  parse(args, opts, pos, "export-hf", vm);
  if (vm.count("help")) {
    std::cout << "usage: hotpath export-hf CKPT --out DIR [--dtype bf16|f32] [--shard_mib N]\n"
              << opts;
    return 0;
  }
  if (ckpt.empty() || out.empty())
    HP_USER_ERROR(ErrorKind::kUser, "hotpath export-hf: CKPT and --out DIR are required");
  if (dtype != "bf16" && dtype != "f32")
    HP_USER_ERROR(ErrorKind::kUser, "hotpath export-hf: --dtype must be bf16 or f32, got '", dtype,
                  "'");
  if (shard_mib < 1) HP_USER_ERROR(ErrorKind::kUser, "hotpath export-hf: --shard_mib must be >= 1");
  std::error_code ec;
  if (fs::exists(out, ec))
    HP_USER_ERROR(ErrorKind::kUser, "hotpath export-hf: --out ", out,
                  " exists; name a new directory");
  const std::string path = resolve_checkpoint_arg(ckpt);
  CheckpointReader r(path);
  TrainOptions o;
  if (!config.empty()) {
    if (!parse_train_options({"--config", config}, "export-hf", o)) return 0;
  } else {
    parse_recorded_options(r.string_attr("config"), r.string_attr("command_line"), o);
  }
  const ModelConfig& m = o.model;
  m.validate();
  if (max_positions <= 0)
    max_positions =
        m.rope_scaling_factor > 1
            ? static_cast<int64_t>(m.rope_scaling_factor * m.rope_original_max_positions)
            : 4096;
  if (eot < 0)
    eot = o.data.eot_token >= 0 ? o.data.eot_token : static_cast<int32_t>(m.vocab_size - 1);
  const std::string st_dtype = dtype == "bf16" ? "BF16" : "F32";
  std::string arch;
  const std::string config_json = hf_config_json(m, max_positions, eot, st_dtype, &arch);
  const auto get = [&](const std::string& name, const Shape& shape) {
    const std::string ds = "/params/" + name;
    const DatasetInfo info = r.info(ds);
    if (info.shape != shape)
      HP_USER_ERROR(ErrorKind::kData, "checkpoint ", path, " dataset '", ds, "' has shape ",
                    shape_str(info.shape), "; the config implies ", shape_str(shape));
    std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
    r.read_rows(ds, RowRange{0, shape[0]}, DType::kF32, v.data());
    return v;
  };
  const std::vector<NamedTensor> tensors = hf_tensors_from_hotpath(m, arch, get);

  // Shards in tensor order, each up to shard_mib.
  const int64_t es = st_dtype == "BF16" ? 2 : 4, limit = shard_mib << 20;
  std::vector<std::vector<size_t>> shards(1);
  int64_t bytes = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t b = shape_numel(tensors[i].shape) * es;
    if (!shards.back().empty() && bytes + b > limit) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back().push_back(i);
    bytes += b;
    total += b;
  }
  const std::string tmp = out + ".tmp";
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp);
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", total}};
  nlohmann::ordered_json map = nlohmann::ordered_json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    std::vector<SafetensorsTensor> part;
    for (size_t i : shards[s]) {
      part.push_back({tensors[i].name, tensors[i].shape, tensors[i].data.data()});
      map[tensors[i].name] = name;
    }
    write_safetensors((fs::path(tmp) / name).string(), part, st_dtype, {{"format", "pt"}});
  }
  index["weight_map"] = map;
  write_text_file((fs::path(tmp) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  write_text_file((fs::path(tmp) / "config.json").string(), config_json);
  fs::rename(tmp, out);
  std::cout << "exported " << path << " as " << arch << " (" << dtype << ", " << shards.size()
            << " shards, " << total << " bytes) -> " << out << "\n";
  return 0;
}

}  // namespace hp
