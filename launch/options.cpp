#include "launch/options.h"

#include <boost/program_options.hpp>
#include <fstream>
#include <iostream>
#include <sstream>

#include "framework/core/error.h"

namespace po = boost::program_options;

namespace hp {
namespace {

po::options_description describe_options(TrainOptions& o, std::string& window_layers) {
  ModelConfig& m = o.model;
  DataOptions& d = o.data;
  po::options_description run("Run");
  run.add_options()("steps", po::value(&o.steps)->default_value(o.steps), "optimizer steps")(
      "seed", po::value(&o.seed)->default_value(o.seed),
      "seed of init, data order and synthetic data")(
      "device", po::value(&o.device)->default_value(o.device),
      "cpu | cuda | auto (cuda when a GPU is present)")(
      "cpu_dtype", po::value(&o.cpu_dtype)->default_value(o.cpu_dtype),
      "CPU backend precision: f32 | f64")("batch_tokens",
                                          po::value(&o.batch_tokens)->default_value(o.batch_tokens),
                                          "global tokens per step (a multiple of seq_len)")(
      "seq_len", po::value(&o.seq_len)->default_value(o.seq_len), "row length T in tokens")(
      "lr", po::value(&o.lr)->default_value(o.lr), "peak learning rate")(
      "min_lr", po::value(&o.min_lr)->default_value(o.min_lr),
      "learning rate at the end of the cosine decay")(
      "warmup_steps", po::value(&o.warmup_steps)->default_value(o.warmup_steps),
      "linear warmup steps")("weight_decay",
                             po::value(&o.weight_decay)->default_value(o.weight_decay),
                             "AdamW decoupled weight decay (matrices only)")(
      "beta1", po::value(&o.beta1)->default_value(o.beta1), "AdamW beta1")(
      "beta2", po::value(&o.beta2)->default_value(o.beta2), "AdamW beta2")(
      "adam_eps", po::value(&o.adam_eps)->default_value(o.adam_eps), "AdamW epsilon")(
      "grad_clip", po::value(&o.grad_clip)->default_value(o.grad_clip),
      "global gradient-norm clip (<= 0: off)")(
      "metrics_path", po::value(&o.metrics_path)->default_value(o.metrics_path),
      "JSONL metrics file, one object per step (empty: none)")(
      "log_every", po::value(&o.log_every)->default_value(o.log_every),
      "log a step line every N steps")(
      "checkpoint_activations",
      po::value(&o.checkpoint_activations)->default_value(o.checkpoint_activations),
      "keep only block inputs in forward; recompute in backward")(
      "metadata", po::value(&o.metadata)->default_value(o.metadata),
      "packed metadata: cached (built once per batch) | per-layer (baseline)")(
      "routing", po::value(&o.routing)->default_value(o.routing),
      "MoE routing: bincount (1 sync per layer) | per-expert (baseline)")(
      "ep_size", po::value(&o.ep_size)->default_value(o.ep_size),
      "expert-parallel ranks (world = dp x ep_size)")(
      "bootstrap", po::value(&o.bootstrap)->default_value(o.bootstrap),
      "how ranks meet: mpi | file:PATH | tcp:HOST:PORT (empty: mpi under an MPI launcher)")(
      "collective_timeout_s",
      po::value(&o.collective_timeout_s)->default_value(o.collective_timeout_s),
      "seconds before a stuck collective fails the job")(
      "ce_chunk_tokens", po::value(&o.ce_chunk_tokens)->default_value(o.ce_chunk_tokens),
      "rows of logits materialized at once")(
      "offload", po::value(&o.offload)->default_value(o.offload),
      "checkpointed block inputs: none (stay on the device) | single (host, serialized reload; "
      "baseline) | double (host, ring of staging buffers with prefetch); not none implies "
      "checkpoint_activations")("offload_buffers",
                                po::value(&o.offload_buffers)->default_value(o.offload_buffers),
                                "offload=double: device staging buffers in the ring (>= 2)")(
      "offload_lookahead", po::value(&o.offload_lookahead)->default_value(o.offload_lookahead),
      "offload=double: blocks reloaded ahead of the one in backward (1 .. offload_buffers-1)")(
      "sim_link_gbps", po::value(&o.sim_link_gbps)->default_value(o.sim_link_gbps),
      "cpu backend: simulated host-link bandwidth of offload copies in GB/s (0: unlimited)")(
      "pinned_pool_mib", po::value(&o.pinned_pool_mib)->default_value(o.pinned_pool_mib),
      "pinned host pool for offloaded block inputs in MiB (0: sized from the model and batch)")(
      "lane_arbiter", po::value(&o.lane_arbiter)->default_value(o.lane_arbiter),
      "offload copies of the ranks of a node share their host links through a lane arbiter: "
      "on | off (off: every rank copies on its own, the baseline)")(
      "lane_chunk_mib", po::value(&o.lane_chunk_mib)->default_value(o.lane_chunk_mib),
      "offload copies move in chunks of this many MiB, each with a grant (1 .. 4096)")(
      "lane_inflight", po::value(&o.lane_inflight)->default_value(o.lane_inflight),
      "lane_arbiter=on: chunks in flight per host link (1 .. 64)")(
      "pcie_groups", po::value(&o.pcie_groups)->default_value(o.pcie_groups),
      "lane_arbiter=on: which node ranks share a host link: auto (grouped by their GPUs' PCIe "
      "root ports; all on one link where one cannot be found), a list like \"0,1;2,3\", or "
      "empty (all ranks of a node on one link)")(
      "bench_warmup", po::value(&o.bench_warmup)->default_value(o.bench_warmup),
      "bench: warm-up steps (not timed)")(
      "bench_steps", po::value(&o.bench_steps)->default_value(o.bench_steps), "bench: timed steps")(
      "bench_json", po::value(&o.bench_json)->default_value(o.bench_json),
      "bench: write results as JSON here");
  po::options_description ckpt("Checkpoints and evaluation");
  ckpt.add_options()("checkpoint_dir",
                     po::value(&o.checkpoint_dir)->default_value(o.checkpoint_dir),
                     "directory of step_<N>.h5 checkpoints and `latest` (empty: no checkpoints)")(
      "checkpoint_every", po::value(&o.checkpoint_every)->default_value(o.checkpoint_every),
      "save every N steps (0: only at the end of the run and on preemption)")(
      "keep_last", po::value(&o.keep_last)->default_value(o.keep_last),
      "committed checkpoints to keep (0: all)")(
      "resume", po::value(&o.resume)->default_value(o.resume),
      "none | auto (newest committed checkpoint in checkpoint_dir) | PATH of a checkpoint")(
      "stop_at_step", po::value(&o.stop_at_step)->default_value(o.stop_at_step),
      "end this run after this step, saving a checkpoint (0: run to `steps`; the LR schedule still "
      "spans `steps`)")("checkpoint",
                        po::value(&o.eval_checkpoint)->default_value(o.eval_checkpoint),
                        "eval: checkpoint file (or directory: its newest) to evaluate")(
      "batches", po::value(&o.eval_batches)->default_value(o.eval_batches),
      "eval: global batches from the start of the data");
  po::options_description data("Data");
  data.add_options()(
      "data", po::value(&d.source)->default_value(d.source),
      "synthetic | token shard(s) .bin (path, comma list or glob) | HDF5 tokens .h5")(
      "eot_token", po::value(&d.eot_token)->default_value(d.eot_token),
      "end-of-text token id (-1: vocab_size - 1)")(
      "shuffle", po::value(&d.shuffle)->default_value(d.shuffle),
      "shuffle document order per epoch (file sources)")(
      "synthetic_vocab", po::value(&d.synthetic_vocab)->default_value(d.synthetic_vocab),
      "synthetic: content tokens 0..N-1 (0: every id below eot_token)")(
      "synthetic_zipf", po::value(&d.synthetic_zipf)->default_value(d.synthetic_zipf),
      "synthetic: Zipf exponent of each context's next-token distribution")(
      "synthetic_mean_doc_len",
      po::value(&d.synthetic_mean_doc_len)->default_value(d.synthetic_mean_doc_len),
      "synthetic: mean document length (geometric)");
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
      "expert FFN hidden size")(
      "sliding_window", po::value(&m.sliding_window)->default_value(m.sliding_window),
      "sliding-window size W")("window_layers", po::value(&window_layers)->default_value("none"),
                               "layers with the sliding window: none | even | all")(
      "attn_sinks", po::value(&m.attn_sinks)->default_value(m.attn_sinks),
      "learned attention sinks per head")("attn_bias",
                                          po::value(&m.attn_bias)->default_value(m.attn_bias),
                                          "biases on qkv and output projections")(
      "qk_norm", po::value(&m.qk_norm)->default_value(m.qk_norm),
      "per-head RMSNorm of q and k (Qwen3)")(
      "tie_embeddings", po::value(&m.tie_embeddings)->default_value(m.tie_embeddings),
      "share the embedding table with the unembedding")(
      "activation", po::value(&m.activation)->default_value(m.activation),
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
      "YaRN beta_slow")("norm_eps", po::value(&m.norm_eps)->default_value(m.norm_eps),
                        "RMSNorm epsilon")(
      "moe_aux_coef", po::value(&m.moe_aux_coef)->default_value(m.moe_aux_coef),
      "load-balancing loss coefficient (0: off)")("init_std",
                                                  po::value(&m.init_std)->default_value(m.init_std),
                                                  "init standard deviation of weights");
  po::options_description all;
  all.add(run).add(ckpt).add(data).add(model);
  return all;
}

WindowLayers parse_window_layers(const std::string& s) {
  if (s == "none") return WindowLayers::kNone;
  if (s == "even") return WindowLayers::kEven;
  if (s == "all") return WindowLayers::kAll;
  HP_USER_ERROR(ErrorKind::kConfig, "config key 'window_layers': must be none, even or all, got '",
                s, "'");
}

}  // namespace

