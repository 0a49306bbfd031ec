#include "launch/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <thread>
#include <vector>

#include "framework/core/log.h"
#include "framework/core/trace.h"
#include "launch/checkpointing.h"
#include "parallel/moe_exchange.h"
#if HOTPATH_HAVE_CUDA
#include "framework/backend/cuda/cuda_backend.h"
#include "parallel/cuda/nccl_communicator.h"
#endif

namespace hp {

std::unique_ptr<Backend> make_backend(const TrainOptions& o, int local_rank) {
  std::string device = o.device;
#if HOTPATH_HAVE_CUDA
  const int gpus = cuda_device_count();
  if (device == "auto") device = gpus > 0 ? "cuda" : "cpu";
  if (device == "cuda") {
    if (gpus == 0)
      HP_USER_ERROR(ErrorKind::kConfig,
                    "config key 'device': cuda requested but no CUDA device is visible");
    return make_cuda_backend(local_rank % gpus);
  }
#else
  if (device == "auto") device = "cpu";
  if (device == "cuda")
    HP_USER_ERROR(ErrorKind::kConfig,
                  "config key 'device': this hotpath was built without CUDA; use device=cpu or "
                  "build the cuda preset");
#endif
  return make_cpu_backend(o.cpu_dtype == "f64" ? DType::kF64 : DType::kF32);
}

DataConfig make_data_config(const TrainOptions& o, int rank, int world) {
  DataConfig d;
  d.source = o.data.source;
  d.vocab_size = o.model.vocab_size;
  d.eot_token =
      o.data.eot_token < 0 ? static_cast<int32_t>(o.model.vocab_size - 1) : o.data.eot_token;
  d.seq_len = o.seq_len;
  d.rows_per_batch = o.rows_per_batch();
  d.rank = rank;
  d.world = world;
  d.seed = o.seed;
  d.shuffle = o.data.shuffle;
  // Default: every id below the EOT is a content token.
  d.synthetic_vocab = o.data.synthetic_vocab > 0 ? o.data.synthetic_vocab : d.eot_token;
  d.synthetic_zipf = o.data.synthetic_zipf;
  d.synthetic_mean_doc_len = o.data.synthetic_mean_doc_len;
  return d;
}

double step_model_flops(const ModelConfig& c, const PackedBatch& batch) {
  double flops = 6.0 * static_cast<double>(count_params(c).active) * batch.num_tokens();
  for (int l = 0; l < c.n_layers; ++l)
    flops += 12.0 * batch.attention_pairs(c.window_for_layer(l)) * c.head_dim * c.n_heads;
  return flops;
}

ModelOptions make_model_options(const TrainOptions& o) {
  ModelOptions m;
  m.checkpoint_activations = o.checkpoint_activations;
  m.metadata = o.metadata == "per-layer" ? MetadataMode::kPerLayer : MetadataMode::kCached;
  m.routing = o.routing == "per-expert" ? RoutingMode::kPerExpert : RoutingMode::kBincount;
  m.ce_chunk_tokens = o.ce_chunk_tokens;
  m.offload.mode = parse_offload_mode(o.offload);
  m.offload.buffers = o.offload_buffers;
  m.offload.lookahead = o.offload_lookahead;
  m.offload.sim_link_gbps = o.sim_link_gbps;
  m.offload.pinned_pool_bytes = o.pinned_pool_mib << 20;
  if (m.offload.mode != OffloadMode::kNone) m.checkpoint_activations = true;
  m.max_positions = o.seq_len;
  return m;
}

RankContext single_rank_context() {
  RankContext ctx;
  ctx.groups = make_process_groups(create_world(ctx.launch, default_bootstrap(ctx.launch)), 1);
  return ctx;
}

Trainer::Trainer(const TrainOptions& o, const RankContext& ctx)
    : o_(o),
      ctx_(ctx),
      opt_(AdamWConfig{o.beta1, o.beta2, o.adam_eps, o.weight_decay, o.grad_clip}) {
  validate_train_options(o_, ctx_.world());
  HP_CHECK(ctx_.groups.ep_size == o_.ep_size, "process groups built for ep_size ",
           ctx_.groups.ep_size, " but options say ", o_.ep_size);
  be_ = make_backend(o_, ctx_.launch.local_rank);
  loader_ = DataLoader::open(make_data_config(o_, ctx_.rank(), ctx_.world()));
  // Device tensors move over NCCL groups that mirror the host groups; scalars (valid-target
  // counts, loss sums) stay on the host communicators of ctx_.groups.
  ProcessGroups tensor_groups = ctx_.groups;
  // Gradient reductions get their own NCCL communicators on the comm stream, so they overlap
  // backward, where NCCL can order concurrent communicators; else they share tensor_groups.
  ProcessGroups grad_groups;
  Backend::StreamKind grad_stream = Backend::StreamKind::kCompute;
#if HOTPATH_HAVE_CUDA
  if (be_->device() == Device::kCUDA && ctx_.world() > 1) {
    tensor_groups = make_nccl_groups(ctx_.groups, *be_);
    grad_groups = make_nccl_grad_groups(ctx_.groups, *be_);
    if (grad_groups.world) grad_stream = Backend::StreamKind::kComm;
  }
#endif
  if (!grad_groups.world) grad_groups = tensor_groups;
  std::shared_ptr<ExpertExchange> exchange;
  if (ctx_.world() > 1)
    exchange = std::make_shared<CommExpertExchange>(tensor_groups.ep, tensor_groups.world);
  model_ = std::make_unique<Model>(o_.model, make_model_options(o_), *be_, exchange);
  if (o_.offload != "none") {
    // Over the ranks of this host (collective over the node group); lane_arbiter=off gives a
    // local arbiter that grants at once but still counts the copies for the step stats.
    lane_ = make_copy_arbiter(*ctx_.groups.node, make_lane_options(o_, be_.get()));
    be_->set_copy_arbiter(lane_.get());
  }
  model_->init_params(o_.seed);
  if (ctx_.world() > 1) {
    grad_sync_ = std::make_unique<GradSync>(*be_, model_->params(), grad_groups, grad_stream);
    model_->set_grad_ready_hook([this](int layer) { grad_sync_->layer_ready(layer); });
  }
  sched_.lr = o_.lr;
  sched_.min_lr = o_.min_lr;
  sched_.warmup_steps = o_.warmup_steps;
  sched_.total_steps = std::max<int64_t>(1, o_.steps);
  stats_ = be_->zeros({4}, be_->master_dtype());
  if (const char* f = std::getenv("HOTPATH_FAULT")) {
    char kind[32] = {0};
    int rank = -1;
    long long step = -1;
    const std::string k = std::sscanf(f, "%31[a-z-]:%d:%lld", kind, &rank, &step) == 3 ? kind : "";
    if (k != "throw" && k != "kill" && k != "hang" && !is_save_fault_kind(k))
      HP_USER_ERROR(ErrorKind::kConfig, "HOTPATH_FAULT='", f,
                    "': expected KIND:RANK:STEP with KIND throw, kill, hang or kill-save-POINT (",
                    "POINT: begin, data, close, rename)");
    fault_kind_ = kind;
    fault_rank_ = rank;
    fault_step_ = step;
  }
}

void Trainer::maybe_inject_fault() {
  if (fault_rank_ != ctx_.rank() || fault_step_ != step_ || is_save_fault_kind(fault_kind_)) return;
  log_warn("injecting fault '", fault_kind_, "' at step ", step_, " (HOTPATH_FAULT)");
  if (fault_kind_ == "throw") HP_FAIL(ErrorKind::kInternal, "injected failure at step ", step_);
  if (fault_kind_ == "kill") std::raise(SIGKILL);
  // hang: the peers must time out; this rank gives up after three timeouts.
  std::this_thread::sleep_for(std::chrono::duration<double>(3 * o_.collective_timeout_s));
  HP_FAIL(ErrorKind::kInternal, "injected hang at step ", step_, " ended");
}

StepStats Trainer::step() {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  Backend& be = *be_;
  be.syncs().reset();
  ++step_;
  maybe_inject_fault();
  auto* node_lane = dynamic_cast<NodeLaneArbiter*>(lane_.get());
  if (lane_) {
    lane_->begin_step();
    if (node_lane) link_bytes_ = node_lane->link_bytes();
  }

  PackedBatch batch = loader_->next();
  BatchMeta meta = be.upload_batch(batch);
  // The loss is a mean over the global batch: the count of valid targets is summed over ranks on
  // the host (known from the packed metadata, no device sync).
  Tensor counts = Tensor::host_from(std::vector<int64_t>{batch.num_valid_targets}, DType::kI64);
  if (ctx_.world() > 1) ctx_.groups.world->all_reduce(counts, ReduceOp::kSum);
  const int64_t valid = counts.data<int64_t>()[0];

  model_->zero_grads();
  be.fill(stats_, 0.0);
  LossSums sums{stats_.slice(0, 1), stats_.slice(1, 2)};
  model_->forward_backward(meta, valid > 0 ? 1.0 / static_cast<double>(valid) : 0.0, sums);
  if (grad_sync_) grad_sync_->finish();
  Tensor sumsq = stats_.slice(2, 4);
  grad_sum_squares(be, model_->params(), sumsq);

  // The step's one blocking read: losses and the gradient norm together.
  Tensor host = Tensor::host({4}, be.master_dtype());
  be.read_to_host(stats_, host, SyncCause::kLoss);
  std::vector<double> s = to_double_vector(host);
  if (ctx_.world() > 1) {
    // Loss sums add over all ranks; dense gradients are identical everywhere after their
    // all-reduce; expert gradients differ across the ep group only.
    Tensor losses = Tensor::host_from(std::vector<double>{s[0], s[1]}, DType::kF64);
    ctx_.groups.world->all_reduce(losses, ReduceOp::kSum);
    Tensor expert = Tensor::host_from(std::vector<double>{s[3]}, DType::kF64);
    ctx_.groups.ep->all_reduce(expert, ReduceOp::kSum);
    s[0] = losses.data<double>()[0];
    s[1] = losses.data<double>()[1];
    s[3] = expert.data<double>()[0];
  }

  StepStats st;
  st.step = step_;
  st.valid_targets = valid;
  st.tokens = batch.num_tokens() * ctx_.world();
  st.model_flops = step_model_flops(o_.model, batch) * ctx_.world();
  st.loss = valid > 0 ? s[0] / static_cast<double>(valid) : 0.0;
  st.aux_loss = s[1];
  st.grad_norm = std::sqrt(s[2] + s[3]);
  st.lr = sched_.at(step_);
  tokens_seen_ += st.tokens;
  {
    TraceRange range("optimizer");
    opt_.step(be, model_->params(), step_, st.lr, clip_coefficient(st.grad_norm, o_.grad_clip));
  }
  st.syncs = be.syncs();
  if (lane_) {
    // Every copy of the step has completed (backward waited for the last reload, which follows
    // the step's offloads on the copy stream) and released its grants.
    st.lane = true;
    st.lane_copies = lane_->stats();
    if (node_lane) {
      st.link_ranks = node_lane->link_ranks();
      st.link_bytes = node_lane->link_bytes();
      std::vector<double> share;
      for (size_t i = 0; i < st.link_bytes.size(); ++i) {
        st.link_bytes[i] -= i < link_bytes_.size() ? link_bytes_[i] : 0;
        share.push_back(static_cast<double>(st.link_bytes[i]));
      }
      st.lane_jain = jain_fairness(share);
    }
  }
  st.ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  st.tokens_per_s = st.tokens / (st.ms / 1000.0);
  return st;
}

namespace {

std::string fmt(double v, int prec = 4) {
  std::ostringstream os;
  os << std::setprecision(prec) << v;
  return os.str();
}

}  // namespace

std::string lane_log_fields(const StepStats& s) {
  if (!s.lane) return "";
  const CopyArbiterStats& c = s.lane_copies;
  std::string out = str_cat(
      " lane_mib=r", fmt(c.bytes[0] / 1048576.0, 4), "/o", fmt(c.bytes[1] / 1048576.0, 4),
      " lane_wait_ms=", fmt(1e3 * (c.wait_s[0] + c.wait_s[1]), 3), "/max",
      fmt(1e3 * std::max(c.max_wait_s[0], c.max_wait_s[1]), 3),
      " lane_gbps=", fmt(c.achieved_gbps(), 3));
  if (!s.link_ranks.empty()) out += " jain=" + fmt(s.lane_jain, 4);
  return out;
}

std::string lane_json_fields(const StepStats& s) {
  if (!s.lane) return "";
  const CopyArbiterStats& c = s.lane_copies;
  std::ostringstream os;
  os << std::setprecision(9) << ",\"lane\":{\"arbiter\":\""
     << (s.link_ranks.empty() ? "local" : "node") << "\"";
  for (int d = 0; d < 2; ++d) {
    const std::string n = copy_direction_name(static_cast<CopyDirection>(d));
    os << ",\"" << n << "_bytes\":" << c.bytes[d] << ",\"" << n << "_chunks\":" << c.chunks[d]
       << ",\"" << n << "_wait_s\":" << c.wait_s[d] << ",\"" << n
       << "_max_wait_s\":" << c.max_wait_s[d];
  }
  os << ",\"active_s\":" << c.active_s << ",\"gbps\":" << c.achieved_gbps();
  if (!s.link_ranks.empty()) {
    os << ",\"link_ranks\":[";
    for (size_t i = 0; i < s.link_ranks.size(); ++i) os << (i ? "," : "") << s.link_ranks[i];
    os << "],\"link_bytes\":[";
    for (size_t i = 0; i < s.link_bytes.size(); ++i) os << (i ? "," : "") << s.link_bytes[i];
    os << "],\"jain\":" << s.lane_jain;
  }
  os << "}";
  return os.str();
}

namespace {

std::string metrics_json(const StepStats& s, bool moe) {
  std::ostringstream os;
  os << std::setprecision(9) << "{\"step\":" << s.step << ",\"loss\":" << s.loss;
  if (moe) os << ",\"aux_loss\":" << s.aux_loss;
  os << ",\"lr\":" << s.lr << ",\"grad_norm\":" << s.grad_norm
     << ",\"tokens_per_s\":" << s.tokens_per_s << ",\"ms\":" << s.ms << ",\"tokens\":" << s.tokens
     << ",\"syncs\":" << s.syncs.json() << lane_json_fields(s) << "}";
  return os.str();
}

}  // namespace

int run_train(const TrainOptions& o, const RankContext& ctx) {
  using Clock = std::chrono::steady_clock;
  const auto t_start = Clock::now();
  // SIGUSR1/SIGTERM only set a flag from here on; the step loop acts on it.
  install_preemption_handlers();
  Trainer trainer(o, ctx);
  const ParamCounts pc = count_params(o.model);
  const double floor = trainer.loader().entropy_floor();
  log_info(
      "hotpath ", HOTPATH_VERSION, ": backend=", trainer.backend().name(),
      " params: total=", pc.total, " active=", pc.active, " layers=", o.model.n_layers,
      o.model.is_moe() ? str_cat(" experts=", o.model.n_experts, " top_k=", o.model.top_k) : "");
  log_info("launch: ", ctx.launch.describe(), " world=", ctx.world(), " dp=", ctx.groups.dp_size,
           " ep=", ctx.groups.ep_size);
  if (CopyArbiter* a = trainer.copy_arbiter()) {
    const auto* lane = dynamic_cast<NodeLaneArbiter*>(a);
    std::string link;
    if (lane)
      for (int r : lane->link_ranks()) link += (link.empty() ? "" : ",") + std::to_string(r);
    log_info("offload copies: lane_arbiter=", lane ? "on" : o.lane_arbiter,
             lane ? "" : " (local grants)", " chunk=", a->chunk_bytes() >> 20, " MiB",
             lane ? str_cat(" inflight=", o.lane_inflight, " link ranks=", link) : "");
  }
  log_info(trainer.loader().describe(), " seq_len=", o.seq_len, " batch_tokens=", o.batch_tokens,
           " steps=", o.steps);
  if (!std::isnan(floor))
    log_info("entropy_floor=", fmt(floor, 6), " nats (lowest achievable mean loss)");
  // ---- resume (launch/checkpointing.h): --resume=none|auto|PATH ----
  int64_t saved_step = resume_from_options(trainer);
  const int64_t last_step = o.stop_at_step > 0 ? std::min(o.steps, o.stop_at_step) : o.steps;
  auto save = [&] {
    save_checkpoint(trainer, o.checkpoint_dir, o.keep_last);
    saved_step = trainer.steps_done();
  };

  std::ofstream metrics;
  if (!o.metrics_path.empty() && ctx.rank() == 0) {
    metrics.open(o.metrics_path, std::ios::trunc);
    if (!metrics)
      HP_USER_ERROR(ErrorKind::kConfig, "config key 'metrics_path': cannot write '", o.metrics_path,
                    "'");
  }
  // Recent losses for a smoothed figure: single steps are noisy.
  std::vector<double> recent;
  double last_loss = 0;
  int64_t tokens = 0;
  while (trainer.steps_done() < last_step) {
    // ---- one training step ----
    StepStats s = trainer.step();
    // ---------------------------
    tokens += s.tokens;
    last_loss = s.loss;
    recent.push_back(s.loss);
    if (recent.size() > 20) recent.erase(recent.begin());
    if (metrics.is_open()) metrics << metrics_json(s, o.model.is_moe()) << "\n" << std::flush;
    if (s.step % o.log_every == 0 || s.step == o.steps || s.step == 1) {
      log_info("step=", s.step, " loss=", fmt(s.loss),
               o.model.is_moe() ? " aux_loss=" + fmt(s.aux_loss) : "", " lr=", fmt(s.lr, 3),
               " grad_norm=", fmt(s.grad_norm, 3), " tok/s=", fmt(s.tokens_per_s, 5),
               " ms=", fmt(s.ms, 4), " syncs=", s.syncs.total(), lane_log_fields(s));
    }
    if (!std::isfinite(s.loss))
      HP_USER_ERROR(ErrorKind::kUser, "loss is ", s.loss, " at step ", s.step,
                    ": training diverged (try a lower lr or grad_clip)");
    // ---- checkpoint cadence and preemption (all ranks agree on the signal) ----
    const bool preempted = preemption_agreed(ctx);
    const bool periodic = o.checkpoint_every > 0 && s.step % o.checkpoint_every == 0;
    if (!o.checkpoint_dir.empty() && (periodic || preempted)) save();
    if (preempted) {
      log_warn("preemption signal: stopping after step ", s.step,
               o.checkpoint_dir.empty() ? " without a checkpoint (no checkpoint_dir)" : "",
               "; exit status ", kRequeueExitCode, " (requeue and resume with --resume=auto)");
      return kRequeueExitCode;
    }
  }
  if (!o.checkpoint_dir.empty() && saved_step != trainer.steps_done()) save();
  const double secs = std::chrono::duration<double>(Clock::now() - t_start).count();
  double avg = 0;
  for (double v : recent) avg += v;
  avg = recent.empty() ? 0 : avg / recent.size();
  std::string vs_floor;
  if (!std::isnan(floor) && floor > 0)
    vs_floor = str_cat(" entropy_floor=", fmt(floor, 6),
                       " gap=", fmt(100.0 * (avg / floor - 1.0), 3), "%");
  log_info("done: steps=", trainer.steps_done(), " final_loss=", fmt(last_loss), " mean_loss_last_",
           recent.size(), "=", fmt(avg), vs_floor, " tokens=", tokens, " time_s=", fmt(secs, 4));
  return 0;
}

}  // namespace hp
