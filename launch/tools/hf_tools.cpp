// hotpath import-hf and export-hf (docs/hf.md).
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/program_options.hpp>
#include <cerrno>
#include <climits>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <regex>

#include "framework/checkpoint/checkpoint.h"
#include "framework/core/error.h"
#include "launch/hf/hf_convert.h"
#include "launch/hf/safetensors.h"
#include "launch/options.h"
#include "launch/tools/tools.h"
#include "launch/train/run_checkpoint.h"

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

// The mode a new file or directory gets from the process umask (mkstemp and mkdtemp create
// theirs private).
mode_t umask_mode(mode_t base) {
  const mode_t mask = ::umask(0);
  ::umask(mask);
  return base & ~mask;
}

// `path` without trailing separators or "." components, for comparing and naming.
fs::path tidy(const std::string& path) {
  fs::path p = fs::path(path).lexically_normal();
  if (p.filename().empty() && p.has_parent_path()) p = p.parent_path();
  return p;
}

// The directory an output goes into ("." for a bare name).
fs::path parent_of(const fs::path& p) {
  return p.has_parent_path() ? p.parent_path() : fs::path(".");
}

// Two names of one file: equal after making them absolute, resolving "..", and following the
// symbolic links of the parts that exist.
bool same_path(const std::string& a, const std::string& b) {
  std::error_code ea, eb;
  const fs::path ca = fs::weakly_canonical(fs::absolute(tidy(a), ea), ea);
  const fs::path cb = fs::weakly_canonical(fs::absolute(tidy(b), eb), eb);
  if (ea || eb) return tidy(a) == tidy(b);
  return ca == cb;
}

// A file this run creates beside its final name, under a name no one else uses
// (.NAME.XXXXXX.tmp); removed when the run fails, renamed to the final name when it succeeds.
class TempOutput {
 public:
  // Refuses (UserError naming `flag`) an existing `path` unless `force`, a path that is a
  // directory, and a directory where the file cannot be created.
  TempOutput(const std::string& cmd, const std::string& flag, const std::string& path, bool force)
      : cmd_(cmd), flag_(flag), final_(path) {
    std::error_code ec;
    const fs::path p = tidy(path);
    if (p.filename().empty() || p.filename() == "." || p.filename() == "..")
      HP_USER_ERROR(ErrorKind::kUser, "hotpath ", cmd, ": ", flag, " ", path,
                    " is not a file name");
    if (fs::is_directory(p, ec))
      HP_USER_ERROR(ErrorKind::kUser, "hotpath ", cmd, ": ", flag, " ", path,
                    " is a directory; name the file to write");
    if (fs::exists(fs::symlink_status(p, ec)) && !force)
      HP_USER_ERROR(ErrorKind::kUser, "hotpath ", cmd, ": ", flag, " ", path,
                    " exists; name a new file, or give --force to replace it");
    const fs::path dir = parent_of(p);
    std::string tmpl = (dir / ("." + p.filename().string() + ".XXXXXX.tmp")).string();
    const int fd = ::mkstemps(tmpl.data(), 4);
    if (fd < 0) {
      const int err = errno;
      HP_USER_ERROR(ErrorKind::kUser, "hotpath ", cmd, ": ", flag, " ", path,
                    " cannot be written: cannot create a file in ",
                    fs::is_directory(dir, ec) ? "the directory " : "", dir.string(), " (",
                    std::strerror(err), ")");
    }
    ::fchmod(fd, umask_mode(0666));
    ::close(fd);
    tmp_ = tmpl;
  }
  ~TempOutput() {
    if (!tmp_.empty()) std::remove(tmp_.c_str());
  }
  TempOutput(const TempOutput&) = delete;
  TempOutput& operator=(const TempOutput&) = delete;
  const std::string& tmp() const { return tmp_; }
  // The temporary becomes the final name. Without `force` a file that appeared there since is
  // not replaced (link fails on an existing name).
  void commit(bool force) {
    bool ok = force ? std::rename(tmp_.c_str(), final_.c_str()) == 0
                    : ::link(tmp_.c_str(), final_.c_str()) == 0;
    if (!ok && !force && (errno == EPERM || errno == EOPNOTSUPP || errno == ENOSYS)) {
      // A file system without hard links: check, then rename.
      std::error_code ec;
      if (fs::exists(fs::symlink_status(final_, ec))) {
        errno = EEXIST;
      } else {
        ok = std::rename(tmp_.c_str(), final_.c_str()) == 0;
        if (ok) force = true;  // nothing left to remove
      }
    }
    if (!ok) {
      const int err = errno;
      if (err == EEXIST)
        HP_USER_ERROR(ErrorKind::kUser, "hotpath ", cmd_, ": ", flag_, " ", final_,
                      " was created by someone else while this ran; it was left as it is (give "
                      "--force to replace it)");
      HP_FAIL(ErrorKind::kIo, "hotpath ", cmd_, ": cannot rename ", tmp_, " to ", final_, ": ",
              std::strerror(err));
    }
    if (!force) std::remove(tmp_.c_str());
    tmp_.clear();
  }