bool parse_train_options(const std::vector<std::string>& args, const std::string& subcommand,
                         TrainOptions& o) {
  std::string window_layers;
  po::options_description keys = describe_options(o, window_layers);
  po::options_description cli("Command line");
  cli.add_options()("help,h", "print this help")("config", po::value(&o.config_path),
                                                 "INI file of key = value lines (# comments)")(
      "dry-run", po::bool_switch(&o.dry_run), "validate, print parameter counts, exit");
  po::options_description all;
  all.add(cli).add(keys);

  for (const std::string& a : args) o.command_line += (o.command_line.empty() ? "" : " ") + a;
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(args).options(all).run(), vm);
  } catch (const po::error& e) {
    HP_USER_ERROR(ErrorKind::kConfig, "hotpath ", subcommand, ": ", e.what(), " (see hotpath ",
                  subcommand, " --help)");
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
    std::ifstream f(path);
    if (!f)
      HP_USER_ERROR(ErrorKind::kConfig, "cannot open config file '", path,
                    "' (given by --config): no such file or not readable");
    std::stringstream text;
    text << f.rdbuf();
    o.config_text = text.str();
    std::istringstream in(o.config_text);
    try {
      po::store(po::parse_config_file(in, keys, false), vm);
    } catch (const po::error& e) {
      HP_USER_ERROR(ErrorKind::kConfig, "config file '", path, "': ", e.what(),
                    " (valid keys: hotpath ", subcommand, " --help)");
    }
  }
  try {
    po::notify(vm);
  } catch (const po::error& e) {
    HP_USER_ERROR(ErrorKind::kConfig, "hotpath ", subcommand, ": ", e.what());
  }
  o.model.window_layers = parse_window_layers(window_layers);
  return true;
}

