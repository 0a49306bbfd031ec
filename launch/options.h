// Typed run configuration, filled from an INI file plus command-line overrides
// (Boost.Program_options) and validated once, before any work, with messages that name the key.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/model/config.h"
#include "parallel/lane_arbiter.h"

namespace hp {

struct DataOptions {
  std::string source = "synthetic";  // "synthetic", .bin shard(s) (path, list or glob), or .h5
  int32_t eot_token = -1;            // -1: vocab_size - 1
  bool shuffle = true;
  int64_t synthetic_vocab = 0;  // 0: every id below eot_token
  double synthetic_zipf = 1.0;
  double synthetic_mean_doc_len = 64;
};

struct TrainOptions {
  std::string config_path;
  std::string config_text;   // the INI file as read, for records
  std::string command_line;  // the options after the subcommand, for records (overrides)
  ModelConfig model;
  DataOptions data;
  int64_t steps = 100;
  uint64_t seed = 1234;
  std::string device = "auto";    // cpu | cuda | auto (cuda when a GPU is present)
  std::string cpu_dtype = "f32";  // f32 | f64 (reference checks)
  int64_t batch_tokens = 8192;    // global tokens per step
  int64_t seq_len = 256;          // row length T
  double lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup_steps = 10;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double adam_eps = 1e-8;
  double grad_clip = 1.0;
  std::string metrics_path;
  int64_t log_every = 1;
  bool checkpoint_activations = false;
  std::string metadata = "cached";   // cached | per-layer
  std::string routing = "bincount";  // bincount | per-expert
  int64_t ce_chunk_tokens = 4096;
  // activation offload (framework/model/activation_store.h); offload != none implies
  // checkpoint_activations
  std::string offload = "none";  // none | single | double
  int offload_buffers = 2;       // double: device staging buffers (>= 2)
  int offload_lookahead = 1;     // double: blocks reloaded ahead (1 .. offload_buffers - 1)
  double sim_link_gbps = 0;      // cpu: simulated host link for offload copies, GB/s (0: off)
  int64_t pinned_pool_mib = 0;   // host pool for offloaded inputs (0: sized from model and batch)
  // node lane arbiter (parallel/lane_arbiter.h) for the offload copies, when offload != none
  std::string lane_arbiter = "off";  // on | off (off: each rank copies unarbitrated, the baseline)
  int64_t lane_chunk_mib = 8;        // copies move in granted chunks of this size
  int lane_inflight = 1;             // chunks in flight per host link
  // "auto": ranks grouped by their GPUs' PCIe root ports; "0,1;2,3": node ranks sharing a
  // link; "": the whole node on one link.
  std::string pcie_groups = "auto";
  bool dry_run = false;
  // parallel layout and launch
  int ep_size = 1;                    // expert-parallel group size; world = dp x ep
  std::string bootstrap;              // mpi | file:PATH | tcp:HOST:PORT ("" : from the launch)
  double collective_timeout_s = 300;  // a collective stuck this long becomes an error
  // checkpoints (docs/checkpoints.md)
  std::string checkpoint_dir;    // "" : no checkpoints
  int64_t checkpoint_every = 0;  // steps between saves (0: only at the end and on preemption)
  int64_t keep_last = 0;         // committed checkpoints kept (0: all)
  std::string resume = "none";   // none | auto | PATH
  int64_t stop_at_step = 0;  // end this run after this step (0: at `steps`); LR still spans steps
  // eval
  std::string eval_checkpoint;  // --checkpoint: a file or a checkpoint directory
  int64_t eval_batches = 10;    // --batches: global batches from the start of the data
  // bench
  int64_t bench_warmup = 2;
  int64_t bench_steps = 5;
  std::string bench_json;

  int64_t rows_per_batch() const { return batch_tokens / seq_len; }
};

// Parses `args` (everything after the subcommand). Returns false when --help was printed.
// Throws UserError(kConfig) with the key and rule on any mistake.
bool parse_train_options(const std::vector<std::string>& args, const std::string& subcommand,
                         TrainOptions& out);

// Checks cross-key rules (divisibility, enums) for a given world size.
void validate_train_options(const TrainOptions& o, int world_size);

// The lane arbiter's options from lane_arbiter, lane_chunk_mib, lane_inflight, pcie_groups; with
// a backend, also this rank's host link (its device's PCIe root port, for pcie_groups=auto).
LaneOptions make_lane_options(const TrainOptions& o, const Backend* be = nullptr);

}  // namespace hp
