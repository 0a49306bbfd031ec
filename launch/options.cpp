#include "launch/options.h"

#include <algorithm>
#include <boost/program_options.hpp>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>

#include "framework/core/error.h"
#include "launch/option_errors.h"

namespace po = boost::program_options;

namespace hp {
namespace {

template <typename E>
using Names = std::vector<std::pair<const char*, E>>;

// The spellings of each enumerated key's values.
const Names<DeviceKind> kDeviceNames = {
    {"auto", DeviceKind::kAuto}, {"cpu", DeviceKind::kCpu}, {"cuda", DeviceKind::kCuda}};
const Names<DType> kCpuDtypeNames = {{"fp32", DType::kF32}, {"fp64", DType::kF64}};
const Names<DType> kReduceDtypeNames = {{"fp32", DType::kF32}, {"bf16", DType::kBF16}};
const Names<MetadataMode> kMetadataNames = {{"cached", MetadataMode::kCached},
                                            {"per-layer", MetadataMode::kPerLayer}};
const Names<RoutingMode> kRoutingNames = {{"bincount", RoutingMode::kBincount},
                                          {"per-expert", RoutingMode::kPerExpert}};
const Names<OffloadMode> kOffloadNames = {
    {"none", OffloadMode::kNone}, {"single", OffloadMode::kSingle}, {"double", OffloadMode::kDouble}};
const Names<bool> kOnOffNames = {{"on", true}, {"off", false}};
const Names<OptimizerSharding> kShardingNames = {{"none", OptimizerSharding::kNone},
                                                 {"zero1", OptimizerSharding::kZero1}};
const Names<Activation> kActivationNames = {{"swiglu", Activation::kSwiGLU},
                                            {"gptoss", Activation::kGptOss}};
const Names<WindowLayers> kWindowNames = {
    {"none", WindowLayers::kNone}, {"even", WindowLayers::kEven}, {"all", WindowLayers::kAll}};
const Names<NonfinitePolicy> kNonfiniteNames = {{"abort", NonfinitePolicy::kAbort},
                                                {"skip", NonfinitePolicy::kSkip}};
const Names<Packing> kPackingNames = {{"stream", Packing::kStream}, {"whole", Packing::kWhole}};
const Names<GemmPrecision> kPrecisionNames = {{"bf16", GemmPrecision::kBF16},
                                              {"fp8", GemmPrecision::kFP8}};

// fp8_gemms: a comma list of the classes dense, experts, unembedding and unembedding_wgrad, at
// least one.
Fp8GemmClasses parse_fp8_gemms(const std::string& text) {
  const char* rule =
      "config key 'fp8_gemms': must be a comma list of dense, experts, unembedding and "
      "unembedding_wgrad";
  Fp8GemmClasses c;
  c.dense = c.experts = c.unembedding = c.unembedding_wgrad = false;
  std::stringstream list(text);
  std::string item;
  bool any = false;
  while (std::getline(list, item, ',')) {
    if (item == "dense") {
      c.dense = true;
    } else if (item == "experts") {
      c.experts = true;
    } else if (item == "unembedding") {
      c.unembedding = true;
    } else if (item == "unembedding_wgrad") {
      c.unembedding_wgrad = true;
    } else {
      HP_USER_ERROR(ErrorKind::kConfig, rule, ", got '", text, "' ('", item, "' is none of them)");
    }
    any = true;
  }
  if (!any) HP_USER_ERROR(ErrorKind::kConfig, rule, ", got '", text, "'");
  return c;
}

// The spelling of `value` (a struct's default, for --help).
template <typename E>
std::string name_of(const Names<E>& names, E value) {
  for (const auto& n : names)
    if (n.second == value) return n.first;
  return "";
}

// Enumerated and spec keys as read; parsed into TrainOptions' typed values once, after the whole
// configuration has been read. The initial values, which --help shows, are the spellings of the
// option structs' defaults.
struct RawEnums {
  std::string device = name_of(kDeviceNames, DeviceOptions{}.kind);
  std::string cpu_dtype = name_of(kCpuDtypeNames, DeviceOptions{}.cpu_dtype);
  std::string metadata = name_of(kMetadataNames, ModelOptions{}.metadata);
  std::string routing = name_of(kRoutingNames, ModelOptions{}.routing);
  std::string offload = name_of(kOffloadNames, OffloadOptions{}.mode);
  std::string link_arbiter = name_of(kOnOffNames, LinkOptions{}.enabled);
  std::string resume = "none";
  std::string window_layers = name_of(kWindowNames, ModelConfig{}.window_layers);
  std::string activation = name_of(kActivationNames, ModelConfig{}.activation);
  std::string optimizer_sharding = name_of(kShardingNames, OptimizerOptions{}.sharding);
  std::string grad_reduce_dtype = name_of(kReduceDtypeNames, OptimizerOptions{}.grad_reduce_dtype);
  std::string seed = std::to_string(RunOptions{}.seed);  // digits only: "-1" must not wrap
  std::string nonfinite = name_of(kNonfiniteNames, RunOptions{}.nonfinite);
  std::string packing = name_of(kPackingNames, DataConfig{}.packing);
  std::string precision = name_of(kPrecisionNames, ModelOptions{}.precision);
  std::string fp8_gemms = "dense,experts";
  std::string allow_config_change;  // comma list of model keys
  std::string attention = attention_impl_name(CudaBackendOptions{}.attention);
  std::string expert_gemm = expert_gemm_impl_name(CudaBackendOptions{}.expert_gemm);
  std::string device_memory_gib = DeviceMemory{}.text;
  std::string synthetic_doc_len = DocLength{}.str();
  std::string bootstrap;  // "": from the launch
  int64_t pinned_pool_mib = OffloadOptions{}.pinned_pool_bytes >> 20;
};

// The value of `key` named `text` among `names`; a config error listing them otherwise.
template <typename E>
E parse_enum(const char* key, const std::string& text, const Names<E>& names) {
  std::string list;
  for (size_t i = 0; i < names.size(); ++i) {
    if (text == names[i].first) return names[i].second;
    list += str_cat(i == 0 ? "" : i + 1 == names.size() ? " or " : ", ", names[i].first);
  }
  HP_USER_ERROR(ErrorKind::kConfig, "config key '", key, "': must be ", list, ", got '", text, "'");
}

// A dtype key's value: dtypes are spelled fp32, fp64 and bf16 in every key and flag. The
// spellings f32 and f64 are refused naming the one that replaced them.
DType parse_dtype(const char* key, const std::string& text, const Names<DType>& names) {
  const char* now = text == "f32" ? "fp32" : text == "f64" ? "fp64" : nullptr;
  if (now && std::any_of(names.begin(), names.end(),
                         [&](const auto& n) { return std::string(n.first) == now; }))
    HP_USER_ERROR(ErrorKind::kConfig, "config key '", key, "': '", text, "' is spelled '", now,
                  "' (dtypes are fp32, fp64 and bf16)");
  return parse_enum<DType>(key, text, names);
}

void parse_enums(const RawEnums& raw, TrainOptions& o) {
  o.device.kind = parse_enum<DeviceKind>("device", raw.device, kDeviceNames);
  o.device.cpu_dtype =
      parse_dtype("cpu_dtype", raw.cpu_dtype, kCpuDtypeNames);
  o.device.memory = parse_device_memory(raw.device_memory_gib);
  o.cuda.attention = parse_attention_impl(raw.attention);
  o.cuda.expert_gemm = parse_expert_gemm_impl(raw.expert_gemm);
  o.data.synthetic_doc_len = parse_doc_length(raw.synthetic_doc_len);
  o.parallel.bootstrap.reset();
  if (!raw.bootstrap.empty()) o.parallel.bootstrap = parse_bootstrap(raw.bootstrap);
  // In bytes it must stay an int64.
  if (raw.pinned_pool_mib < 0 || raw.pinned_pool_mib > (int64_t{1} << 40))
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'pinned_pool_mib': must be in [0, 2^40] MiB ",
                  "(0: sized from the model and batch), got ", raw.pinned_pool_mib);
  o.compute.offload.pinned_pool_bytes = raw.pinned_pool_mib << 20;
  o.compute.metadata = parse_enum<MetadataMode>("metadata", raw.metadata, kMetadataNames);
  o.compute.routing = parse_enum<RoutingMode>("routing", raw.routing, kRoutingNames);
  o.compute.precision = parse_enum<GemmPrecision>("precision", raw.precision, kPrecisionNames);
  o.compute.fp8_gemms = parse_fp8_gemms(raw.fp8_gemms);
  o.compute.offload.mode = parse_enum<OffloadMode>("offload", raw.offload, kOffloadNames);
  o.link.enabled =
      parse_enum<bool>("link_arbiter", raw.link_arbiter, kOnOffNames);
  o.optimizer.sharding = parse_enum<OptimizerSharding>("optimizer_sharding", raw.optimizer_sharding,
                                                      kShardingNames);
  o.optimizer.grad_reduce_dtype = parse_dtype("grad_reduce_dtype", raw.grad_reduce_dtype, kReduceDtypeNames);
  o.model.activation =
      parse_enum<Activation>("activation", raw.activation, kActivationNames);
  o.model.window_layers = parse_enum<WindowLayers>("window_layers", raw.window_layers, kWindowNames);
  o.run.nonfinite = parse_enum<NonfinitePolicy>("nonfinite", raw.nonfinite, kNonfiniteNames);
  o.data.packing = parse_enum<Packing>("packing", raw.packing, kPackingNames);
  {
    const std::string& t = raw.seed;
    bool digits = !t.empty() && t.size() <= 20;
    for (char c : t) digits = digits && c >= '0' && c <= '9';
    errno = 0;
    const unsigned long long v = digits ? std::strtoull(t.c_str(), nullptr, 10) : 0;
    if (!digits || errno == ERANGE)
      HP_USER_ERROR(ErrorKind::kConfig,
                    "config key 'seed': must be an integer in [0, 18446744073709551615], got '", t,
                    "'");
    o.run.seed = v;
  }
  {
    o.checkpoint.allow_config_change.clear();
    std::stringstream list(raw.allow_config_change);
    std::string key;
    const std::string known = model_config_record(o.model);
    while (std::getline(list, key, ',')) {
      if (key.empty()) continue;
      if (known.find("\n" + key + "=") == std::string::npos && known.rfind(key + "=", 0) != 0)
        HP_USER_ERROR(ErrorKind::kConfig, "config key 'allow_config_change': '", key,
                      "' is not a model key (one of: vocab_size, d_model, activation, "
                      "window_layers, rope_theta, ... as in hotpath train --help, Model)");
      o.checkpoint.allow_config_change.push_back(key);
    }
  }
  if (raw.resume.empty())
    HP_USER_ERROR(ErrorKind::kConfig,
                  "config key 'resume': must be none, auto or the path of a checkpoint");
  ResumeSpec& r = o.checkpoint.resume;
  r = ResumeSpec{};
  if (raw.resume == "auto") {
    r.kind = ResumeSpec::Kind::kAuto;
  } else if (raw.resume != "none") {
    r.kind = ResumeSpec::Kind::kPath;
    r.path = raw.resume;
  }
}

po::options_description describe_options(TrainOptions& o, RawEnums& raw) {
  ModelConfig& m = o.model;
  DataConfig& d = o.data;
  OffloadOptions& off = o.compute.offload;
  po::options_description run("Run");
  run.add_options()("steps", po::value(&o.run.steps)->default_value(o.run.steps),
                    "optimizer steps")(
      "nonfinite", po::value(&raw.nonfinite)->default_value(raw.nonfinite),
      "a step whose loss or gradient norm is not finite: abort (stop, exit 2, nothing of it "
      "saved) | skip (parameters and moments unchanged, counted as skipped, go on)")(
      "max_skipped_steps",
      po::value(&o.run.max_skipped_steps)->default_value(o.run.max_skipped_steps),
      "nonfinite=skip: more than this many skipped steps in a row stop the run (exit 2)")(
      "seed", po::value(&raw.seed)->default_value(raw.seed),
      "seed of init, data order and synthetic data")(
      "device", po::value(&raw.device)->default_value(raw.device),
      "cpu | cuda | auto (cuda when a GPU is present)")(
      "attention", po::value(&raw.attention)->default_value(raw.attention),
      "CUDA attention kernels: auto (cuDNN where available, else tiled) | cudnn | tiled")(
      "deterministic", po::value(&o.cuda.deterministic)->default_value(o.cuda.deterministic),
      "CUDA: bitwise-reproducible results (a deterministic attention backward; false allows "
      "cuDNN's faster one, whose dQ sums arrive in varying order)")(
      "expert_gemm", po::value(&raw.expert_gemm)->default_value(raw.expert_gemm),
      "CUDA: how the experts' GEMMs of a MoE layer run: serial (one after another) | streams "
      "(spread over 4 streams, the same bits as serial) | grouped (one cuBLAS grouped call per "
      "group; its own kernels, so other last bits)")(
      "gemm_autotune", po::value(&o.cuda.gemm_autotune)->default_value(o.cuda.gemm_autotune),
      "CUDA: time cuBLASLt's candidate algorithms for each large GEMM shape in the first steps, "
      "without waiting for them, and keep the fastest (off under deterministic=true: timings "
      "pick the algorithm, and so the last bits)")(
      "attention_autotune",
      po::value(&o.cuda.attention_autotune)->default_value(o.cuda.attention_autotune),
      "CUDA: time every plan cuDNN's heuristic offers for each attention forward shape at its "
      "first run, without waiting for them, and keep the fastest (off under deterministic=true)")(
      "cpu_dtype", po::value(&raw.cpu_dtype)->default_value(raw.cpu_dtype),
      "CPU backend precision: fp32 | fp64")(
      "batch_tokens", po::value(&o.data.batch_tokens)->default_value(o.data.batch_tokens),
      "global tokens per step (a multiple of seq_len)")(
      "seq_len", po::value(&o.data.seq_len)->default_value(o.data.seq_len),
      "row length T in tokens")("lr", po::value(&o.optimizer.lr)->default_value(o.optimizer.lr),
                                "peak learning rate")(
      "min_lr", po::value(&o.optimizer.min_lr)->default_value(o.optimizer.min_lr),
      "learning rate at the end of the cosine decay")(
      "warmup_steps", po::value(&o.optimizer.warmup_steps)->default_value(o.optimizer.warmup_steps),
      "linear warmup steps")(
      "weight_decay", po::value(&o.optimizer.weight_decay)->default_value(o.optimizer.weight_decay),
      "AdamW decoupled weight decay (matrices only)")(
      "beta1", po::value(&o.optimizer.beta1)->default_value(o.optimizer.beta1), "AdamW beta1")(
      "beta2", po::value(&o.optimizer.beta2)->default_value(o.optimizer.beta2), "AdamW beta2")(
      "adam_eps", po::value(&o.optimizer.eps)->default_value(o.optimizer.eps), "AdamW epsilon")(
      "grad_clip", po::value(&o.optimizer.grad_clip)->default_value(o.optimizer.grad_clip),
      "global gradient-norm clip (<= 0: off)")(
      "optimizer_sharding",
      po::value(&raw.optimizer_sharding)->default_value(raw.optimizer_sharding),
      "fp32 masters and AdamW moments: none (every rank holds its parameters') | zero1 (sharded: "
      "dense over the world, experts over their dp group)")(
      "grad_reduce_dtype", po::value(&raw.grad_reduce_dtype)->default_value(raw.grad_reduce_dtype),
      "gradient reductions on the wire: fp32 | bf16 (sums still accumulate in fp32)")(
      "metrics_path", po::value(&o.run.metrics_path)->default_value(o.run.metrics_path),
      "JSONL metrics file, one object per step (empty: none)")(
      "log_every", po::value(&o.run.log_every)->default_value(o.run.log_every),
      "log a step line every N steps")(
      "checkpoint_activations",
      po::value(&o.compute.checkpoint_activations)->default_value(o.compute.checkpoint_activations),
      "keep only block inputs in forward; recompute in backward")(
      "metadata", po::value(&raw.metadata)->default_value(raw.metadata),
      "packed metadata: cached (built once per batch) | per-layer (baseline)")(
      "routing", po::value(&raw.routing)->default_value(raw.routing),
      "MoE routing: bincount (1 sync per layer) | per-expert (baseline)")(
      "precision", po::value(&raw.precision)->default_value(raw.precision),
      "GEMM precision: bf16 (the activation dtype) | fp8 (E4M3 with block scales for the forward "
      "and input-gradient products of the classes fp8_gemms names, weight gradients in bf16 but "
      "the unembedding's under unembedding_wgrad; the CPU backend's emulation, or CUDA on compute "
      "capability 9.x/10.x)")(
      "fp8_gemms", po::value(&raw.fp8_gemms)->default_value(raw.fp8_gemms),
      "precision=fp8: which products run in FP8, a comma list of dense (attention projections, "
      "dense FFN), experts (MoE expert FFNs), unembedding (logits and their input gradient) and "
      "unembedding_wgrad (the unembedding's weight gradient); the last two off by default; router "
      "and attention stay bf16")(
      "ep_size", po::value(&o.parallel.ep_size)->default_value(o.parallel.ep_size),
      "expert-parallel ranks (world = dp x ep_size)")(
      "bootstrap", po::value(&raw.bootstrap)->default_value(raw.bootstrap),
      "how ranks meet: mpi | file:PATH | tcp:HOST:PORT (empty: mpi under an MPI launcher)")(
      "comm_overlap", po::value(&o.parallel.comm_overlap)->default_value(o.parallel.comm_overlap),
      "CUDA, 2+ ranks: gradient reductions and zero1 all-gathers on their own stream and NCCL "
      "communicators, overlapping compute (false: on the compute stream, in its order)")(
      "collective_timeout_s",
      po::value(&o.parallel.collective_timeout_s)->default_value(o.parallel.collective_timeout_s),
      "seconds before a stuck collective fails the job")(
      "ce_chunk_tokens",
      po::value(&o.compute.ce_chunk_tokens)->default_value(o.compute.ce_chunk_tokens),
      "rows of logits materialized at once")(
      "offload", po::value(&raw.offload)->default_value(raw.offload),
      "checkpointed block inputs: none (stay on the device) | single (host, serialized reload; "
      "baseline) | double (host, ring of staging buffers with prefetch); not none implies "
      "checkpoint_activations")("offload_buffers",
                                po::value(&off.buffers)->default_value(off.buffers),
                                "offload=double: device staging buffers in the ring (>= 2)")(
      "offload_lookahead", po::value(&off.lookahead)->default_value(off.lookahead),
      "offload=double: blocks reloaded ahead of the one in backward (1 .. offload_buffers-1)")(
      "sim_link_gbps", po::value(&off.sim_link_gbps)->default_value(off.sim_link_gbps),
      "cpu backend: simulated host-link bandwidth of offload copies in GB/s (0: unlimited)")(
      "pinned_pool_mib", po::value(&raw.pinned_pool_mib)->default_value(raw.pinned_pool_mib),
      "pinned host pool for offloaded block inputs in MiB (0: sized from the model and batch)")(
      "link_arbiter", po::value(&raw.link_arbiter)->default_value(raw.link_arbiter),
      "offload copies of the ranks of a node share their host links through a link arbiter: "
      "on | off (off: every rank copies on its own, the baseline)")(
      "link_chunk_mib", po::value(&o.link.chunk_mib)->default_value(o.link.chunk_mib),
      "offload copies move in chunks of this many MiB, each with a grant (1 .. 4096)")(
      "link_inflight", po::value(&o.link.inflight)->default_value(o.link.inflight),
      "link_arbiter=on: chunks in flight per host link (1 .. 64)")(
      "pcie_groups", po::value(&o.link.pcie_groups)->default_value(o.link.pcie_groups),
      "link_arbiter=on: which node ranks share a host link: auto (grouped by their GPUs' PCIe "
      "root ports; all on one link where one cannot be found), a list like \"0,1;2,3\", or "
      "empty (all ranks of a node on one link)")(
      "bench_warmup", po::value(&o.bench.warmup)->default_value(o.bench.warmup),
      "bench: warm-up steps (not timed)")(
      "bench_steps", po::value(&o.bench.steps)->default_value(o.bench.steps), "bench: timed steps")(
      "bench_json", po::value(&o.bench.json)->default_value(o.bench.json),
      "bench: write results as JSON here");
  po::options_description ckpt("Checkpoints and evaluation");
  ckpt.add_options()("checkpoint_dir",
                     po::value(&o.checkpoint.dir)->default_value(o.checkpoint.dir),
                     "directory of step_<N>.h5 checkpoints and `latest` (empty: no checkpoints)")(
      "checkpoint_every", po::value(&o.checkpoint.every)->default_value(o.checkpoint.every),
      "save every N steps (0: only at the end of the run and on preemption)")(
      "keep_last", po::value(&o.checkpoint.keep_last)->default_value(o.checkpoint.keep_last),
      "committed checkpoints to keep (0: all)")(
      "checkpoint_async",
      po::value(&o.checkpoint.async)->default_value(o.checkpoint.async),
      "true: a save copies the state to host memory at the step boundary and a background "
      "thread writes the file while training goes on; false: every save stops training until "
      "the file is committed")(
      "resume", po::value(&raw.resume)->default_value(raw.resume),
      "none | auto (newest committed checkpoint in checkpoint_dir) | PATH of a checkpoint")(
      "allow_overwrite",
      po::value(&o.checkpoint.allow_overwrite)->default_value(o.checkpoint.allow_overwrite),
      "let a run start (fresh, or resumed from an older checkpoint) in a checkpoint_dir that holds "
      "newer committed checkpoints, which it then overwrites (false: an error)")(
      "allow_config_change",
      po::value(&raw.allow_config_change)->default_value(raw.allow_config_change),
      "comma list of model keys whose value may differ from the checkpoint's on resume or eval, "
      "e.g. rope_theta,window_layers (any other difference is an error)")(
      "stop_at_step", po::value(&o.run.stop_at_step)->default_value(o.run.stop_at_step),
      "end this run after this step, saving a checkpoint (0: run to `steps`; the LR schedule still "
      "spans `steps`)")("checkpoint",
                        po::value(&o.eval.checkpoint)->default_value(o.eval.checkpoint),
                        "eval: checkpoint file (or directory: its newest) to evaluate")(
      "batches", po::value(&o.eval.batches)->default_value(o.eval.batches),
      "eval: global batches from the start of the data")(
      "dump_logits", po::value(&o.eval.dump_logits)->default_value(o.eval.dump_logits),
      "eval: write the logits of every position of the evaluated batches to this safetensors "
      "file (\"logits\" F32 [tokens, vocab], \"targets\" and the mean loss in its metadata)")(
      "eval_json", po::value(&o.eval.json)->default_value(o.eval.json),
      "eval: also write the result here as one JSON object (step, eval_loss, eval_tokens, "
      "eval_targets, ...)")(
      "eval_data", po::value(&o.held_out.data)->default_value(o.held_out.data),
      "train: held-out data (a spec like `data`) whose loss is evaluated during the run; empty: "
      "no evaluation")(
      "eval_every", po::value(&o.held_out.every)->default_value(o.held_out.every),
      "train: evaluate eval_data after every N-th step's update (0: after the last step only)")(
      "eval_batches", po::value(&o.held_out.batches)->default_value(o.held_out.batches),
      "train: global batches from the start of eval_data (in file order) per evaluation")(
      "init_from", po::value(&o.checkpoint.init_from)->default_value(o.checkpoint.init_from),
      "start from these weights with fresh optimizer state: a checkpoint (file or directory) "
      "or a Hugging Face directory (config.json + safetensors); resume wins when it finds one");
  po::options_description data("Data");
  data.add_options()(
      "data", po::value(&d.source)->default_value(d.source),
      "synthetic | token shard(s) .bin (path, comma list or glob) | HDF5 tokens .h5")(
      "eot_token", po::value(&d.eot_token)->default_value(d.eot_token),
      "end-of-text token id (-1: vocab_size - 1)")(
      "shuffle", po::value(&d.shuffle)->default_value(d.shuffle),
      "shuffle document order per epoch (file sources)")(
      "packing", po::value(&raw.packing)->default_value(raw.packing),
      "stream: documents in order, cut at row boundaries, no padding | whole: documents that "
      "fit a row stay whole, rows filled by best fit over a look-ahead window (loss-masked "
      "conversations)")(
      "packing_window", po::value(&d.packing_window)->default_value(d.packing_window),
      "whole: documents in the look-ahead window (1..4096)")(
      "synthetic_vocab", po::value(&d.synthetic_vocab)->default_value(d.synthetic_vocab),
      "synthetic: content tokens 0..N-1 (0: every id below eot_token)")(
      "synthetic_zipf", po::value(&d.synthetic_zipf)->default_value(d.synthetic_zipf),
      "synthetic: Zipf exponent of each context's next-token distribution")(
      "synthetic_mean_doc_len",
      po::value(&d.synthetic_mean_doc_len)->default_value(d.synthetic_mean_doc_len),
      "synthetic: mean document length (geometric)")(
      "synthetic_doc_len", po::value(&raw.synthetic_doc_len)->default_value(raw.synthetic_doc_len),
      "synthetic: document lengths, 'geometric' (mean synthetic_mean_doc_len) or "
      "'uniform:MIN:MAX' (EOT included, e.g. uniform:64:4096 as real corpora have)");
  po::options_description model("Model");
  model.add_options()("vocab_size", po::value(&m.vocab_size)->default_value(m.vocab_size),
                      "vocabulary size")("d_model", po::value(&m.d_model)->default_value(m.d_model),
                                         "residual width")(
      "n_layers", po::value(&m.n_layers)->default_value(m.n_layers), "transformer layers")(
      "n_heads", po::value(&m.n_heads)->default_value(m.n_heads), "query heads")(
      "n_kv_heads", po::value(&m.n_kv_heads)->default_value(m.n_kv_heads), "key/value heads (GQA)")(
      "head_dim", po::value(&m.head_dim)->default_value(m.head_dim), "head dimension")(
      "ffn_dim", po::value(&m.ffn_dim)->default_value(m.ffn_dim), "dense FFN hidden size")(
      "n_experts", po::value(&m.n_experts)->default_value(m.n_experts),
      "experts per MoE layer (0: dense)")("top_k", po::value(&m.top_k)->default_value(m.top_k),
                                          "experts per token")(
      "expert_ffn_dim", po::value(&m.expert_ffn_dim)->default_value(m.expert_ffn_dim),
      "expert FFN hidden size")("sliding_window",
                                po::value(&m.sliding_window)->default_value(m.sliding_window),
                                "sliding-window size W")(
      "window_layers", po::value(&raw.window_layers)->default_value(raw.window_layers),
      "layers with the sliding window: none | even | all")(
      "attn_sinks", po::value(&m.attn_sinks)->default_value(m.attn_sinks),
      "learned attention sinks per head")("attn_bias",
                                          po::value(&m.attn_bias)->default_value(m.attn_bias),
                                          "biases on qkv and output projections")(
      "qk_norm", po::value(&m.qk_norm)->default_value(m.qk_norm),
      "per-head RMSNorm of q and k (Qwen3)")(
      "tie_embeddings", po::value(&m.tie_embeddings)->default_value(m.tie_embeddings),
      "share the embedding table with the unembedding")(
      "activation", po::value(&raw.activation)->default_value(raw.activation),
      "swiglu | gptoss (clamped SwiGLU)")("swiglu_alpha",
                                          po::value(&m.swiglu_alpha)->default_value(m.swiglu_alpha),
                                          "gptoss activation alpha")(
      "swiglu_limit", po::value(&m.swiglu_limit)->default_value(m.swiglu_limit),
      "gptoss activation clamp limit")(
      "rope_theta", po::value(&m.rope_theta)->default_value(m.rope_theta), "RoPE base")(
      "rope_scaling_factor",
      po::value(&m.rope_scaling_factor)->default_value(m.rope_scaling_factor),
      "YaRN factor (1: off)")(
      "rope_original_max_positions",
      po::value(&m.rope_original_max_positions)->default_value(m.rope_original_max_positions),
      "YaRN original context")("rope_beta_fast",
                               po::value(&m.rope_beta_fast)->default_value(m.rope_beta_fast),
                               "YaRN beta_fast")(
      "rope_beta_slow", po::value(&m.rope_beta_slow)->default_value(m.rope_beta_slow),
      "YaRN beta_slow")("rope_truncate",
                        po::value(&m.rope_truncate)->default_value(m.rope_truncate),
                        "YaRN: round the ramp ends to whole pairs (Hugging Face default true; "
                        "GPT-OSS false)")(
      "norm_eps", po::value(&m.norm_eps)->default_value(m.norm_eps), "RMSNorm epsilon")(
      "moe_aux_coef", po::value(&m.moe_aux_coef)->default_value(m.moe_aux_coef),
      "load-balancing loss coefficient (0: off)")("init_std",
                                                  po::value(&m.init_std)->default_value(m.init_std),
                                                  "init standard deviation of weights");
  po::options_description memory("Memory plan");
  memory.add_options()(
      "device_memory_gib", po::value(&raw.device_memory_gib)->default_value(raw.device_memory_gib),
      "device memory a rank plans with: auto (the visible GPU's), off, a number of GiB, or "
      "h100 | h200 | b200; a layout whose memory plan does not fit is refused before it "
      "allocates");
  po::options_description all;
  all.add(run).add(ckpt).add(data).add(model).add(memory);
  return all;
}

// The link arbiter's keys under their former names: refused, naming the key to write instead, on
// the command line and in a config file alike.
const char* renamed_key(const std::string& key) {
  static const std::pair<const char*, const char*> kRenamed[] = {
      {"lane_arbiter", "link_arbiter"},
      {"lane_chunk_mib", "link_chunk_mib"},
      {"lane_inflight", "link_inflight"}};
  for (const auto& [before, now] : kRenamed)
    if (key == before) return now;
  return nullptr;
}

// The config file: one `key = value` per line. A line whose first non-blank character is '#'
// or ';' is a comment, and so is a blank line; everything else is taken literally: the value is
// the rest of the line after the first '=', blanks trimmed at both ends ('#' and ';' inside a
// value are part of it, so `checkpoint_dir = runs/exp#2` means that directory). A UTF-8 byte
// order mark at the start is skipped; CR LF line ends are accepted.
po::parsed_options parse_ini(const std::string& text, const std::string& path,
                             const std::string& subcommand, const po::options_description& keys) {
  po::parsed_options parsed(&keys);
  std::set<std::string> seen;
  std::istringstream in(text);
  std::string line;
  int64_t n = 0;
  const auto trim = [](std::string s) {
    const char* blanks = " \t\r\f\v";
    const size_t b = s.find_first_not_of(blanks);
    if (b == std::string::npos) return std::string();
    return s.substr(b, s.find_last_not_of(blanks) - b + 1);
  };
  while (std::getline(in, line)) {
    ++n;
    if (n == 1 && line.compare(0, 3, "\xEF\xBB\xBF") == 0) line.erase(0, 3);
    const std::string t = trim(line);
    if (t.empty() || t[0] == '#' || t[0] == ';') continue;
    const std::string where = str_cat("config file '", path, "' line ", n, ": ");
    const size_t eq = t.find('=');
    if (t[0] == '[')
      HP_USER_ERROR(ErrorKind::kConfig, where, "sections ('", t,
                    "') are not supported; write plain key = value lines");
    if (eq == std::string::npos)
      HP_USER_ERROR(ErrorKind::kConfig, where, "expected key = value, got '", t, "'");
    const std::string key = trim(t.substr(0, eq));
    const std::string value = trim(t.substr(eq + 1));
    if (key.empty()) HP_USER_ERROR(ErrorKind::kConfig, where, "no key before '='");
    if (const char* now = renamed_key(key))
      HP_USER_ERROR(ErrorKind::kConfig, where, "key '", key, "' is renamed to ", now, "; write ",
                    now, " = ", value);
    if (keys.find_nothrow(key, false) == nullptr)
      HP_USER_ERROR(ErrorKind::kConfig, where, "unknown key '", key, "' (valid keys: hotpath ",
                    subcommand, " --help)");
    if (!seen.insert(key).second)
      HP_USER_ERROR(ErrorKind::kConfig, where, "key '", key, "' is given twice");
    po::option opt;
    opt.string_key = key;
    opt.value.push_back(value);
    opt.original_tokens = {key, value};
    parsed.options.push_back(opt);
  }
  return parsed;
}

}  // namespace