 private:
  std::string cmd_, flag_, final_, tmp_;
};

// Why a write failed, in words: the system's reason (ENOSPC, EFBIG, EIO, ...) where the error
// carries one (HDF5's messages carry it as "error message = '...'"), not the library's text.
std::string write_failure(const std::exception& e) {
  const std::string m = e.what();
  const std::string tag = "error message = '";
  const size_t p = m.find(tag);
  if (p != std::string::npos) {
    const size_t q = m.find('\'', p + tag.size());
    if (q != std::string::npos) return m.substr(p + tag.size(), q - p - tag.size());
  }
  if (m.find("H5") != std::string::npos || m.find("hdf5") != std::string::npos)
    return "the HDF5 library could not write the file (is the disk full?)";
  // hotpath's own I/O errors: the message without the "io error on rank 0 at FILE:LINE: " prefix.
  static const std::regex prefix("^[a-z0-9 ]+ error( on rank [0-9]+)? at [^ ]+:[0-9]+: ");
  return std::regex_replace(m, prefix, "", std::regex_constants::format_first_only);
}

// Writes `text` to `path` (a file this run created) and syncs it to disk.
void write_text_synced(const std::string& path, const std::string& text) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) HP_FAIL(ErrorKind::kIo, "cannot write ", path, ": ", std::strerror(errno));
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  ok = std::fflush(f) == 0 && ok;
  ok = ::fsync(fileno(f)) == 0 && ok;
  const int err = errno;
  ok = std::fclose(f) == 0 && ok;
  if (!ok) HP_FAIL(ErrorKind::kIo, "cannot write ", path, ": ", std::strerror(err));
}

