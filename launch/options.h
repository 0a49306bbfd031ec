// Typed run configuration: one struct per concern, filled from an INI file plus command-line
// overrides (Boost.Program_options; the same `key = value` names in both) and checked by
// validate_train_options with messages that name the key. Most enumerated keys are parsed into
// enums when they are read. A few stay strings that code past this file reads and compares:
// attention and expert_gemm (checked here, turned into the CUDA backend's enums in
// framework/backend/cuda/cuda_backend.cpp), device_memory_gib (parsed and checked by
// planned_device_bytes, launch/train/memory_plan.cpp), and the specs that their users parse:
// data, synthetic_doc_len (framework/data), pcie_groups (parallel/link_arbiter.cpp) and
// bootstrap (parallel/launch_env.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/data/loader.h"
#include "framework/model/activation_store.h"
#include "framework/model/config.h"
#include "framework/model/expert_exchange.h"
#include "framework/model/model.h"
#include "parallel/link_arbiter.h"

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

// Which backend, and its precision knobs.
struct DeviceOptions {
  DeviceKind kind = DeviceKind::kAuto;  // key `device`
  DType cpu_dtype = DType::kF32;        // key `cpu_dtype`: fp32 | fp64 (reference checks)
  std::string attention = "auto";       // CUDA: auto | cudnn | tiled (cuda_backend.h)
  bool deterministic = false;           // CUDA: bitwise-reproducible attention backward
  std::string expert_gemm = "streams";  // CUDA: serial | streams | grouped (cuda_backend.h)
  bool gemm_autotune = true;       // CUDA: time cuBLASLt's candidates per GEMM bucket (lt_gemm.h)
  bool attention_autotune = true;  // CUDA: time cuDNN's forward plans (cudnn_attention.h)
  // key device_memory_gib: the device memory a rank may plan with: auto (the visible GPU's),
  // off (no check), a number of GiB, or a GPU type (h100, h200, b200).
  std::string memory = "auto";
};

// How the model computes (its shape is ModelConfig).
struct ComputeOptions {
  bool checkpoint_activations = false;            // implied by offload != none
  MetadataMode metadata = MetadataMode::kCached;  // cached | per-layer (baseline)
  RoutingMode routing = RoutingMode::kBincount;   // bincount | per-expert (baseline)
  int64_t ce_chunk_tokens = 4096;
};

struct DataOptions {
  std::string source = "synthetic";  // "synthetic", .bin shard(s) (path, list or glob), or .h5
  int64_t batch_tokens = 8192;       // global tokens per step
  int64_t seq_len = 256;             // row length T
  int32_t eot_token = -1;            // -1: vocab_size - 1
  bool shuffle = true;
  Packing packing = Packing::kStream;  // key `packing`: stream | whole (framework/data/loader.h)
  int64_t packing_window = 128;        // whole: documents of the look-ahead window
  int64_t synthetic_vocab = 0;  // 0: every id below eot_token
  double synthetic_zipf = 1.0;
  double synthetic_mean_doc_len = 64;
  std::string synthetic_doc_len = "geometric";  // or "uniform:MIN:MAX" (EOT included)

  int64_t rows_per_batch() const { return batch_tokens / seq_len; }
};

// optimizer_sharding=none|zero1: where the fp32 masters and AdamW moments live (docs/design.md,
// "Sharded optimizer state").
enum class OptimizerSharding { kNone, kZero1 };

struct OptimizerOptions {
  double lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup_steps = 10;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double adam_eps = 1e-8;
  double grad_clip = 1.0;
  OptimizerSharding sharding = OptimizerSharding::kNone;  // key optimizer_sharding
  DType grad_reduce_dtype = DType::kF32;                  // key grad_reduce_dtype: fp32 | bf16
};

// Activation offload (framework/model/activation_store.h) and the link arbiter of its copies
// (parallel/link_arbiter.h).
struct OffloadSettings {
  OffloadMode mode = OffloadMode::kNone;  // key `offload`: none | single | double
  int buffers = 2;                        // offload_buffers: device staging buffers (>= 2)
  int lookahead = 1;                      // offload_lookahead: 1 .. buffers - 1
  double sim_link_gbps = 0;     // cpu: simulated host link for offload copies, GB/s (0: off)
  int64_t pinned_pool_mib = 0;  // host pool for offloaded inputs (0: sized from model and batch)
  bool link_arbiter = false;    // key `link_arbiter`: on | off (off: the baseline)
  int64_t link_chunk_mib = 8;   // copies move in granted chunks of this size
  int link_inflight = 1;        // chunks in flight per host link
  // "auto": ranks grouped by their GPUs' PCIe root ports; "0,1;2,3": node ranks sharing a
  // link; "": the whole node on one link.
  std::string pcie_groups = "auto";
};

struct ParallelOptions {
  int ep_size = 1;                    // expert-parallel group size; world = dp x ep
  std::string bootstrap;              // mpi | file:PATH | tcp:HOST:PORT ("": from the launch)
  double collective_timeout_s = 300;  // a collective stuck this long becomes an error
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
  ComputeOptions compute;
  DeviceOptions device;
  DataOptions data;
  OptimizerOptions optimizer;
  OffloadSettings offload;
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

// Checks the value and cross-key rules (ranges, divisibility) for a given world size.
void validate_train_options(const TrainOptions& o, int world_size);

// The model config as `key=value` lines, every key that changes what the model computes (its
// shapes and its meaning), values printed exactly; saved in checkpoints and compared on load.
std::string model_config_record(const ModelConfig& m);
// The keys whose values differ between two such records ("" for a key missing from one).
std::vector<std::string> model_config_differences(const std::string& saved,
                                                  const std::string& current);
// The value of `key` in a record ("" when absent).
std::string model_config_value(const std::string& record, const std::string& key);

// The link arbiter's options from link_arbiter, link_chunk_mib, link_inflight, pcie_groups; with
// a backend, also this rank's host link (its device's PCIe root port, for pcie_groups=auto).
LinkOptions make_link_options(const TrainOptions& o, const Backend* be = nullptr);

}  // namespace hp