bool parse_train_options(const std::vector<std::string>& args, const std::string& subcommand,
                         TrainOptions& o) {
  RawEnums raw;
  po::options_description keys = describe_options(o, raw);
  po::options_description cli("Command line");
  cli.add_options()("help,h", "print this help")("config", po::value(&o.config_path),
                                                 "INI file of key = value lines (# or ; at the "
                                                 "start of a line: a comment; values are literal)")(
      "dry-run", po::bool_switch(&o.dry_run),
      "validate, print parameter counts and the memory plan per rank, exit (2: does not fit)")(
      "plan_world", po::value(&o.plan_world)->default_value(o.plan_world),
      "--dry-run: plan a layout of this many ranks from one process (0: one rank)")(
      "plan_json", po::value(&o.plan_json),
      "--dry-run: also write the memory plan's bytes as JSON to this file")(
      "force", po::bool_switch(&o.eval.force),
      "eval: let --dump_logits replace an existing file (without it, an error)");
  po::options_description all;
  all.add(cli).add(keys);

  for (const std::string& a : args) o.command_line += (o.command_line.empty() ? "" : " ") + a;
  for (const std::string& a : args) {
    if (a.rfind("--", 0) != 0) continue;
    const std::string key = a.substr(2, a.find('=') == std::string::npos ? std::string::npos
                                                                          : a.find('=') - 2);
    if (const char* now = renamed_key(key))
      HP_USER_ERROR(ErrorKind::kConfig, "hotpath ", subcommand, ": --", key, " is renamed to ",
                    now, "; write --", now, "=VALUE");
  }
  po::variables_map vm;
  try {
    const po::parsed_options parsed = po::command_line_parser(args).options(all).run();
    // Words that are not options would otherwise be dropped without a word (a forgotten
    // --config, a value after a space where '=' was meant).
    for (const po::option& opt : parsed.options)
      if (opt.position_key >= 0 && !opt.value.empty())
        HP_USER_ERROR(
            ErrorKind::kConfig, "hotpath ", subcommand, ": unexpected argument '", opt.value[0],
            "'; options are --key=value",
            opt.value[0].size() > 4 && opt.value[0].compare(opt.value[0].size() - 4, 4, ".ini") == 0
                ? str_cat(" (did you mean --config ", opt.value[0], "?)")
                : std::string(),
            " (see hotpath ", subcommand, " --help)");
    po::store(parsed, vm);
  } catch (const po::error& e) {
    HP_USER_ERROR(ErrorKind::kConfig, "hotpath ", subcommand, ": ", option_error_text(e),
                  " (see hotpath ", subcommand, " --help)");
  }
  if (vm.count("help")) {
    std::cout << "usage: hotpath " << subcommand << " --config FILE [--key=value ...]\n\n"
              << "Every key may appear in the config file (key = value) or on the command line\n"
              << "(--key=value, which wins). Defaults in parentheses.\n"
              << all << std::endl;
    return false;
  }
  if (vm.count("config")) {
    const std::string path = vm["config"].as<std::string>();
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec))
      HP_USER_ERROR(ErrorKind::kConfig, "--config '", path,
                    "' is a directory; name an INI file of key = value lines, e.g. "
                    "examples/configs/tiny-moe.ini");
    std::ifstream f(path, std::ios::binary);
    if (!f)
      HP_USER_ERROR(ErrorKind::kConfig, "cannot open config file '", path,
                    "' (given by --config): no such file or not readable");
    std::stringstream text;
    text << f.rdbuf();
    o.config_text = text.str();
    const po::parsed_options parsed = parse_ini(o.config_text, path, subcommand, keys);
    try {
      po::store(parsed, vm);
    } catch (const po::error& e) {
      HP_USER_ERROR(ErrorKind::kConfig, "config file '", path, "': ", option_error_text(e),
                    " (valid keys: hotpath ", subcommand, " --help)");
    }
  }
  try {
    po::notify(vm);
  } catch (const po::error& e) {
    HP_USER_ERROR(ErrorKind::kConfig, "hotpath ", subcommand, ": ", option_error_text(e));
  }
  parse_enums(raw, o);
  return true;
}

