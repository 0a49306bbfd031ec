// Training, top to bottom: the Trainer's parts (constructor), one training step (Trainer::step)
// and the run around it (run_train).
#include "launch/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <vector>

#include "framework/backend/profile.h"
#include "framework/core/log.h"
#include "launch/train/async_checkpoint.h"
#include "launch/train/evaluation.h"
#include "launch/train/fault_injection.h"
#include "launch/train/memory_plan.h"
#include "launch/train/preemption.h"
#include "parallel/link_arbiter.h"
#include "parallel/moe_exchange.h"
#if HOTPATH_HAVE_CUDA
#include "framework/backend/cuda/cuda_backend.h"
#include "parallel/cuda/nccl_communicator.h"
#endif

namespace hp {

using Clock = std::chrono::steady_clock;

namespace {
const Clock::time_point kProcessStart = Clock::now();  // static initialization, before main
}  // namespace

double seconds_since_process_start() {
  return std::chrono::duration<double>(Clock::now() - kProcessStart).count();
}

Trainer::Trainer(const TrainOptions& o, const RankContext& ctx)
    : o_(o),
      ctx_(ctx),
      opt_(o.optimizer) {
  // `o` passed validate_train_options (main) for this world.
  HP_CHECK(ctx_.groups.ep_size == o_.parallel.ep_size, "process groups built for ep_size ",
           ctx_.groups.ep_size, " but options say ", o_.parallel.ep_size);
  injected_fault();  // a malformed HOTPATH_FAULT fails here, before any work
  be_ = make_backend(o_, ctx_.launch.local_rank);
  if (be_->device() == Device::kCUDA) {
    // Every rank plans the same layout, so a layout that cannot fit is refused everywhere before
    // the model allocates or any collective runs.
    const MemoryPlan plan = plan_memory(o_, layout_of(o_, ctx_.world()), true);
    const int64_t device =
        planned_device_bytes(o_, visible_device_bytes(o_, ctx_.launch.local_rank));
    require_plan_fits(o_, plan, device);
    log_info("memory plan: ", fmt_sig(plan.total / 1073741824.0, 4), " GiB per rank of ",
             device > 0 ? fmt_sig(device / 1073741824.0, 4) : std::string("(unchecked)"),
             " GiB (parameters ", fmt_sig(plan.params / 1073741824.0, 4), ", gradients ",
             fmt_sig(plan.grads / 1073741824.0, 4), ", optimizer ",
             fmt_sig(plan.optimizer / 1073741824.0, 4), ", activations ",
             fmt_sig(plan.activations / 1073741824.0, 4), ")");
  }
  loader_ = DataLoader::open(make_data_config(o_, ctx_.rank(), ctx_.world()));
  // Device tensors move over NCCL groups that mirror the host groups; scalars (valid-target
  // counts, loss sums) stay on the host communicators of ctx_.groups.
  ProcessGroups tensor_groups = ctx_.groups;
  // Gradient reductions get their own NCCL communicators on the comm stream, so they overlap
  // backward, where NCCL can order concurrent communicators; else (or with comm_overlap=false)
  // they share tensor_groups on the compute stream.
  ProcessGroups grad_groups;
  Backend::StreamKind grad_stream = Backend::StreamKind::kCompute;
#if HOTPATH_HAVE_CUDA
  if (be_->device() == Device::kCUDA && ctx_.world() > 1) {
    tensor_groups = make_nccl_groups(ctx_.groups, *be_);
    if (o_.parallel.comm_overlap) grad_groups = make_nccl_grad_groups(ctx_.groups, *be_);
    if (grad_groups.world) grad_stream = Backend::StreamKind::kComm;
  }
#endif
  if (!grad_groups.world) grad_groups = tensor_groups;
  grad_groups_ = grad_groups;
  tensor_groups_ = tensor_groups;
  std::shared_ptr<ExpertExchange> exchange;
  if (ctx_.world() > 1)
    exchange = std::make_shared<CommExpertExchange>(tensor_groups.ep, tensor_groups.world);
  model_ = std::make_unique<Model>(o_.model, make_model_options(o_, be_.get()), *be_, exchange);
  if (o_.compute.offload.mode != OffloadMode::kNone) {
    // Over the ranks of this host (collective over the node group); link_arbiter=off gives a
    // local arbiter that grants at once but still counts the copies for the step stats.
    link_arbiter_ = make_link_arbiter(*ctx_.groups.node, make_link_options(o_, be_.get()));
    be_->set_link_arbiter(link_arbiter_.get());
  }
  model_->init_params(o_.run.seed);
  // zero1: each rank keeps the masters and moments of its shard only (parallel/zero1.h).
  if (ctx_.world() > 1 && o_.optimizer.sharding == OptimizerSharding::kZero1)
    zero1_ = std::make_unique<Zero1>(*be_, model_->params(), grad_groups, grad_stream);
  if (ctx_.world() > 1)
    grad_sync_ = std::make_unique<GradSync>(*be_, model_->params(), grad_groups, grad_stream,
                                            zero1_.get(), o_.optimizer.grad_reduce_dtype);
  state_bytes_ = hp::optimizer_state_bytes(model_->params());
  sched_ = o_.optimizer;  // lr, min_lr, warmup_steps
  sched_.total_steps = std::max<int64_t>(1, o_.run.steps);
  scalars_ = be_->zeros({4}, be_->master_dtype());
  if (o_.run.nonfinite == NonfinitePolicy::kSkip)
    check_flag_ = be_->zeros({1}, be_->master_dtype());
  // Several ranks agree on the norm and the finite check through a host collective first, and
  // nonfinite=skip checks the update before applying it: both need the host's decision before
  // the update is issued.
  if (ctx_.world() == 1 && o_.run.nonfinite != NonfinitePolicy::kSkip) {
    gate_ = be_->zeros({2}, DType::kF64);
    const size_t bytes = static_cast<size_t>(scalars_.nbytes());
    std::shared_ptr<Storage> pinned = be_->pinned_host_storage(bytes);
    scalars_host_ = pinned ? Tensor(pinned, 0, {4}, be_->master_dtype())
                           : Tensor::host({4}, be_->master_dtype());
  }
}

const char* Trainer::reduction_stream() const {
  if (!grad_sync_) return "none";
  return grad_sync_->stream() == Backend::StreamKind::kComm ? "comm" : "compute";
}

RunState Trainer::run_state() {
  RunState r{o_, ctx_, *be_, *model_, *loader_, sched_, RunPosition{step_, tokens_seen_, skipped_},
             {}};
  if (zero1_) r.params_loaded = [this] { zero1_->gather_params(); };
  r.tensor_groups = &tensor_groups_;
  if (next_batch_) r.loader_state = &ahead_state_;
  return r;
}

bool Trainer::preempted() const { return ctx_.world() > 1 ? preempted_ : preemption_requested(); }

bool Trainer::save_failed() const {
  return ctx_.world() > 1 ? save_failed_ : background_save_failed();
}

void Trainer::wait_params() {
  if (zero1_) zero1_->wait_params();
}

void Trainer::set_position(const RunPosition& p) {
  next_batch_.reset();
  step_ = p.step;
  tokens_seen_ = p.tokens_seen;
  skipped_ = p.skipped_steps;
}

bool Trainer::update_is_finite(int64_t step, double lr, double clip) {
  Backend& be = *be_;
  FamilyScope scope(be, OpFamily::kOptimizer);
  be.fill(check_flag_, 0.0);
  model_->fill_unreached_grads();  // adamw's check-only mode reads every gradient
  for (auto& p : model_->params().all()) {
    // zero1: this rank's rows and their reduced gradient, as Zero1::step updates them.
    const Tensor* shard = zero1_ ? zero1_->find_grad_shard(*p) : nullptr;
    Tensor working = p->work.storage() == p->master.storage() ? Tensor() : p->work;
    if (shard && working.defined()) {
      // The working rows of the shard (the op reads only their dtype, but takes tensors of the
      // master's numel).
      const ShardRows rows = shard_rows(*p, zero1_->group_of(*p));
      working = working.slice(rows.begin, rows.begin + rows.rows);
    }
    opt_.check_update(be, p->master, shard ? *shard : p->grad, p->m, p->v, p->weight_decay, step,
                      lr, clip, working, check_flag_);
  }
  Tensor host = Tensor::host({1}, be.master_dtype());
  be.read_to_host(check_flag_, host, SyncCause::kOther);
  double bad = to_double_vector(host)[0] != 0 ? 1.0 : 0.0;
  if (ctx_.world() > 1) {
    // Every rank skips together, whichever ranks' shards would overflow.
    Tensor flags = Tensor::host_from(std::vector<double>{bad}, DType::kF64);
    ctx_.groups.world->all_reduce(flags, ReduceOp::kSum);
    bad = flags.data<double>()[0];
  }
  return bad == 0;
}

// ================================ one training step ============================================
StepStats Trainer::step() {
  const auto t0 = Clock::now();
  Backend& be = *be_;
  PhaseScope other(be, StepPhase::kOther);  // batch, host scalars and stats
  be.syncs().reset();
  StepStats st;
  st.step = step_ + 1;
  maybe_inject_step_fault(ctx_.rank(), st.step, o_.parallel.collective_timeout_s);
  if (link_arbiter_) link_arbiter_->begin_step();

  // ---- batch: this rank's rows of global batch `step`, metadata uploaded once ----
  // The loss is a mean over the global batch: the count of valid targets is summed over ranks
  // on the host (known from the packed metadata, no device sync), and with it the document
  // tokens and their FLOPs, which the step's throughput and MFU count (integers, exact in f64).
  // Several ranks: the batch was loaded, and its counts summed, in the previous step's host
  // collective; only the first step after a start or a load sums them on its own.
  const auto counts_of = [&](const PackedBatch& b) {
    return std::vector<double>{static_cast<double>(b.num_valid_targets),
                               static_cast<double>(b.num_doc_tokens),
                               step_model_flops(o_.model, b)};
  };
  PackedBatch batch;
  std::vector<double> counts;
  if (next_batch_) {
    batch = std::move(*next_batch_);
    next_batch_.reset();
    counts = next_counts_;
  } else {
    batch = loader_->next();
    counts = counts_of(batch);
    if (ctx_.world() > 1) {
      Tensor sums = Tensor::host_from(counts, DType::kF64);
      ctx_.groups.world->all_reduce(sums, ReduceOp::kSum);
      std::copy(sums.data<double>(), sums.data<double>() + counts.size(), counts.begin());
    }
  }
  BatchMeta meta = be.upload_batch(batch);
  st.valid_targets = static_cast<int64_t>(counts[0]);
  st.tokens = static_cast<int64_t>(counts[1]);
  st.model_flops = counts[2];
  st.positions = batch.num_tokens() * ctx_.world();
  const double grad_scale =
      st.valid_targets > 0 ? 1.0 / static_cast<double>(st.valid_targets) : 0.0;

  // Scalars of the step, on the device until one read: lm loss sum, aux loss sum, then the
  // dense and expert gradient sums of squares.
  be.fill(scalars_, 0.0);
  const LossSums sums{scalars_.slice(0, 1), scalars_.slice(1, 2)};
  Tensor grad_sumsq = scalars_.slice(2, 4);
  model_->zero_grads();

  // ---- forward: embedding, layers, final norm ----
  {
    PhaseScope phase(be, StepPhase::kForward);
    // zero1: compute waits for each layer's all-gathered weights (from the last update) just
    // before the layer reads them.
    model_->forward(meta, sums.aux, Pass::kTrain, zero1_.get());
    if (zero1_) zero1_->wait_params();  // nothing left in flight past the forward
  }
  // ---- loss: chunked unembedding + cross-entropy, and its gradient ----
  {
    PhaseScope phase(be, StepPhase::kLoss);
    model_->loss(grad_scale, sums.lm);
  }
  // ---- backward; each layer's gradient all-reduce starts as backward finishes the layer ----
  GradSync* grad_sync = grad_sync_.get();  // null on one rank: nothing to reduce
  {
    PhaseScope phase(be, StepPhase::kBackward);
    // One rank without zero1: the optimizer below reads the experts no row reached as zero
    // gradients, so backward need not zero-fill them.
    model_->backward(grad_sync, grad_sync == nullptr && !zero1_);
  }
  {
    PhaseScope phase(be, StepPhase::kGradSync);
    if (grad_sync) grad_sync->finish();  // compute now waits for the last reductions
  }
  if (nan_gradients_injected(ctx_.rank(), st.step)) {
    model_->fill_unreached_grads();  // every slice now holds what it reads as
    for (auto& p : model_->params().all()) {
      be.fill(p->grad, std::nan(""));
      // zero1: the norm and the update read the reduced rows of this rank's shards.
      if (Tensor* shard = zero1_ ? zero1_->find_grad_shard(*p) : nullptr)
        be.fill(*shard, std::nan(""));
    }
  }

  {
    PhaseScope phase(be, StepPhase::kOptimizer);
    // ---- gradient norm and the step's one blocking read (losses and norm together) ----
    // Several ranks: each squares the rows it owns under the zero1 partition (sharded or not),
    // summed over the world below, so none and zero1 fold the same numbers in the same order.
    if (ctx_.world() > 1)
      partitioned_grad_sum_squares(be, model_->params(), grad_groups_, zero1_.get(), grad_sumsq);
    else
      grad_sum_squares(be, model_->params(), grad_sumsq);
    st.lr = sched_.at(st.step);
    // One rank, nonfinite=abort: the scalars are copied out, and the update is issued right
    // behind them, gated on the device by the same finite check and clip coefficient the host
    // computes below (the same bits), so the device goes on from the norms to the update
    // without waiting for the host to read them. A non-finite step leaves every parameter and
    // moment as it was, as below.
    const bool gated = gate_.defined();
    std::shared_ptr<Backend::Event> scalars_read;
    if (gated) {
      be.copy(scalars_, scalars_host_);
      scalars_read = be.record_event(Backend::StreamKind::kCompute);
      be.update_gate(scalars_, grad_sumsq, o_.optimizer.grad_clip, gate_);
      opt_.step_gated(be, model_->params(), st.step, st.lr, gate_);
    }
    // The next batch is packed here, on the host, while the device still works through
    // backward and the norms queued above (else the device would idle while the host packs it
    // at the start of the next step); on several ranks its counts ride in this step's
    // collective.
    ahead_state_ = loader_->state();
    next_batch_ = loader_->next();
    std::vector<double> next = counts_of(*next_batch_);
    if (ctx_.world() == 1) next_counts_ = next;
    Tensor host;
    if (gated) {
      be.event_synchronize(*scalars_read, SyncCause::kLoss);
      host = scalars_host_;
    } else {
      host = Tensor::host({4}, be.master_dtype());
      be.read_to_host(scalars_, host, SyncCause::kLoss);
    }
    std::vector<double> s = to_double_vector(host);
    // Loss sums add over all ranks, and so does a count of ranks that saw a non-finite value,
    // so that every rank takes the same decision below; so do the partial sums of squares.
    double nonfinite_ranks =
        std::all_of(s.begin(), s.end(), [](double v) { return std::isfinite(v); }) ? 0.0 : 1.0;
    if (ctx_.world() > 1) {
      // The step's one host collective (one more under nonfinite=skip, which needs the clip
      // coefficient that these sums give): with the sums ride the next batch's counts and one
      // element of flags: the ranks that received a preemption signal plus (world + 1) times
      // the ranks whose background checkpoint write failed (both counts exact in a double).
      // Each element is summed on its own, so the riders change no bit of the sums.
      const double flag_base = static_cast<double>(ctx_.world() + 1);
      Tensor world_sums = Tensor::host_from(
          std::vector<double>{s[0], s[1], nonfinite_ranks, s[2], s[3], next[0], next[1], next[2],
                              (preemption_requested() ? 1.0 : 0.0) +
                                  (background_save_failed() ? flag_base : 0.0)},
          DType::kF64);
      ctx_.groups.world->all_reduce(world_sums, ReduceOp::kSum);
      const double* w = world_sums.data<double>();
      s[0] = w[0];
      s[1] = w[1];
      nonfinite_ranks = w[2];
      s[2] = w[3];
      s[3] = w[4];
      next_counts_.assign(w + 5, w + 8);
      save_failed_ = w[8] >= flag_base;
      preempted_ = std::fmod(w[8], flag_base) > 0;
    }
    st.loss = st.valid_targets > 0 ? s[0] / static_cast<double>(st.valid_targets) : 0.0;
    st.aux_loss = s[1];
    st.grad_norm = std::sqrt(s[2] + s[3]);
    // ---- finite check, agreed by all ranks, before anything changes ----
    st.finite = nonfinite_ranks == 0 && std::isfinite(st.loss) && std::isfinite(st.grad_norm);
    // ---- clip and update ----
    const double clip = clip_coefficient(st.grad_norm, o_.optimizer.grad_clip);
    // nonfinite=skip: an update that would itself make a parameter or a moment non-finite (a
    // huge lr) is not applied either; checked on every rank's shard, agreed by all.
    update_overflowed_ = false;
    if (st.finite && o_.run.nonfinite == NonfinitePolicy::kSkip) {
      update_overflowed_ = !update_is_finite(st.step, st.lr, clip);
      st.finite = !update_overflowed_;
    }
    if (gated) {
      // Issued above; the device took this decision from the same numbers.
    } else if (st.finite && zero1_) {
      // This rank's rows, then the all-gathers of the updated parameters (waited for before
      // the next forward).
      zero1_->step([&](Param& p, const Tensor& grad, Tensor& working) {
        opt_.update(be, p.master, grad, p.m, p.v, p.weight_decay, st.step, st.lr, clip, working);
      });
    } else if (st.finite) {
      opt_.step(be, model_->params(), st.step, st.lr, clip);
    }
  }

  // ---- stats of the step ----
  // nonfinite=skip: the step counts as done (its batch is consumed, the LR schedule moves on),
  // but nothing was updated; abort: nothing moves and the run stops.
  if (!st.finite && o_.run.nonfinite == NonfinitePolicy::kSkip) {
    st.skipped = true;
    ++skipped_;
  }
  if (st.finite || st.skipped) {
    step_ = st.step;
    tokens_seen_ += st.tokens;
  }
  st.skipped_steps = skipped_;
  st.syncs = be.syncs();
  st.optimizer_state_bytes_dense = state_bytes_.dense;
  st.optimizer_state_bytes_expert = state_bytes_.expert;
  // Every copy of the step has completed (backward waited for the last reload, which follows
  // the step's offloads on the copy stream) and released its grants.
  if (link_arbiter_) st.copies = link_arbiter_->stats();
  st.ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  st.tokens_per_s = st.tokens / (st.ms / 1000.0);
  st.padding = st.positions > 0 ? 1.0 - static_cast<double>(st.tokens) / st.positions : 0.0;
  if (be.device() == Device::kCUDA)
    st.mfu = st.model_flops / ctx_.world() / (st.ms / 1000.0) / kPeakBf16Flops;
  return st;
}
// ===============================================================================================

namespace {

// nan and inf as the words, whatever their sign bit.
std::string number_text(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return fmt_sig(v, 6);
}

void log_run_header(const TrainOptions& o, const RankContext& ctx, Trainer& trainer) {
  const ParamCounts pc = count_params(o.model);
  log_info(
      "hotpath ", HOTPATH_VERSION, ": backend=", trainer.backend().name(),
      " params: total=", pc.total, " active=", pc.active, " layers=", o.model.n_layers,
      o.model.is_moe() ? str_cat(" experts=", o.model.n_experts, " top_k=", o.model.top_k) : "");
#if HOTPATH_HAVE_CUDA
  if (trainer.backend().device() == Device::kCUDA)
    log_info("attention: ", cuda_attention_description(trainer.backend()));
#endif
  log_info("launch: ", ctx.launch.describe(), " world=", ctx.world(), " dp=", ctx.groups.dp_size,
           " ep=", ctx.groups.ep_size);
  const OptimizerStateBytes& sb = trainer.optimizer_state_bytes();
  log_info("optimizer state: optimizer_sharding=",
           o.optimizer.sharding == OptimizerSharding::kZero1 ? "zero1" : "none",
           " grad_reduce_dtype=", o.optimizer.grad_reduce_dtype == DType::kBF16 ? "bf16" : "fp32",
           " masters+moments on this rank: dense=", sb.dense, " B expert=", sb.expert, " B");
  if (LinkArbiter* a = trainer.link_arbiter()) {
    const LinkArbiterStats s = a->stats();
    std::string link;
    for (int r : s.link_ranks) link += (link.empty() ? "" : ",") + std::to_string(r);
    log_info(
        "offload copies: link_arbiter=", s.shared() || o.link.enabled ? "on" : "off",
        s.shared() ? "" : " (local grants)", " chunk=", a->chunk_bytes() >> 20, " MiB",
        s.shared() ? str_cat(" inflight=", o.link.inflight, " link ranks=", link) : "");
  }
  log_info(trainer.loader().describe(), " seq_len=", o.data.seq_len,
           " batch_tokens=", o.data.batch_tokens, " steps=", o.run.steps);
  const double floor = trainer.loader().entropy_floor();
  if (!std::isnan(floor))
    log_info("entropy_floor=", fmt_sig(floor, 6), " nats (lowest achievable mean loss)");
}

}  // namespace

int run_train(const TrainOptions& o, const RankContext& ctx) {
  const auto t_start = Clock::now();
  // SIGUSR1/SIGTERM only set a flag (handlers installed first thing in main); the step loop acts
  // on it, and so does start-up: a signal before the first step stops the run there, all ranks
  // together, with nothing to save (no checkpoint, the metrics file untouched).
  const auto preempted_before_training = [&](const char* when) {
    if (!preemption_agreed(ctx)) return false;
    log_warn("preemption signal ", when, ": stopping before any step; exit status ",
             kRequeueExitCode, " (requeue and resume with --resume=auto)");
    return true;
  };
  if (preempted_before_training("during start-up")) return kRequeueExitCode;
  // Held-out data (eval_data), opened before the model is built: a file that cannot be used
  // stops the run before any work, naming the key.
  std::unique_ptr<HeldOutData> held_out;
  if (!o.held_out.data.empty())
    held_out = std::make_unique<HeldOutData>(o, o.held_out.data, "eval_data", ctx.rank(),
                                             ctx.world());
  Trainer trainer(o, ctx);
  log_run_header(o, ctx, trainer);
  if (held_out)
    log_info("eval: ", held_out->describe(), "; ", o.held_out.batches,
             " global batches from its start after ",
             o.held_out.every > 0 ? str_cat("every ", o.held_out.every, " steps and ") : "",
             "the last step");
  // ---- init_from: start from given weights; a checkpoint found by resume wins ----
  init_from_options(trainer.run_state());
  // ---- resume: --resume=none|auto|PATH ----
  trainer.set_position(resume_from_options(trainer.run_state()));
  if (preempted_before_training("while the model and data were being set up"))
    return kRequeueExitCode;
  const int64_t last_step =
      o.run.stop_at_step > 0 ? std::min(o.run.steps, o.run.stop_at_step) : o.run.steps;
  // Background or synchronous saves (decided here, before step 1, and logged).
  CheckpointSaver saver(o, trainer.run_state());
  saver.set_steps_done(trainer.steps_done());
  const int64_t started_at = trainer.steps_done();
  MetricsWriter metrics(ctx.rank() == 0 ? o.run.metrics_path : "", trainer.steps_done());
  if (metrics.dropped() > 0)
    log_info("metrics_path: kept ", metrics.kept(), " lines of steps <= ", trainer.steps_done(),
             ", dropped ", metrics.dropped(), " of later steps (or torn); appending");
  const bool moe = o.model.is_moe();

  // Recent losses for a smoothed figure: single steps are noisy.
  std::vector<double> recent;
  double last_loss = 0;
  int64_t last_applied = 0;      // the last step of this run whose update was applied (0: none)
  int64_t skipped_in_a_row = 0;  // nonfinite=skip: skipped steps since the last applied one
  int64_t tokens = 0;
  std::optional<EvalStats> last_eval;  // the evaluation after the last step, when it ran
  while (trainer.steps_done() < last_step) {
    // ---- one training step ----
    StepStats s = trainer.step();
    // ---------------------------
    saver.set_steps_done(trainer.steps_done());
    // A background checkpoint write that failed on any rank stops every rank here, at the same
    // step boundary (agreed in the step's host collective).
    if (trainer.save_failed()) saver.stop_for_failure();
    s.checkpoints = saver.take_reports();
    // ---- held-out loss of the parameters after this step's update (a step that stops the run
    // as diverged is not evaluated); before the record and the checkpoint, which it changes not
    if (held_out && (s.finite || s.skipped) &&
        ((o.held_out.every > 0 && s.step % o.held_out.every == 0) || s.step == last_step)) {
      s.eval = evaluate_held_out(trainer, *held_out, o.held_out.batches);
      if (s.step == last_step) last_eval = s.eval;
    }
    metrics.write(s, moe);
    if (s.step % o.run.log_every == 0 || s.step == o.run.steps || s.step == 1 || !s.finite ||
        s.eval)
      log_info(step_log_line(s, moe));
    if (!s.finite && !s.skipped)
      HP_USER_ERROR(ErrorKind::kUser, "training diverged at step ", s.step,
                    ": loss=", number_text(s.loss), " grad_norm=", number_text(s.grad_norm),
                    "; the step was not applied and no checkpoint of it is written (nonfinite="
                    "abort; try a lower lr or grad_clip, resume from the last checkpoint, or "
                    "nonfinite=skip to skip such steps)");
    if (s.skipped)
      log_warn("step ", s.step, ": loss=", number_text(s.loss),
               " grad_norm=", number_text(s.grad_norm),
               trainer.last_update_overflowed()
                   ? str_cat(" finite, but the update (lr=", number_text(s.lr),
                             ") would make parameters or moments non-finite")
                   : std::string(" not finite"),
               ": skipped (nonfinite=skip; parameters and moments unchanged), ", s.skipped_steps,
               " skipped in this run so far");
    tokens += s.tokens;
    if (!s.skipped) {
      last_loss = s.loss;
      last_applied = s.step;
      skipped_in_a_row = 0;
      recent.push_back(s.loss);
      if (recent.size() > 20) recent.erase(recent.begin());
    } else if (++skipped_in_a_row > o.run.max_skipped_steps) {
      // A run whose updates keep failing is not recovering; nothing of these steps is saved.
      HP_USER_ERROR(ErrorKind::kUser, "stopping at step ", s.step, ": ", skipped_in_a_row,
                    skipped_in_a_row == 1 ? " step was" : " steps in a row were",
                    " skipped as non-finite (nonfinite=skip allows at most max_skipped_steps=",
                    o.run.max_skipped_steps,
                    " in a row); the run is not recovering: lower lr (now ", number_text(s.lr),
                    ") or grad_clip, or resume from an earlier checkpoint");
    }
    // ---- checkpoint cadence and preemption (all ranks agree on the signal) ----
    const bool preempted = trainer.preempted();  // agreed in the step's host collective
    const bool periodic = o.checkpoint.every > 0 && s.step % o.checkpoint.every == 0;
    if (!o.checkpoint.dir.empty() && preempted)
      saver.save_now(trainer.run_state());  // waits for the save in flight, then saves
    else if (!o.checkpoint.dir.empty() && periodic)
      saver.save(trainer.run_state());
    if (preempted) {
      log_warn("preemption signal: stopping after step ", s.step,
               o.checkpoint.dir.empty() ? " without a checkpoint (no checkpoint_dir)" : "",
               "; exit status ", kRequeueExitCode, " (requeue and resume with --resume=auto)");
      return kRequeueExitCode;
    }
  }
  // The end: the save in flight is waited for, then the last step saved unless it is already
  // (a run that did no step saves nothing new).
  if (!o.checkpoint.dir.empty() && trainer.steps_done() != started_at)
    saver.save_now(trainer.run_state());
  const double secs = std::chrono::duration<double>(Clock::now() - t_start).count();
  double avg = 0;
  for (double v : recent) avg += v;
  avg = recent.empty() ? 0 : avg / recent.size();
  const double floor = trainer.loader().entropy_floor();
  std::string vs_floor;
  if (!std::isnan(floor) && floor > 0 && !recent.empty())
    vs_floor = str_cat(" entropy_floor=", fmt_sig(floor, 6),
                       " gap=", fmt_sig(100.0 * (avg / floor - 1.0), 3), "%");
  // Never a stale loss: when the last step was skipped, the loss shown is labelled with the step
  // it belongs to; with no step applied in this run there is none to show.
  std::string final_loss;
  if (last_applied == 0)
    final_loss = str_cat("none (no step applied in this run",
                         skipped_in_a_row > 0 ? str_cat(": ", skipped_in_a_row, " skipped") : "",
                         ")");
  else if (last_applied != trainer.steps_done())
    final_loss = str_cat(fmt_sig(last_loss), " (step ", last_applied, ", the last applied; ",
                         last_applied + 1 == trainer.steps_done()
                             ? str_cat("step ", trainer.steps_done())
                             : str_cat("steps ", last_applied + 1, "..", trainer.steps_done()),
                         " skipped)");
  else
    final_loss = fmt_sig(last_loss);
  log_info("done: steps=", trainer.steps_done(),
           trainer.skipped_steps() > 0 ? str_cat(" skipped=", trainer.skipped_steps()) : "",
           " final_loss=", final_loss, " mean_loss_last_", recent.size(), "=",
           recent.empty() ? std::string("none") : fmt_sig(avg), vs_floor,
           last_eval ? str_cat(" eval_loss=", fmt_sig(last_eval->loss, 6)) : "", " tokens=", tokens,
           " time_s=", fmt_sig(secs, 4));
  return 0;
}

}  // namespace hp