// A directory this run creates beside `out` (.NAME.tmp-XXXXXX); removed with everything in it
// when the run fails.
class TempDir {
 public:
  TempDir(const std::string& cmd, const std::string& flag, const fs::path& out) {
    std::error_code ec;
    const fs::path dir = parent_of(out);
    std::string tmpl = (dir / ("." + out.filename().string() + ".tmp-XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) == nullptr) {
      const int err = errno;
      HP_USER_ERROR(ErrorKind::kUser, "hotpath ", cmd, ": ", flag, " ", out.string(),
                    " cannot be written: cannot create a directory in ", dir.string(), " (",
                    std::strerror(err), ")");
    }
    ::chmod(tmpl.c_str(), umask_mode(0777));
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  void release() { path_.clear(); }

 private:
  std::string path_;
};

}  // namespace

int import_hf_main(const std::vector<std::string>& args) {
  std::string dir, out, config_out;
  bool force = false;
  po::options_description opts("hotpath import-hf DIR --out FILE.h5");
  opts.add_options()("help,h", "print this help")("dir", po::value(&dir),
                                                  "Hugging Face checkpoint directory")(
      "out", po::value(&out), "the hotpath checkpoint to write (.h5); must not exist")(
      "config_out", po::value(&config_out),
      "the equivalent hotpath config file (default: --out with .ini for .h5); must not exist")(
      "force", po::bool_switch(&force), "replace existing --out and --config_out files");
  po::positional_options_description pos;
  pos.add("dir", 1);
  po::variables_map vm;
  parse(args, opts, pos, "import-hf", vm);
  if (vm.count("help")) {
    std::cout << "usage: hotpath import-hf DIR --out FILE.h5 [--config_out FILE.ini] [--force]\n"
              << opts;
    return 0;
  }
  if (dir.empty() || out.empty())
    HP_USER_ERROR(ErrorKind::kUser, "hotpath import-hf: DIR and --out FILE.h5 are required");
  if (tidy(out).extension() == ".ini")
    HP_USER_ERROR(ErrorKind::kUser, "hotpath import-hf: --out ", out,
                  " names a config file (.ini); --out is the checkpoint to write (FILE.h5), "
                  "--config_out the config file");
  if (config_out.empty()) config_out = fs::path(tidy(out)).replace_extension(".ini").string();
  if (same_path(out, config_out))
    HP_USER_ERROR(ErrorKind::kUser, "hotpath import-hf: --config_out ", config_out,
                  " and --out ", out, " are the same file; name two different files");
  // Both outputs are created (under temporary names) before any work: a name that exists or a
  // directory that cannot be written is found now, not after the import.
  TempOutput ckpt_out("import-hf", "--out", out, force);
  TempOutput ini_out("import-hf", "--config_out", config_out, force);
  HfImport imp = read_hf_checkpoint(dir);
  std::string ini = str_cat("# ", imp.architecture, " imported from Hugging Face checkpoint",
                            imp.mxfp4 ? " (MXFP4 experts dequantized to fp32)" : "", "\n",
                            "# max_position_embeddings = ", imp.max_positions, "\n");
  ini += model_config_ini(imp.model);
  if (imp.eot_token >= 0 && imp.eot_token < imp.model.vocab_size)
    ini += str_cat("eot_token = ", imp.eot_token, "\n");
  try {
    write_imported_checkpoint(ckpt_out.tmp(), imp, ini, model_config_record(imp.model), dir);
    write_text_synced(ini_out.tmp(), ini);
  } catch (const UserError&) {
    throw;
  } catch (const std::exception& e) {
    HP_FAIL(ErrorKind::kIo, "hotpath import-hf: writing --out ", out, " failed: ", write_failure(e),
            " (nothing was written: the temporary files were removed",
            force ? ", and existing files left as they were)" : ")");
  }
  ckpt_out.commit(force);
  ini_out.commit(force);
  int64_t n = 0;
  for (const auto& t : imp.params) n += static_cast<int64_t>(t.data.size());
  std::cout << "imported " << imp.architecture << " from " << dir << ": " << imp.params.size()
            << " tensors, " << n << " parameters -> " << out << " (config " << config_out << ")\n";
  return 0;
}

int export_hf_main(const std::vector<std::string>& args) {
  std::string ckpt, out, dtype = "bf16", config;
  int64_t shard_mib = 4096, max_positions = 0;
  int64_t eot = -1;
  bool force = false;
  constexpr int64_t kMaxShardMib = int64_t{1} << 20;  // 1 TiB: shard_mib << 20 cannot overflow
  po::options_description opts("hotpath export-hf CKPT --out DIR");
  opts.add_options()("help,h", "print this help")(
      "checkpoint", po::value(&ckpt), "hotpath checkpoint file, or directory (its newest)")(
      "out", po::value(&out), "the directory to create; must not exist")(
      "dtype", po::value(&dtype)->default_value(dtype), "tensor dtype: bf16 | fp32")(
      "shard_mib", po::value(&shard_mib)->default_value(shard_mib),
      "largest shard size in MiB, 1 to 1048576 (a tensor larger than that gets a shard of its "
      "own)")("config", po::value(&config),
              "hotpath config file of the model (default: the one recorded in the checkpoint)")(
      "max_positions", po::value(&max_positions)->default_value(0),
      "config.json max_position_embeddings (0: YaRN's factor x original context, else 4096)")(
      "eot_token", po::value(&eot)->default_value(-1),
      "config.json eos_token_id, a token id (-1: the config's eot_token, whose own -1 means "
      "vocab_size - 1)")(
      "force", po::bool_switch(&force),
      "replace an existing --out directory holding a Hugging Face checkpoint (config.json)");
  po::positional_options_description pos;
  pos.add("checkpoint", 1);
  po::variables_map vm;
  parse(args, opts, pos, "export-hf", vm);
  if (vm.count("help")) {
    std::cout << "usage: hotpath export-hf CKPT --out DIR [--dtype bf16|fp32] [--shard_mib N] "
                 "[--force]\n"
              << opts;
    return 0;
  }
  if (ckpt.empty() || out.empty())
    HP_USER_ERROR(ErrorKind::kUser, "hotpath export-hf: CKPT and --out DIR are required");
  if (dtype == "f32")
    HP_USER_ERROR(
        ErrorKind::kUser,
        "hotpath export-hf: --dtype f32 is spelled fp32 (dtypes are fp32, fp64 and bf16)");
  if (dtype != "bf16" && dtype != "fp32")
    HP_USER_ERROR(ErrorKind::kUser, "hotpath export-hf: --dtype must be bf16 or fp32, got '",
                  dtype, "'");
  if (shard_mib < 1 || shard_mib > kMaxShardMib)
    HP_USER_ERROR(ErrorKind::kUser, "hotpath export-hf: --shard_mib must be in [1, ", kMaxShardMib,
                  "] (MiB), got ", shard_mib);
  if (max_positions < 0 || max_positions > INT32_MAX)
    HP_USER_ERROR(ErrorKind::kUser, "hotpath export-hf: --max_positions must be in [0, ",
                  INT32_MAX, "] (0: the default), got ", max_positions);
  if (eot < -1 || eot > INT32_MAX)
    HP_USER_ERROR(ErrorKind::kUser, "hotpath export-hf: --eot_token must be -1 or a token id, got ",
                  eot);
  const fs::path outp = tidy(out);
  if (outp.filename().empty() || outp.filename() == "." || outp.filename() == "..")
    HP_USER_ERROR(ErrorKind::kUser, "hotpath export-hf: --out ", out, " is not a directory name");
  std::error_code ec;
  const bool replace = fs::exists(fs::symlink_status(outp, ec));
  if (replace) {
    if (!force)
      HP_USER_ERROR(ErrorKind::kUser, "hotpath export-hf: --out ", out,
                    " exists; name a new directory, or give --force to replace an earlier export");
    // --force replaces what looks like an export (or an empty directory), never anything else.
    const bool is_dir = fs::is_directory(fs::symlink_status(outp, ec));
    const bool empty = is_dir && fs::is_empty(outp, ec);
    if (!is_dir || (!empty && !fs::exists(outp / "config.json", ec)))
      HP_USER_ERROR(ErrorKind::kUser, "hotpath export-hf: --out ", out,
                    is_dir ? " is a directory without config.json" : " is not a directory",
                    "; --force replaces only an earlier Hugging Face export. Name a new directory");
  }
  // The output is created (as a temporary directory beside it) before any work, so an --out that
  // cannot be written is found now; nothing this run did not create is ever removed.
  TempDir tmp("export-hf", "--out", outp);
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
  if (eot >= m.vocab_size)
    HP_USER_ERROR(ErrorKind::kUser, "hotpath export-hf: --eot_token ", eot,
                  " is outside the vocabulary; it must be -1 or in [0, ", m.vocab_size - 1,
                  "] (vocab_size ", m.vocab_size, ")");
  if (eot < 0)
    eot = o.data.eot_token >= 0 ? o.data.eot_token : static_cast<int32_t>(m.vocab_size - 1);
  const std::string st_dtype = dtype == "bf16" ? "BF16" : "F32";
  std::string arch;
  const std::string config_json =
      hf_config_json(m, max_positions, static_cast<int32_t>(eot), st_dtype, &arch);
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
  try {
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
      write_safetensors((fs::path(tmp.path()) / name).string(), part, st_dtype,
                        {{"format", "pt"}});
    }
    index["weight_map"] = map;
    write_text_synced((fs::path(tmp.path()) / "model.safetensors.index.json").string(),
                      index.dump(2) + "\n");
    write_text_synced((fs::path(tmp.path()) / "config.json").string(), config_json);
  } catch (const UserError&) {
    throw;
  } catch (const std::exception& e) {
    HP_FAIL(ErrorKind::kIo, "hotpath export-hf: writing --out ", out, " failed: ", write_failure(e),
            " (nothing was written: the partial export was removed",
            replace ? ", the existing --out left as it was)" : ")");
  }
  // Commit: the earlier export (with --force) is moved aside first and removed only once the new
  // one is in place.
  if (replace) {
    TempDir old("export-hf", "--out", outp);  // an empty directory: rename replaces it
    if (std::rename(outp.c_str(), old.path().c_str()) != 0)
      HP_FAIL(ErrorKind::kIo, "hotpath export-hf: cannot move the existing --out ", out,
              " aside: ", std::strerror(errno), " (nothing was changed)");
    if (std::rename(tmp.path().c_str(), outp.c_str()) != 0) {
      const int err = errno;
      std::rename(old.path().c_str(), outp.c_str());
      old.release();
      HP_FAIL(ErrorKind::kIo, "hotpath export-hf: cannot rename ", tmp.path(), " to ", out, ": ",
              std::strerror(err), " (the existing --out was put back)");
    }
    tmp.release();
  } else {
    if (fs::exists(fs::symlink_status(outp, ec)))
      HP_USER_ERROR(ErrorKind::kUser, "hotpath export-hf: --out ", out,
                    " was created by someone else while this ran; it was left as it is");
    if (std::rename(tmp.path().c_str(), outp.c_str()) != 0)
      HP_FAIL(ErrorKind::kIo, "hotpath export-hf: cannot rename ", tmp.path(), " to ", out, ": ",
              std::strerror(errno));
    tmp.release();
  }
  std::cout << "exported " << path << " as " << arch << " (" << dtype << ", " << shards.size()
            << " shards, " << total << " bytes) -> " << out << "\n";
  return 0;
}

}  // namespace hp