void parse_recorded_options(const std::string& config_text, const std::string& command_line,
                            TrainOptions& o) {
  std::vector<std::string> args;
  std::istringstream words(command_line);
  for (std::string w; words >> w;) {
    if (w == "--config") {
      words >> w;  // the file it named; its text is config_text
      continue;
    }
    if (w.rfind("--config=", 0) == 0 || w == "--dry-run") continue;
    args.push_back(w);
  }
  // A checkpoint written before the link arbiter's keys took their names records the former
  // ones: read under the names of today (a user typing them is told the new name instead).
  for (std::string& a : args) {
    if (a.rfind("--", 0) != 0) continue;
    const std::string key = a.substr(2, a.find('=') == std::string::npos ? std::string::npos
                                                                         : a.find('=') - 2);
    if (const char* now = renamed_key(key)) a = "--" + std::string(now) + a.substr(2 + key.size());
  }
  std::string text;
  {
    std::istringstream lines(config_text);
    for (std::string line; std::getline(lines, line);) {
      const size_t b = line.find_first_not_of(" \t");
      const size_t e = b == std::string::npos ? b : line.find_first_of(" \t=", b);
      const char* now = b == std::string::npos ? nullptr : renamed_key(line.substr(b, e - b));
      text += now ? line.substr(0, b) + now + (e == std::string::npos ? "" : line.substr(e)) : line;
      text += '\n';
    }
  }
  RawEnums raw;
  po::options_description keys = describe_options(o, raw);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(args).options(keys).run(), vm);
    std::istringstream in(text);
    po::store(po::parse_config_file(in, keys, false), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    HP_USER_ERROR(ErrorKind::kConfig, "the configuration recorded in the checkpoint: ", e.what());
  }
  parse_enums(raw, o);
  o.config_text = config_text;
  o.command_line = command_line;
}

