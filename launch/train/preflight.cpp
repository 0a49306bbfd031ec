#include "launch/train/preflight.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "framework/core/error.h"
#include "framework/model/config.h"
#include "launch/train/memory_plan.h"

namespace fs = std::filesystem;

namespace hp {
namespace {

[[noreturn]] void fail(const char* key, const std::string& path, const std::string& why) {
  HP_USER_ERROR(ErrorKind::kConfig, "config key '", key, "': cannot write '", path, "': ", why,
                " (checked before the run starts)");
}

void make_dirs(const char* key, const fs::path& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    fail(key, dir.string(), "it exists and is not a directory");
  fs::create_directories(dir, ec);
  if (ec) fail(key, dir.string(), "cannot create the directory: " + ec.message());
}

// A new file in `dir` is created, written, flushed and removed.
void probe_directory(const char* key, const std::string& dir, int rank) {
  make_dirs(key, dir);
  const std::string probe = (fs::path(dir) / (".hotpath_write_probe." + std::to_string(rank) + "." +
                                              std::to_string(::getpid())))
                                .string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail(key, dir, std::strerror(errno));
  const char byte = 0;
  const bool ok = ::write(fd, &byte, 1) == 1 && ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  ::unlink(probe.c_str());
  if (!ok) fail(key, dir, std::strerror(err));
}

// The file is opened for appending (never truncated here); one this check created is removed.
void probe_file(const char* key, const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) fail(key, path, "it is a directory");
  make_dirs(key, fs::path(path).parent_path());
  const bool existed = fs::exists(path, ec);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) fail(key, path, std::strerror(errno));
  ::close(fd);
  if (!existed) ::unlink(path.c_str());
}

// Physical memory, or the cgroup (v2, then v1) limit where that is lower; -1 when unknown.
int64_t host_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  int64_t bytes = pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : -1;
  for (const char* f :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(f);
    long long limit = 0;
    if (in >> limit && limit > 0 && (bytes < 0 || limit < bytes)) bytes = limit;
  }
  return bytes;
}

double gib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 30); }

}  // namespace

int64_t cpu_rank_memory_lower_bound(const TrainOptions& o, int world) {
  const ModelConfig& m = o.model;
  const int64_t elem = dtype_size(o.device.cpu_dtype);
  // Parameters, gradients and optimizer state exactly, as the memory plan counts them (the
  // expert blocks split over the ep group, zero1's shards).
  const MemoryPlan plan = plan_memory(o, layout_of(o, std::max(1, world)), /*cuda=*/false);
  const int64_t params = plan.params + plan.grads + plan.optimizer;
  // Activations: at least the residual stream and three more [tokens, d_model] tensors per
  // layer (one layer's worth plus the block inputs with checkpointing), and a chunk of logits.
  const int64_t tokens = o.data.batch_tokens / std::max(1, world);
  const bool ckpt =
      o.compute.checkpoint_activations || o.compute.offload.mode != OffloadMode::kNone;
  const int64_t per_token = int64_t{m.d_model} * elem * (ckpt ? m.n_layers + 4 : 4 * m.n_layers);
  const int64_t logits =
      std::min<int64_t>(o.compute.ce_chunk_tokens, tokens) * m.vocab_size * elem * 2;
  return params + tokens * per_token + logits;
}

void check_cpu_memory(const TrainOptions& o, int world, int ranks_here, int64_t available) {
  if (available < 0) available = host_memory_bytes();
  if (available <= 0) return;
  const int64_t need = cpu_rank_memory_lower_bound(o, world) * std::max(1, ranks_here);
  if (need <= available) return;
  TrainOptions no_batch = o;
  no_batch.data.batch_tokens = 0;
  const int64_t params_only =
      cpu_rank_memory_lower_bound(no_batch, world) * std::max(1, ranks_here);
  if (params_only > available)
    HP_USER_ERROR(
        ErrorKind::kConfig, "the model (vocab_size, d_model, n_layers, ...) needs at least ",
        gib(params_only), " GiB of host memory for ", std::max(1, ranks_here),
        " rank(s) of the CPU backend (parameters, gradients, AdamW moments); this machine has ",
        gib(available), " GiB");
  HP_USER_ERROR(ErrorKind::kConfig, "config key 'batch_tokens': ", o.data.batch_tokens,
                " tokens need at least ", gib(need), " GiB of host memory for ",
                std::max(1, ranks_here), " rank(s) of the CPU backend (",
                o.data.batch_tokens / std::max(1, world),
                " tokens per rank), more than this machine's ", gib(available),
                " GiB; lower batch_tokens, set checkpoint_activations=true or use more machines");
}

void check_outputs_writable(const TrainOptions& o, const std::string& command, int rank) {
  if (command == "train" && !o.checkpoint.dir.empty())
    probe_directory("checkpoint_dir", o.checkpoint.dir, rank);
  if (rank != 0) return;
  if (command == "train" && !o.run.metrics_path.empty())
    probe_file("metrics_path", o.run.metrics_path);
  if (command.rfind("bench", 0) == 0 && !o.bench.json.empty())
    probe_file("bench_json", o.bench.json);
  if (command == "eval" && !o.eval.json.empty()) probe_file("eval_json", o.eval.json);
}

}  // namespace hp
