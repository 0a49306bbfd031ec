#include "launch/train/async_checkpoint.h"

#include <chrono>
#include <cstdint>
#include <fstream>
#include <sstream>

#include "framework/core/log.h"
#include "launch/train/fault_injection.h"
#include "parallel/mpi_checkpoint_group.h"

namespace hp {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

std::atomic<bool> g_background_failed{false};

std::string mib_text(int64_t bytes) { return fmt_sig(static_cast<double>(bytes) / (1 << 20), 4); }

}  // namespace

bool background_save_failed() { return g_background_failed.load(); }

int64_t host_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream is(line.substr(13));
    int64_t kib = -1;
    is >> kib;
    return kib < 0 ? -1 : kib * 1024;
  }
  return -1;
}

CheckpointSaver::CheckpointSaver(const TrainOptions& o, const RunState& run)
    : o_(o), be_(run.backend), rank_(run.ctx.rank()) {
  const RankContext& ctx = run.ctx;
  g_background_failed = false;  // a new run (tests run several in one process)
  if (o.checkpoint.dir.empty()) return;
  std::string why_not;
  if (!o.checkpoint.async) {
    why_not = "checkpoint_async=false";
  } else {
    std::string mpi_why;
    writer_comm_ = make_writer_communicator(*ctx.groups.world, &mpi_why);
    parallel_ = writer_comm_ != nullptr;
    if (!parallel_ && ctx.world() > 1) {
      why_not = str_cat(mpi_why,
                        "; without a writer communicator of its own a save of several ranks "
                        "gathers the shards over the tensor groups, on the training thread");
    } else {
      // The snapshots of a host's ranks must fit in its available memory (every rank counts its
      // own as many times as its host has ranks); the ranks agree on the least room left (and
      // the least available memory, which rank 0's line gives), so they all decide alike.
      snapshot_bytes_ = hp::snapshot_bytes(run, parallel_);
      const int local = std::max(1, ctx.launch.local_world);
      const int64_t own = host_memory_fault_injected(ctx.rank()) ? 0 : host_available_bytes();
      Tensor least = Tensor::host_from(
          std::vector<int64_t>{own < 0 ? INT64_MAX : own,
                               own < 0 ? INT64_MAX : own - snapshot_bytes_ * local},
          DType::kI64);
      if (ctx.world() > 1) ctx.groups.world->all_reduce(least, ReduceOp::kMin);
      const int64_t avail = least.data<int64_t>()[0], room = least.data<int64_t>()[1];
      if (room < 0)
        why_not = str_cat(
            "the host snapshot (", mib_text(snapshot_bytes_), " MiB per rank, ", local,
            " rank(s) on this host) does not fit in the available host memory (MemAvailable ",
            mib_text(avail), " MiB", ctx.world() > 1 ? ", the least of the ranks' hosts" : "", ")");
    }
  }
  if (!why_not.empty()) {
    writer_comm_.reset();
    parallel_ = false;
    if (ctx.rank() == 0 && o.checkpoint.async)
      log_info("checkpoint: synchronous saves (", why_not, ")");
    return;
  }
  async_ = true;
  arena_.reserve(be_, static_cast<size_t>(snapshot_bytes_));
  if (ctx.rank() == 0)
    log_info("checkpoint: background saves (checkpoint_async=true): a snapshot of ",
             mib_text(snapshot_bytes_), " MiB of ", arena_.pinned() ? "page-locked " : "",
             "host memory on rank 0, written by a writer thread",
             parallel_ ? " over its own MPI communicator (MPI_THREAD_MULTIPLE)" : "");
}

CheckpointSaver::~CheckpointSaver() {
  if (writer_.joinable()) writer_.join();
}

void CheckpointSaver::wait(double* waited_ms) {
  const auto t0 = Clock::now();
  if (writer_.joinable()) writer_.join();
  if (waited_ms != nullptr) *waited_ms = ms_since(t0);
  std::lock_guard<std::mutex> lock(mu_);
  if (writer_committed_ > committed_step_) committed_step_ = writer_committed_;
}

void CheckpointSaver::stop_for_failure() {
  if (writer_.joinable()) writer_.join();
  std::string error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    error = error_;
  }
  if (error.empty())
    error = "a background checkpoint write failed on another rank (see its message)";
  log_error("stopping: ", error);
  HP_FAIL(ErrorKind::kIo, "stopping the run: ", error,
          " (the previous checkpoint stays 'latest'; resume with --resume=auto)");
}

void CheckpointSaver::check_failure(const RankContext& ctx) {
  if (any_rank(ctx, background_save_failed())) stop_for_failure();
}

void CheckpointSaver::report(CheckpointReport r) {
  std::lock_guard<std::mutex> lock(mu_);
  reports_.push_back(r);
}

std::vector<CheckpointReport> CheckpointSaver::take_reports() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<CheckpointReport> out;
  out.swap(reports_);
  return out;
}

void CheckpointSaver::save(const RunState& run) {
  const auto t0 = Clock::now();
  CheckpointReport r;
  r.step = run.position.step;
  wait(&r.wait_ms);
  if (async_) check_failure(run.ctx);
  if (!async_) {
    save_synchronously(run, t0, r);
    return;
  }
  std::shared_ptr<PreparedSave> prepared = prepare_save(run, o_.checkpoint.dir, arena_, parallel_);
  r.async = true;
  r.stall_ms = ms_since(t0);
  const int64_t keep_last = o_.checkpoint.keep_last;
  Communicator* comm = writer_comm_.get();
  writer_ = std::thread([this, prepared, r, keep_last, comm]() mutable {
    try {
      maybe_delay_background_save(rank_, r.step);
      const SaveStats st = write_prepared(*prepared, be_, comm, keep_last);
      r.write_ms = st.seconds * 1e3;
      r.bytes = st.bytes;
      r.committed_after_step = steps_done_.load();
      if (rank_ == 0)
        log_info("checkpoint: saved ", st.path, " (", mib_text(st.bytes),
                 " MiB) in the background: write ", fmt_sig(r.write_ms, 4), " ms, stall ",
                 fmt_sig(r.stall_ms, 4), " ms (", fmt_sig(r.wait_ms, 4),
                 " ms of it waiting for the previous save), committed after step ",
                 r.committed_after_step);
      std::lock_guard<std::mutex> lock(mu_);
      writer_committed_ = r.step;
      reports_.push_back(r);
    } catch (const std::exception& e) {
      log_error("checkpoint: background write of step ", r.step, " failed: ", e.what());
      std::lock_guard<std::mutex> lock(mu_);
      error_ = e.what();
      g_background_failed = true;
    }
  });
}

void CheckpointSaver::save_now(const RunState& run) {
  const auto t0 = Clock::now();
  CheckpointReport r;
  r.step = run.position.step;
  const bool in_flight = writer_.joinable();
  wait(&r.wait_ms);
  if (in_flight && rank_ == 0)
    log_info("checkpoint: waited ", fmt_sig(r.wait_ms, 4), " ms for the background save in flight");
  if (async_) check_failure(run.ctx);
  if (committed_step_ == r.step) return;
  save_synchronously(run, t0, r);
}

void CheckpointSaver::save_synchronously(const RunState& run, Clock::time_point t0,
                                         CheckpointReport r) {
  const SaveStats st = save_checkpoint(run, o_.checkpoint.dir, o_.checkpoint.keep_last);
  committed_step_ = r.step;
  r.stall_ms = r.write_ms = ms_since(t0);
  r.bytes = st.bytes;
  r.committed_after_step = r.step;
  report(r);
}

}  // namespace hp