namespace {
void require(bool ok, const char* key, const std::string& rule) {
  if (!ok) HP_USER_ERROR(ErrorKind::kConfig, "config key '", key, "': ", rule);
}
void require_positive(double v, const char* key) {
  require(std::isfinite(v) && v > 0, key, str_cat("must be finite and > 0, got ", v));
}
constexpr int64_t kMaxSteps = int64_t{1} << 40;
constexpr double kMaxCollectiveTimeoutS = 1e6;  // 11.6 days
}  // namespace

void validate_train_options(const TrainOptions& o, int world) {
  o.model.validate();
  const RunOptions& r = o.run;
  require(r.steps >= 0, "steps", str_cat("must be >= 0, got ", r.steps));
  require(r.log_every >= 1, "log_every", str_cat("must be >= 1, got ", r.log_every));
  require(r.stop_at_step >= 0, "stop_at_step", "must be >= 0");
  require(r.steps <= kMaxSteps, "steps", str_cat("must be <= ", kMaxSteps, ", got ", r.steps));
  const DataConfig& d = o.data;
  require(d.seq_len >= 2, "seq_len", str_cat("must be >= 2, got ", d.seq_len));
  // Token positions and document offsets of a batch are int32 (packed metadata, cu_seqlens).
  require(d.batch_tokens <= INT32_MAX, "batch_tokens",
          str_cat("must be <= 2147483647 (positions in a batch are int32), got ", d.batch_tokens));
  require(d.batch_tokens > 0 && d.batch_tokens % d.seq_len == 0, "batch_tokens",
          str_cat("must be a positive multiple of seq_len=", d.seq_len, ", got ", d.batch_tokens));
  const int64_t rows = d.batch_tokens / d.seq_len;
  require(rows % world == 0, "batch_tokens",
          str_cat("batch_tokens/seq_len = ", rows, " rows must divide evenly over ", world,
                  " ranks"));
  require(d.packing_window >= 1 && d.packing_window <= kMaxPackingWindow, "packing_window",
          str_cat("must be in 1..", kMaxPackingWindow, " documents, got ", d.packing_window));
  require(d.eot_token >= -1, "eot_token",
          str_cat("must be -1 (vocab_size - 1) or a token id >= 0, got ", d.eot_token));
  const int64_t eot = d.eot_token < 0 ? o.model.vocab_size - 1 : d.eot_token;
  require(eot < o.model.vocab_size, "eot_token",
          str_cat("must be < vocab_size=", o.model.vocab_size, ", got ", eot));
  // The synthetic_* keys only describe the synthetic source; file data is checked against
  // vocab_size and eot_token as it is read.
  if (d.source == "synthetic") {
    require(
        d.synthetic_vocab >= 0 && d.synthetic_vocab < o.model.vocab_size, "synthetic_vocab",
        str_cat("must be in [0, vocab_size=", o.model.vocab_size, "), got ", d.synthetic_vocab));
    require(std::isfinite(d.synthetic_zipf) && d.synthetic_zipf >= 0, "synthetic_zipf",
            "must be finite and >= 0");
    require(std::isfinite(d.synthetic_mean_doc_len) && d.synthetic_mean_doc_len > 1,
            "synthetic_mean_doc_len", "must be finite and > 1");
  }
  // What DataLoader::open checks before it reads: the synthetic source's parameters, the data
  // files' paths and patterns.
  validate_data_config(make_data_config(o, 0, world));
  const OptimizerOptions& opt = o.optimizer;
  require_positive(opt.lr, "lr");
  require(opt.min_lr >= 0 && opt.min_lr <= opt.lr, "min_lr",
          str_cat("must be in [0, lr], got ", opt.min_lr));
  require(opt.warmup_steps >= 0, "warmup_steps", "must be >= 0");
  require(std::isfinite(opt.weight_decay) && opt.weight_decay >= 0, "weight_decay",
          str_cat("must be finite and >= 0, got ", opt.weight_decay));
  require(opt.beta1 >= 0 && opt.beta1 < 1, "beta1", "must be in [0, 1)");
  require(opt.beta2 >= 0 && opt.beta2 < 1, "beta2", "must be in [0, 1)");
  require_positive(opt.eps, "adam_eps");
  require(std::isfinite(opt.grad_clip) && opt.grad_clip >= 0, "grad_clip",
          str_cat("must be finite and >= 0 (0: no clipping), got ", opt.grad_clip));
  require(o.compute.ce_chunk_tokens >= 1, "ce_chunk_tokens", "must be >= 1");
  require(o.compute.precision != GemmPrecision::kFP8 || o.model.is_moe() ||
              o.compute.fp8_gemms.dense || o.compute.fp8_gemms.unembedding ||
              o.compute.fp8_gemms.unembedding_wgrad,
          "fp8_gemms",
          "a dense model has no expert GEMMs: with precision=fp8 include dense, unembedding or "
          "unembedding_wgrad");
  const ParallelOptions& par = o.parallel;
  require(par.ep_size >= 1 && world % par.ep_size == 0, "ep_size",
          str_cat("must divide the world size ", world, ", got ", par.ep_size));
  require(!o.model.is_moe() || o.model.n_experts % par.ep_size == 0, "ep_size",
          str_cat("must divide n_experts=", o.model.n_experts, ", got ", par.ep_size));
  require(o.model.is_moe() || par.ep_size == 1, "ep_size", "must be 1 for a dense model");
  // In milliseconds it must stay a positive int64 (and a grant wait of 3x it, too).
  require(std::isfinite(par.collective_timeout_s) && par.collective_timeout_s >= 0.001 &&
              par.collective_timeout_s <= kMaxCollectiveTimeoutS,
          "collective_timeout_s",
          str_cat("must be in [0.001, ", kMaxCollectiveTimeoutS, "] seconds, got ",
                  par.collective_timeout_s));
  if (opt.sharding == OptimizerSharding::kZero1 && o.model.is_moe()) {
    // Each rank's block of experts is split by whole experts over its dp group.
    const int64_t local_experts = o.model.n_experts / par.ep_size;
    const int64_t dp = world / par.ep_size;
    require(local_experts % dp == 0, "optimizer_sharding",
            str_cat("zero1 splits each rank's ", local_experts,
                    " experts (n_experts / ep_size) over its dp group of ", dp,
                    " ranks, which needs a multiple of ", dp,
                    "; use a larger ep_size, fewer ranks, or optimizer_sharding=none"));
  }
  const OffloadOptions& off = o.compute.offload;
  require(std::isfinite(off.sim_link_gbps), "sim_link_gbps",
          str_cat("must be >= 0, got ", off.sim_link_gbps));
  off.validate();
  o.link.validate();
  const CheckpointOptions& ck = o.checkpoint;
  require(o.run.max_skipped_steps >= 0, "max_skipped_steps",
          str_cat("must be >= 0 (0: stop at the first skipped step), got ",
                  o.run.max_skipped_steps));
  require(ck.every >= 0, "checkpoint_every", "must be >= 0");
  require(ck.keep_last >= 0, "keep_last", "must be >= 0");
  require(ck.resume.kind != ResumeSpec::Kind::kPath || !ck.resume.path.empty(), "resume",
          "must be none, auto or the path of a checkpoint");
  require(ck.resume.kind != ResumeSpec::Kind::kAuto || !ck.dir.empty(), "resume",
          "auto needs checkpoint_dir (the directory to resume from)");
  require(o.eval.batches >= 1, "batches", "must be >= 1");
  const HeldOutOptions& ho = o.held_out;
  require(ho.every >= 0, "eval_every",
          str_cat("must be >= 0 (0: evaluate after the last step only), got ", ho.every));
  require(ho.every == 0 || !ho.data.empty(), "eval_every",
          str_cat("=", ho.every, " needs eval_data (the held-out data to evaluate): set "
                  "eval_data, or eval_every=0"));
  require(ho.batches >= 1, "eval_batches", str_cat("must be >= 1, got ", ho.batches));
  if (!ho.data.empty()) {
    // What opening eval_data checks first (HeldOutData, launch/train/evaluation.cpp), as it says.
    DataConfig held_out = make_data_config(o, 0, world);
    held_out.source = ho.data;
    try {
      validate_data_config(held_out);
    } catch (const UserError& e) {
      HP_USER_ERROR(e.kind(), "config key 'eval_data' (", ho.data, "): ", e.what());
    }
  }
  require(o.plan_world >= 0 && o.plan_world <= (1 << 20), "plan_world",
          str_cat("must be in [0, 1048576], got ", o.plan_world));
  require(o.bench.warmup >= 0 && o.bench.steps >= 1, "bench_steps",
          "bench_warmup must be >= 0 and bench_steps >= 1");
}

