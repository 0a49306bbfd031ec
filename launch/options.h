// Typed run configuration, filled from an INI file plus command-line overrides
// (Boost.Program_options; the same `key = value` names in both). The option structs are the
// framework's own (ModelConfig, ModelOptions with OffloadOptions, DataConfig, AdamWConfig and
// LrSchedule, CudaBackendOptions, LinkOptions, CommOptions): each key is bound to the field the
// code reads, and its default is that field's initializer. Every enumerated or spec string
// (device, attention, expert_gemm, device_memory_gib, synthetic_doc_len, bootstrap, resume, ...)
// is parsed into its typed value by parse_train_options, with an error naming the key; no code
// past this file compares option strings. validate_train_options checks the value and
// cross-key rules once, in main, before any work; what it passed is what every later stage
// receives.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/backend/cuda_options.h"
#include "framework/data/loader.h"
#include "framework/model/activation_store.h"
#include "framework/model/config.h"
#include "framework/model/expert_exchange.h"
#include "framework/model/model.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"
#include "parallel/communicator.h"
#include "parallel/link_arbiter.h"
#include "parallel/launch_env.h"

namespace hp {

// device=auto|cpu|cuda (auto: CUDA when a GPU is present).
enum class DeviceKind { kAuto, kCpu, kCuda };

// nonfinite=abort|skip: what a step whose loss or gradient norm is not finite on some rank does
// (every rank agrees before any update). abort: the run stops, exit status 2, nothing of that
// step saved. skip: parameters and moments stay bitwise unchanged, the step counts as done and
// as skipped (log, metrics, checkpoint), and the run goes on with the next batch.
enum class NonfinitePolicy { kAbort, kSkip };

// The run itself: length, seed, where its records go.
struct RunOptions {
  int64_t steps = 100;
  uint64_t seed = 1234;      // init, data order and synthetic data
  int64_t stop_at_step = 0;  // end this run after this step (0: at `steps`); LR still spans steps
  int64_t log_every = 1;
  std::string metrics_path;  // JSON Lines, one object per step (launch/train/metrics.h)
  NonfinitePolicy nonfinite = NonfinitePolicy::kAbort;  // key `nonfinite`: abort | skip
  // nonfinite=skip: more skipped steps than this in a row stop the run (exit status 2).
  int64_t max_skipped_steps = 10;
};

// key device_memory_gib: the device memory a rank may plan with.
struct DeviceMemory {
  enum class Kind {
    kAuto,   // auto: the visible GPU's (no check where none is visible)
    kOff,    // off: no check
    kBytes,  // a number of GiB, or a GPU type (h100, h200, b200)
  };
  Kind kind = Kind::kAuto;
  int64_t bytes = 0;          // kBytes
  std::string text = "auto";  // as given, for messages
};
// Parses device_memory_gib; throws UserError(kConfig) naming the key and what is valid.
DeviceMemory parse_device_memory(const std::string& text);

// Which backend, its precision and the memory it plans with. The CUDA backend's own knobs are
// TrainOptions::cuda.
struct DeviceOptions {
  DeviceKind kind = DeviceKind::kAuto;  // key `device`
  DType cpu_dtype = DType::kF32;        // key `cpu_dtype`: fp32 | fp64 (reference checks)
  DeviceMemory memory;                  // key `device_memory_gib`
};

// optimizer_sharding=none|zero1: where the fp32 masters and AdamW moments live (docs/design.md,
// "Sharded optimizer state").
enum class OptimizerSharding { kNone, kZero1 };

// The optimizer keys: AdamW's (beta1, beta2, adam_eps, weight_decay), the schedule's (lr,
// min_lr, warmup_steps; total_steps is the run's `steps`) and the update's.
struct OptimizerOptions : AdamWConfig, LrSchedule {
  double grad_clip = 1.0;
  OptimizerSharding sharding = OptimizerSharding::kNone;  // key optimizer_sharding
  DType grad_reduce_dtype = DType::kF32;                  // key grad_reduce_dtype: fp32 | bf16
};

struct ParallelOptions {
  int ep_size = 1;                     // expert-parallel group size; world = dp x ep
  std::optional<Bootstrap> bootstrap;  // mpi | file:PATH | tcp:HOST:PORT (none: from the launch)
  // A collective stuck this long becomes an error (CommOptions' bound, in seconds).
  double collective_timeout_s = std::chrono::duration<double>(CommOptions{}.timeout).count();
  // CUDA, 2+ ranks: gradient reductions and zero1's all-gathers on the comm stream over NCCL
  // communicators of their own, overlapping backward and the next forward; false: on the
  // compute stream, in its order (the baseline that overlap is measured against).
  bool comm_overlap = true;
};

// resume=none|auto|PATH.
struct ResumeSpec {
  enum class Kind { kNone, kAuto, kPath };
  Kind kind = Kind::kNone;
  std::string path;  // kPath
};

// docs/checkpoints.md
struct CheckpointOptions {
  std::string dir;        // key `checkpoint_dir`; "": no checkpoints
  int64_t every = 0;      // checkpoint_every: steps between saves (0: at the end, on preemption)
  int64_t keep_last = 0;  // committed checkpoints kept (0: all)
  // checkpoint_async: a save snapshots the state into host memory at the step boundary and a
  // background writer writes the file while training goes on (launch/train/async_checkpoint.h;
  // where it cannot, saves stay synchronous and the run says why before step 1).
  bool async = true;
  ResumeSpec resume;
  // init_from: a checkpoint file or directory (its newest), or a Hugging Face checkpoint
  // directory (config.json + safetensors), whose parameters start a fresh run: new optimizer
  // state, step 0, this run's schedule. A checkpoint found by `resume` wins over it.
  std::string init_from;
  // Start (fresh or from an older checkpoint) in a checkpoint_dir that holds newer committed
  // checkpoints, which the run then overwrites as it reaches their steps. Off: an error.
  bool allow_overwrite = false;
  // Keys of the model config whose saved value may differ from this run's on resume and eval
  // (key `allow_config_change`, a comma list); any other difference is an error.
  std::vector<std::string> allow_config_change;
};

struct EvalOptions {
  std::string checkpoint;   // --checkpoint: a file or a checkpoint directory
  int64_t batches = 10;     // --batches: global batches from the start of the data
  std::string dump_logits;  // --dump_logits: write every position's logits here (safetensors)
  bool force = false;       // --force: --dump_logits may replace an existing file
  std::string json;         // --eval_json: also write the result as one JSON object here
};

// The held-out loss during training (launch/train/evaluation.h).
struct HeldOutOptions {
  std::string data;     // key eval_data: a data spec like `data` ("": no evaluation)
  int64_t every = 0;    // key eval_every: steps between evaluations (0: after the last step only)
  int64_t batches = 8;  // key eval_batches: global batches of eval_data per evaluation
};

struct BenchOptions {
  int64_t warmup = 2;  // bench_warmup
  int64_t steps = 5;   // bench_steps
  std::string json;    // bench_json
};

struct TrainOptions {
  std::string config_path;
  std::string config_text;   // the INI file as read, for records
  std::string command_line;  // the options after the subcommand, for records (overrides)
  bool dry_run = false;
  int plan_world = 0;     // --plan_world: --dry-run plans this many ranks (0: one)
  std::string plan_json;  // --plan_json: --dry-run also writes the plan's bytes here
  RunOptions run;
  ModelConfig model;
  DeviceOptions device;
  CudaBackendOptions cuda;  // attention, deterministic, expert_gemm, *_autotune
  // checkpoint_activations, metadata, routing, ce_chunk_tokens and the activation offload
  // (compute.offload: offload, offload_buffers, offload_lookahead, sim_link_gbps,
  // pinned_pool_mib); max_positions is seq_len, and offload != none turns checkpointing on.
  ModelOptions compute;
  // data, seq_len, batch_tokens, eot_token (-1: vocab_size - 1), shuffle, packing, synthetic_*;
  // the loader's vocab_size, rank, world, seed and rows_per_batch are filled by
  // make_data_config.
  DataConfig data;
  OptimizerOptions optimizer;
  // link_arbiter, link_chunk_mib, link_inflight, pcie_groups; its timeout (collective_timeout_s)
  // and link_id are filled by make_link_options.
  LinkOptions link;
  ParallelOptions parallel;
  CheckpointOptions checkpoint;
  EvalOptions eval;
  HeldOutOptions held_out;
  BenchOptions bench;
};

// Parses `args` (everything after the subcommand). Returns false when --help was printed.
// Throws UserError(kConfig) with the key and rule on any mistake.
bool parse_train_options(const std::vector<std::string>& args, const std::string& subcommand,
                         TrainOptions& out);

// The options a checkpoint records: its `config` text and `command_line` (overrides win; a
// --config in it is skipped, the text standing for that file).
void parse_recorded_options(const std::string& config_text, const std::string& command_line,
                            TrainOptions& out);

// Checks the value and cross-key rules (ranges, divisibility, the data source and the
// framework's own checks of its structs) for a given world size. Runs once, in main, before any
// work: --dry-run for its planned world, a run for the launch's world (known from the launcher's
// environment before the ranks meet). Rules that need facts known only later (a node's size for
// pcie_groups, a GPU present for device=cuda, the contents of data files) are checked where
// those facts arrive.
void validate_train_options(const TrainOptions& o, int world_size);

// The data loader's config of rank `rank` of `world`: o.data with the values the launch fills in
// (vocab_size, eot_token's -1 resolved, rows_per_batch, seed, rank, world).
DataConfig make_data_config(const TrainOptions& o, int rank, int world);
// The model's options: o.compute with max_positions = seq_len, checkpointing on where offload is
// not none, and under precision=fp8 the FP8 recipe of `be` (Backend::fp8_recipe) where it has FP8
// GEMMs; without a backend the recipe stays kBlock128.
ModelOptions make_model_options(const TrainOptions& o, const Backend* be = nullptr);

// The model config as `key=value` lines, every key that changes what the model computes (its
// shapes and its meaning), values printed exactly; saved in checkpoints and compared on load.
std::string model_config_record(const ModelConfig& m);
// The keys whose values differ between two such records ("" for a key missing from one).
std::vector<std::string> model_config_differences(const std::string& saved,
                                                  const std::string& current);
// The value of `key` in a record ("" when absent).
std::string model_config_value(const std::string& record, const std::string& key);

// o.link with collective_timeout_s as its timeout and, with a backend, this rank's host link
// (its device's PCIe root port, for pcie_groups=auto).
LinkOptions make_link_options(const TrainOptions& o, const Backend* be = nullptr);

}  // namespace hp