namespace {
void require(bool ok, const char* key, const std::string& rule) {
  if (!ok) HP_USER_ERROR(ErrorKind::kConfig, "config key '", key, "': ", rule);
}
}  // namespace

void validate_train_options(const TrainOptions& o, int world) {
  o.model.validate();
  require(o.steps >= 0, "steps", str_cat("must be >= 0, got ", o.steps));
  require(o.device == "cpu" || o.device == "cuda" || o.device == "auto", "device",
          str_cat("must be cpu, cuda or auto, got '", o.device, "'"));
  require(o.cpu_dtype == "f32" || o.cpu_dtype == "f64", "cpu_dtype",
          str_cat("must be f32 or f64, got '", o.cpu_dtype, "'"));
  require(o.seq_len >= 2, "seq_len", str_cat("must be >= 2, got ", o.seq_len));
  require(o.batch_tokens > 0 && o.batch_tokens % o.seq_len == 0, "batch_tokens",
          str_cat("must be a positive multiple of seq_len=", o.seq_len, ", got ", o.batch_tokens));
  require(o.rows_per_batch() % world == 0, "batch_tokens",
          str_cat("batch_tokens/seq_len = ", o.rows_per_batch(), " rows must divide evenly over ",
                  world, " ranks"));
  require(o.lr > 0, "lr", str_cat("must be > 0, got ", o.lr));
  require(o.min_lr >= 0 && o.min_lr <= o.lr, "min_lr",
          str_cat("must be in [0, lr], got ", o.min_lr));
  require(o.warmup_steps >= 0, "warmup_steps", "must be >= 0");
  require(o.weight_decay >= 0, "weight_decay", "must be >= 0");
  require(o.beta1 >= 0 && o.beta1 < 1, "beta1", "must be in [0, 1)");
  require(o.beta2 >= 0 && o.beta2 < 1, "beta2", "must be in [0, 1)");
  require(o.adam_eps > 0, "adam_eps", "must be > 0");
  require(o.log_every >= 1, "log_every", str_cat("must be >= 1, got ", o.log_every));
  require(o.metadata == "cached" || o.metadata == "per-layer", "metadata",
          str_cat("must be cached or per-layer, got '", o.metadata, "'"));
  require(o.routing == "bincount" || o.routing == "per-expert", "routing",
          str_cat("must be bincount or per-expert, got '", o.routing, "'"));
  require(o.ep_size >= 1 && world % o.ep_size == 0, "ep_size",
          str_cat("must divide the world size ", world, ", got ", o.ep_size));
  require(!o.model.is_moe() || o.model.n_experts % o.ep_size == 0, "ep_size",
          str_cat("must divide n_experts=", o.model.n_experts, ", got ", o.ep_size));
  require(o.model.is_moe() || o.ep_size == 1, "ep_size", "must be 1 for a dense model");
  require(o.collective_timeout_s > 0, "collective_timeout_s", "must be > 0");
  require(o.ce_chunk_tokens >= 1, "ce_chunk_tokens", "must be >= 1");
  require(o.offload == "none" || o.offload == "single" || o.offload == "double", "offload",
          str_cat("must be none, single or double, got '", o.offload, "'"));
  require(o.offload_buffers >= 2, "offload_buffers",
          str_cat("must be >= 2, got ", o.offload_buffers));
  require(o.offload_lookahead >= 1 && o.offload_lookahead < o.offload_buffers, "offload_lookahead",
          str_cat("must be in [1, offload_buffers - 1 = ", o.offload_buffers - 1, "], got ",
                  o.offload_lookahead));
  require(o.sim_link_gbps >= 0, "sim_link_gbps", str_cat("must be >= 0, got ", o.sim_link_gbps));
  require(o.pinned_pool_mib >= 0, "pinned_pool_mib",
          str_cat("must be >= 0 (0: automatic), got ", o.pinned_pool_mib));
  require(o.lane_arbiter == "on" || o.lane_arbiter == "off", "lane_arbiter",
          str_cat("must be on or off, got '", o.lane_arbiter, "'"));
  make_lane_options(o).validate();
  const int64_t eot = o.data.eot_token < 0 ? o.model.vocab_size - 1 : o.data.eot_token;
  require(eot < o.model.vocab_size, "eot_token",
          str_cat("must be < vocab_size=", o.model.vocab_size, ", got ", eot));
  require(o.data.synthetic_vocab >= 0 && o.data.synthetic_vocab < o.model.vocab_size,
          "synthetic_vocab", str_cat("must be in [0, vocab_size), got ", o.data.synthetic_vocab));
  require(o.data.synthetic_zipf >= 0, "synthetic_zipf", "must be >= 0");
  require(o.data.synthetic_mean_doc_len > 1, "synthetic_mean_doc_len", "must be > 1");
  require(o.checkpoint_every >= 0, "checkpoint_every", "must be >= 0");
  require(o.keep_last >= 0, "keep_last", "must be >= 0");
  require(o.stop_at_step >= 0, "stop_at_step", "must be >= 0");
  require(!o.resume.empty(), "resume", "must be none, auto or the path of a checkpoint");
  require(o.resume != "auto" || !o.checkpoint_dir.empty(), "resume",
          "auto needs checkpoint_dir (the directory to resume from)");
  require(o.eval_batches >= 1, "batches", "must be >= 1");
  require(o.bench_warmup >= 0 && o.bench_steps >= 1, "bench_steps",
          "bench_warmup must be >= 0 and bench_steps >= 1");
}

LaneOptions make_lane_options(const TrainOptions& o, const Backend* be) {
  LaneOptions l;
  l.enabled = o.lane_arbiter == "on";
  l.chunk_mib = o.lane_chunk_mib;
  l.inflight = o.lane_inflight;
  l.pcie_groups = o.pcie_groups;
  // A grant that takes longer than a collective may is a stuck peer.
  l.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.collective_timeout_s * 1000));
  if (be) l.link_id = host_link_of_pci_device("/sys/bus/pci/devices", be->pci_bus_id());
  return l;
}

}  // namespace hp