DataConfig make_data_config(const TrainOptions& o, int rank, int world) {
  DataConfig d = o.data;
  d.vocab_size = o.model.vocab_size;
  if (d.eot_token < 0) d.eot_token = static_cast<int32_t>(o.model.vocab_size - 1);
  d.rows_per_batch = d.seq_len > 0 ? d.batch_tokens / d.seq_len : 0;
  d.rank = rank;
  d.world = world;
  d.seed = o.run.seed;
  return d;
}

ModelOptions make_model_options(const TrainOptions& o, const Backend* be) {
  ModelOptions m = o.compute;
  if (m.offload.mode != OffloadMode::kNone) m.checkpoint_activations = true;
  m.max_positions = o.data.seq_len;
  // The device's recipe; a backend without FP8 GEMMs is left to the model's refusal.
  if (be && m.precision == GemmPrecision::kFP8 && be->has_fp8_gemms())
    m.fp8_recipe = be->fp8_recipe();
  return m;
}

LinkOptions make_link_options(const TrainOptions& o, const Backend* be) {
  LinkOptions l = o.link;
  // A grant that takes longer than a collective may is a stuck peer.
  l.timeout =
      std::chrono::milliseconds(static_cast<int64_t>(o.parallel.collective_timeout_s * 1000));
  if (be) l.link_id = host_link_of_pci_device("/sys/bus/pci/devices", be->pci_bus_id());
  return l;
}

namespace {
struct GpuType {
  const char* name;
  double gib;  // total memory as the driver reports it
};
constexpr GpuType kGpuTypes[] = {{"h100", 79.6}, {"h200", 140.4}, {"b200", 179.0}};
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMinDeviceGiB = 0.001;  // device_memory_gib's smallest size
}  // namespace

DeviceMemory parse_device_memory(const std::string& text) {
  DeviceMemory m;
  m.text = text;
  std::string v = text;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char ch) { return std::tolower(ch); });
  if (v == "auto") return m;
  if (v == "off") {
    m.kind = DeviceMemory::Kind::kOff;
    return m;
  }
  m.kind = DeviceMemory::Kind::kBytes;
  for (const GpuType& g : kGpuTypes)
    if (v == g.name) {
      m.bytes = static_cast<int64_t>(g.gib * kGiB);
      return m;
    }
  // A size below a MiB is no device; read as bytes it would round to 0, which means "no check".
  char* end = nullptr;
  const double gib = std::strtod(v.c_str(), &end);
  if (v.empty() || end != v.c_str() + v.size() || !(gib >= kMinDeviceGiB) || gib > 1e6)
    HP_USER_ERROR(ErrorKind::kConfig,
                  "config key 'device_memory_gib': must be auto, off (no check), a number "
                  "of GiB in [0.001, 1e6] or one of h100, h200, b200; got '",
                  text, "'");
  m.bytes = static_cast<int64_t>(gib * kGiB);
  return m;
}

std::string model_config_record(const ModelConfig& m) {
  std::ostringstream os;
  const auto real = [](double v) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return std::string(buf);
  };
  const char* window = m.window_layers == WindowLayers::kEven  ? "even"
                       : m.window_layers == WindowLayers::kAll ? "all"
                                                               : "none";
  os << "vocab_size=" << m.vocab_size << "\nd_model=" << m.d_model << "\nn_layers=" << m.n_layers
     << "\nn_heads=" << m.n_heads << "\nn_kv_heads=" << m.n_kv_heads << "\nhead_dim=" << m.head_dim
     << "\nffn_dim=" << m.ffn_dim << "\nn_experts=" << m.n_experts << "\ntop_k=" << m.top_k
     << "\nexpert_ffn_dim=" << m.expert_ffn_dim << "\nsliding_window=" << m.sliding_window
     << "\nwindow_layers=" << window << "\nattn_sinks=" << m.attn_sinks
     << "\nattn_bias=" << m.attn_bias << "\nqk_norm=" << m.qk_norm
     << "\ntie_embeddings=" << m.tie_embeddings
     << "\nactivation=" << (m.activation == Activation::kGptOss ? "gptoss" : "swiglu")
     << "\nswiglu_alpha=" << real(m.swiglu_alpha) << "\nswiglu_limit=" << real(m.swiglu_limit)
     << "\nrope_theta=" << real(m.rope_theta)
     << "\nrope_scaling_factor=" << real(m.rope_scaling_factor)
     << "\nrope_original_max_positions=" << real(m.rope_original_max_positions)
     << "\nrope_beta_fast=" << real(m.rope_beta_fast)
     << "\nrope_beta_slow=" << real(m.rope_beta_slow) << "\nnorm_eps=" << real(m.norm_eps)
     << "\nmoe_aux_coef=" << real(m.moe_aux_coef) << "\n";
  return os.str();
}

namespace {
std::vector<std::pair<std::string, std::string>> record_entries(const std::string& record) {
  std::vector<std::pair<std::string, std::string>> out;
  std::istringstream in(record);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) out.emplace_back(line.substr(0, eq), line.substr(eq + 1));
  }
  return out;
}
}  // namespace

std::string model_config_value(const std::string& record, const std::string& key) {
  for (const auto& kv : record_entries(record))
    if (kv.first == key) return kv.second;
  return "";
}

std::vector<std::string> model_config_differences(const std::string& saved,
                                                  const std::string& current) {
  std::vector<std::string> keys;
  const auto a = record_entries(saved), b = record_entries(current);
  for (const auto& kv : b)
    if (model_config_value(saved, kv.first) != kv.second) keys.push_back(kv.first);
  for (const auto& kv : a)
    if (model_config_value(current, kv.first).empty() &&
        std::find(keys.begin(), keys.end(), kv.first) == keys.end())
      keys.push_back(kv.first);
  return keys;
}

}  // namespace hp
