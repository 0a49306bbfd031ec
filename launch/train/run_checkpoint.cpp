#include "launch/train/run_checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <thread>

#include "framework/checkpoint/checkpoint.h"
#include "framework/core/crc32c.h"
#include "framework/core/log.h"
#include "launch/hf/hf_convert.h"
#include "framework/core/rng.h"
#include "launch/train/fault_injection.h"
#include "parallel/mpi_checkpoint_group.h"

namespace fs = std::filesystem;

namespace hp {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One dataset of the checkpoint: a parameter's master weights or one of its AdamW moments.
struct Item {
  std::string name;
  const Param* param;
  Tensor local;
};

std::vector<Item> checkpoint_items(ParamRegistry& params, bool params_only) {
  std::vector<Item> items;
  for (auto& p : params.all()) items.push_back({"/params/" + p->name, p.get(), p->master});
  if (params_only) return items;
  for (auto& p : params.all()) {
    items.push_back({"/optim/" + p->name + "/m", p.get(), p->m});
    items.push_back({"/optim/" + p->name + "/v", p.get(), p->v});
  }
  return items;
}

bool is_expert(const Param& p) { return p.group == ParamGroup::kExpert; }

// Leading-axis rows of the global tensor that this rank's master, m and v hold: its experts'
// rows, and with sharded optimizer state only its shard of them.
RowRange held_rows(const Param& p) {
  const int64_t base = is_expert(p) ? p.expert_begin : 0;
  return RowRange{base + p.state_row_begin(), p.state_rows()};
}

// One expert per chunk, so a chunk never straddles two ranks' shards in any layout. A dense
// tensor sharded over the world: chunks that divide the shard, so each rank writes whole chunks.
int64_t chunk_rows_of(const Param& p, DType dtype) {
  if (is_expert(p)) return 1;
  int64_t rows = checkpoint_chunk_rows(p.global_shape, dtype);
  if (p.sharded())
    while (p.shard_rows % rows != 0) --rows;
  return rows;
}

// The groups that move the run's tensors (see RunState::tensor_groups).
const ProcessGroups& tensor_groups(const RunState& run) {
  return run.tensor_groups != nullptr ? *run.tensor_groups : run.ctx.groups;
}

// The tensor group a sharded parameter's state is split over.
Communicator& shard_group(const ProcessGroups& g, const Param& p) {
  return is_expert(p) ? *g.dp : *g.world;
}

size_t row_bytes(const Param& p, DType dtype) {
  return static_cast<size_t>(p.global_numel() / p.global_shape[0]) * dtype_size(dtype);
}

std::string mib(int64_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return os.str();
}


int64_t file_size(const std::string& path) {
  std::error_code ec;
  const auto n = fs::file_size(path, ec);
  return ec ? 0 : static_cast<int64_t>(n);
}

// Rank 0's list of checkpoints to try under resume=auto, newest first, shared with every rank.
std::vector<int64_t> auto_candidates(const RankContext& ctx, const std::string& dir) {
  std::vector<int64_t> steps;
  if (ctx.rank() == 0) {
    std::string latest;
    try {
      latest = read_latest(dir);
    } catch (const UserError& e) {
      log_warn("resume=auto: ", e.what(), "; using the newest committed step_*.h5 instead");
    }
    const std::vector<int64_t> committed = committed_steps(dir);
    int64_t newest = INT64_MAX;
    if (!latest.empty()) {
      const int64_t s = checkpoint_step_of(fs::path(latest).filename().string());
      if (fs::exists(latest)) {
        steps.push_back(s);
        newest = s;
      } else {
        log_warn("resume=auto: ", dir, "/latest names ", latest,
                 ", which does not exist; using the newest committed step_*.h5 instead");
      }
    }
    for (int64_t s : committed)
      if (s < newest) steps.push_back(s);
  }
  if (ctx.world() > 1) {
    Tensor n =
        Tensor::host_from(std::vector<int64_t>{static_cast<int64_t>(steps.size())}, DType::kI64);
    ctx.groups.world->broadcast(n, 0);
    steps.resize(static_cast<size_t>(n.data<int64_t>()[0]));
    if (!steps.empty()) {
      Tensor v = Tensor::host_from(steps, DType::kI64);
      ctx.groups.world->broadcast(v, 0);
      std::copy(v.data<int64_t>(), v.data<int64_t>() + steps.size(), steps.begin());
    }
  }
  return steps;
}

std::string fmt_double(double v, int prec) {
  std::ostringstream os;
  os << std::setprecision(prec) << v;
  return os.str();
}

// Host staging for checkpoint I/O with a device backend: two buffers, page-locked where the
// backend can, each as large as the largest tensor. The device<->host copy of one tensor runs
// while the file I/O of the other does, and host memory stays at two tensors however large the
// model (holding every tensor on the host at once would need as much host memory as the whole
// checkpoint). With the CPU backend tensors already are host memory and nothing is staged.
class Staging {
 public:
  Staging(Backend& be, const std::vector<Item>& items) : Staging(be, largest_on_device(items)) {}
  // Two buffers of `bytes` each (none when 0).
  Staging(Backend& be, size_t bytes) : be_(be) {
    if (bytes == 0) return;
    for (auto& slot : slots_) {
      slot.storage = be.pinned_host_storage(bytes);
      if (!slot.storage) slot.storage = std::make_shared<Storage>(&host_allocator(), bytes);
    }
  }
  // Blocks until the copy last issued through slot `i % 2` has completed.
  void wait(size_t i) {
    Slot& s = slots_[i % 2];
    if (!s.pending) return;
    be_.event_synchronize(*s.pending, SyncCause::kOther);
    s.pending.reset();
  }
  // Slot `i % 2` as a host tensor shaped like `like`, free to use.
  Tensor acquire(size_t i, const Tensor& like) {
    wait(i);
    return Tensor(slots_[i % 2].storage, 0, like.shape(), like.dtype());
  }
  // Issues an asynchronous copy through slot `i % 2` (acquired before).
  void copy(size_t i, const Tensor& src, Tensor& dst) {
    be_.copy(src, dst);
    slots_[i % 2].pending = be_.record_event(Backend::StreamKind::kCompute);
  }
  void finish() {
    wait(0);
    wait(1);
  }
  static size_t largest_on_device(const std::vector<Item>& items) {
    size_t bytes = 0;
    for (const Item& it : items)
      if (it.local.device() != Device::kCPU) bytes = std::max(bytes, it.local.nbytes());
    return bytes;
  }

 private:
  struct Slot {
    std::shared_ptr<Storage> storage;
    std::shared_ptr<Backend::Event> pending;
  };
  Backend& be_;
  Slot slots_[2];
};

// The name of this rank's first item holding a NaN or an infinity ("" when all are finite): one
// sum of squares per tensor (inf and NaN survive it) and one read.
std::string first_nonfinite(const RunState& run, const std::vector<Item>& items) {
  Backend& be = run.backend;
  const auto n = static_cast<int64_t>(items.size());
  if (n == 0) return "";
  Tensor acc = be.zeros({n}, be.master_dtype());
  for (int64_t i = 0; i < n; ++i) {
    Tensor slot = acc.slice(i, i + 1);
    be.sum_squares(items[static_cast<size_t>(i)].local, slot);
  }
  Tensor host = Tensor::host({n}, be.master_dtype());
  be.read_to_host(acc, host, SyncCause::kOther);
  const std::vector<double> sums = to_double_vector(host);
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(sums[static_cast<size_t>(i)])) return items[static_cast<size_t>(i)].name;
  return "";
}

// A checkpoint with non-finite values is never written: every rank agrees before anything is
// created.
void require_finite(const RunState& run, const std::vector<Item>& items, int64_t step) {
  const std::string bad = first_nonfinite(run, items);
  if (!any_rank(run.ctx, !bad.empty())) return;
  HP_USER_ERROR(ErrorKind::kData, "checkpoint of step ", step, " not saved: ",
                bad.empty() ? "another rank holds non-finite values (see its message)"
                            : "tensor " + bad + " holds non-finite values",
                " (training diverged; no file was written)");
}

// Thrown by load_checkpoint when the checkpoint's model config differs from this run's in keys
// that allow_config_change does not name: not damage, so resume=auto must not fall back past it.
class ConfigMismatch : public UserError {
 public:
  explicit ConfigMismatch(const std::string& what) : UserError(ErrorKind::kConfig, what) {}
};

// The model config a checkpoint (or a Hugging Face config.json) was made for, `saved` (a
// model_config_record), against this run's: a difference in a key allow_config_change does not
// name throws ConfigMismatch; `what` names the source.
void refuse_config_changes(const TrainOptions& o, const std::string& saved,
                           const std::string& what) {
  const std::string now = model_config_record(o.model);
  const std::vector<std::string>& allowed = o.checkpoint.allow_config_change;
  std::string changes, keys;
  for (const std::string& k : model_config_differences(saved, now)) {
    if (std::find(allowed.begin(), allowed.end(), k) != allowed.end()) {
      log_warn(what, ": ", k, "=", model_config_value(saved, k), " when saved, ",
               model_config_value(now, k), " now (allowed by allow_config_change)");
      continue;
    }
    changes += str_cat(changes.empty() ? "" : ", ", k, "=", model_config_value(saved, k), " -> ",
                       model_config_value(now, k));
    keys += (keys.empty() ? "" : ",") + k;
  }
  if (!changes.empty())
    throw ConfigMismatch(
        str_cat(what, " was saved with another model config: ", changes,
                " (a change of what the model computes; if it is meant, allow it with "
                "--allow_config_change=",
                keys, ")"));
}

void check_saved_config(const TrainOptions& o, const CheckpointReader& r) {
  if (!r.has_attr("model_config")) {  // written before the record existed
    log_warn("checkpoint ", r.path(),
             " holds no model config record: its config is not compared with this run's");
    return;
  }
  refuse_config_changes(o, r.string_attr("model_config"), str_cat("checkpoint ", r.path()));
}
}  // namespace

// ---- save ---------------------------------------------------------------------------------------
//
// A save runs in three steps, so that an asynchronous save can take (a) and (c) as they are and
// run (b) in the background:
//   (a) plan_save: what the file holds and which rows of each tensor this rank writes, with the
//       run's state datasets and attributes taken at the step boundary;
//   (b) write_planned: the tensors through the host staging buffers, then the state datasets and
//       the attributes; collective under MPI, gathered to rank 0 otherwise;
//   (c) the commit around it: the temporary file (a stale one removed, created, closed with
//       flush + fsync, removed again after a failed write), then the rename, `latest` and
//       keep_last.

namespace {

// One tensor dataset of a save and this rank's part in writing it.
struct SaveTensor {
  std::string name;  // "/params/<p>", "/optim/<p>/m" or "/optim/<p>/v"
  Tensor local;      // the rows this rank holds: a master or a moment, device or host memory
  Shape global_shape;
  int64_t chunk_rows = 0;
  // The global rows this rank writes (parallel: its share, possibly none; serial: every row on
  // rank 0, none elsewhere) and, parallel, the byte offset of the first of them in `local`.
  RowRange rows;
  size_t local_offset = 0;
  // Serial only: `local` is first gathered over shard_group (a tensor group) into shard_shape
  // (sharded optimizer state), then the expert blocks over expert_group into global_shape.
  // Null: no gather.
  Communicator* shard_group = nullptr;
  Shape shard_shape;
  Communicator* expert_group = nullptr;
};

// A dataset of the run state (1-D, rank 0's values): i64, or f64 for the LR schedule.
struct SaveValues {
  std::string name;
  std::vector<int64_t> i64;
  std::vector<double> f64;
  bool is_f64 = false;
};

// An attribute of the root group: text or an integer.
struct SaveAttr {
  std::string name;
  std::string text;
  int64_t number = 0;
  bool is_text = true;
};

// (a) Everything one rank needs to write its part of the checkpoint of one step.
struct SavePlan {
  int64_t step = 0;
  int rank = 0;
  std::string dir, tmp_path, final_path;
  bool parallel = false;  // every rank writes its own rows (parallel HDF5 over MPI-IO)
  bool writes = false;    // this rank writes into the file (parallel: every rank; serial: rank 0)
  bool root = false;      // this rank supplies the state datasets (rank 0)
  DType dtype = DType::kF32;  // of every tensor dataset: the masters' and moments'
  std::vector<SaveTensor> tensors;
  std::vector<SaveValues> state;
  std::vector<SaveAttr> attrs;  // in the order they are set
};

// (a) The row plan: for every master and moment, which rows of the global tensor this rank
// writes. Parallel: a rank holding a shard (optimizer_sharding=zero1) writes it; an expert
// block is split by chunks over its dp group; a dense tensor is split by chunks over the world.
// Serial: the shards and expert blocks are gathered and rank 0 writes every row. Also the state
// datasets (rank 0 writes them) and the attributes, as of run.position.
SavePlan plan_save(const RunState& run, const std::string& dir, const std::vector<Item>& items,
                   bool parallel) {
  const RankContext& ctx = run.ctx;
  const TrainOptions& o = run.options;
  SavePlan plan;
  plan.step = run.position.step;
  plan.rank = ctx.rank();
  plan.dir = dir;
  plan.tmp_path = checkpoint_tmp_path(dir, plan.step);
  plan.final_path = checkpoint_path(dir, plan.step);
  plan.parallel = parallel;
  plan.writes = parallel || plan.rank == 0;
  plan.root = plan.rank == 0;
  plan.dtype = run.backend.master_dtype();
  const DType md = plan.dtype;

  for (const Item& it : items) {
    const Param& p = *it.param;
    SaveTensor t;
    t.name = it.name;
    t.local = it.local;
    t.global_shape = p.global_shape;
    t.chunk_rows = chunk_rows_of(p, md);
    if (parallel) {
      if (p.sharded()) {
        t.rows = held_rows(p);
      } else if (is_expert(p)) {
        t.rows = split_rows_by_chunk(p.shape[0], 1, ctx.groups.dp_size, ctx.groups.dp_rank);
        t.rows.begin += p.expert_begin;
      } else {
        t.rows = split_rows_by_chunk(p.global_shape[0], t.chunk_rows, ctx.world(), plan.rank);
      }
      t.local_offset = static_cast<size_t>(t.rows.begin - held_rows(p).begin) * row_bytes(p, md);
    } else {
      t.rows = RowRange{0, plan.writes ? p.global_shape[0] : 0};
      const ProcessGroups& g = tensor_groups(run);
      if (p.sharded()) {
        t.shard_group = &shard_group(g, p);
        t.shard_shape = p.shape;
      }
      if (is_expert(p) && g.ep_size > 1) t.expert_group = g.ep.get();
    }
    plan.tensors.push_back(std::move(t));
  }

  const int64_t step = plan.step;
  const LrSchedule& sched = run.schedule;
  const auto i64 = [](const char* name, std::vector<int64_t> v) {
    SaveValues s;
    s.name = name;
    s.i64 = std::move(v);
    return s;
  };
  plan.state.push_back(i64("/state/step", {step}));
  plan.state.push_back(i64("/state/tokens_seen", {run.position.tokens_seen}));
  plan.state.push_back(
      i64("/state/loader",
          (run.loader_state != nullptr ? *run.loader_state : run.loader.state()).to_vector()));
  plan.state.push_back(i64("/state/seed", {static_cast<int64_t>(o.run.seed)}));
  SaveValues lr;
  lr.name = "/state/lr_schedule";
  lr.is_f64 = true;
  lr.f64 = {static_cast<double>(step),
            step > 0 ? sched.at(step) : 0.0,
            sched.lr,
            sched.min_lr,
            static_cast<double>(sched.warmup_steps),
            static_cast<double>(sched.total_steps)};
  plan.state.push_back(std::move(lr));

  const auto text = [&](const char* name, std::string value) {
    SaveAttr a;
    a.name = name;
    a.text = std::move(value);
    plan.attrs.push_back(std::move(a));
  };
  const auto number = [&](const char* name, int64_t value) {
    SaveAttr a;
    a.name = name;
    a.number = value;
    a.is_text = false;
    plan.attrs.push_back(std::move(a));
  };
  text("format", kCheckpointFormat);
  number("format_version", kCheckpointVersion);
  text("hotpath_version", HOTPATH_VERSION);
  text("hdf5_version", hdf5_version_string());
  text("config", o.config_text);
  text("command_line", o.command_line);
  number("step", step);
  number("world", ctx.world());
  number("dp", ctx.groups.dp_size);
  number("ep", ctx.groups.ep_size);
  text("master_dtype", std::string(dtype_name(md)));
  number("skipped_steps", run.position.skipped_steps);
  const std::string record = model_config_record(o.model);
  text("model_config", record);
  number("config_fingerprint", static_cast<int64_t>(hash64(record)));
  // Every dataset of the file, so that a reader can tell a complete checkpoint.
  std::string manifest;
  for (const SaveTensor& t : plan.tensors) manifest += t.name + "\n";
  for (const SaveValues& s : plan.state) manifest += s.name + "\n";
  text("datasets", manifest);
  return plan;
}

// (b) The write: the planned tensors, then the state datasets and the attributes, into `w`
// (null on the ranks that write nothing; serially they still take part in the gathers). Every
// rank calls it with the same plan shape. Tensors go to the file one at a time through two host
// staging buffers: tensor i+1 is gathered (serially) and its device->host copy issued before
// tensor i is written.
void write_planned(const SavePlan& plan, Backend& be, Staging& staging, CheckpointWriter* w) {
  const std::vector<SaveTensor>& tensors = plan.tensors;
  // Serially, the whole tensor: the shards gathered over the tensor groups, where the tensor
  // lives (device tensors over NCCL, in the compute stream's order, which the staging copy
  // follows); only the rank that writes needs it on the host.
  const auto gathered = [&](const SaveTensor& t) {
    Tensor full = t.local;
    if (t.shard_group != nullptr) {
      Tensor shards = full.device() == Device::kCPU ? Tensor::host(t.shard_shape, plan.dtype)
                                                    : be.empty(t.shard_shape, plan.dtype);
      t.shard_group->all_gather(full, shards);
      full = shards;
    }
    if (t.expert_group != nullptr) {
      Tensor blocks = full.device() == Device::kCPU ? Tensor::host(t.global_shape, plan.dtype)
                                                    : be.empty(t.global_shape, plan.dtype);
      t.expert_group->all_gather(full, blocks);
      full = blocks;
    }
    return full;
  };
  const auto stage = [&](size_t i) {
    const Tensor src = plan.parallel ? tensors[i].local : gathered(tensors[i]);
    if (src.device() == Device::kCPU || w == nullptr) return src;
    Tensor h = staging.acquire(i, src);
    staging.copy(i, src, h);
    return h;
  };
  Tensor next = tensors.empty() ? Tensor() : stage(0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SaveTensor& t = tensors[i];
    const Tensor host = next;
    // Slot (i + 1) % 2 held tensor i - 1, whose write has returned.
    if (i + 1 < tensors.size()) next = stage(i + 1);
    staging.wait(i);  // tensor i has landed on the host
    if (plan.parallel) {
      w->write_rows(t.name, t.global_shape, plan.dtype, t.chunk_rows, t.rows,
                    host.data<char>() + t.local_offset);
    } else if (w != nullptr) {
      w->write_rows(t.name, t.global_shape, plan.dtype, t.chunk_rows, t.rows, host.raw());
    }
    if (i == tensors.size() / 2) {
      maybe_inject_save_fault("data", plan.rank, plan.step);
      maybe_inject_save_failure("data", plan.rank, plan.step);
    }
  }
  staging.finish();
  if (w == nullptr) return;

  for (const SaveValues& s : plan.state) {
    if (s.is_f64) {
      const auto n = static_cast<int64_t>(s.f64.size());
      w->write_rows(s.name, {n}, DType::kF64, n, RowRange{0, plan.root ? n : 0}, s.f64.data());
    } else {
      w->write_i64(s.name, s.i64, plan.root);
    }
  }
  for (const SaveAttr& a : plan.attrs) {
    if (a.is_text)
      w->set_attr(a.name, a.text);
    else
      w->set_attr(a.name, a.number);
  }
}

// (c) The commit, in the order save_checkpoint calls it.

// A .tmp left by an earlier failed or killed save of this step is never loaded: rank 0 removes
// it before it is created anew. Collective under MPI.
void remove_stale_tmp(const SavePlan& plan, Communicator& comm) {
  if (plan.rank == 0) std::remove(plan.tmp_path.c_str());
  if (plan.parallel) comm.barrier();
}

// Creates step_<N>.h5.tmp on the ranks that write (collectively over `group` under MPI); null
// on the others.
std::unique_ptr<CheckpointWriter> create_tmp(const SavePlan& plan, const CheckpointGroup* group) {
  if (!plan.writes) return nullptr;
  return std::make_unique<CheckpointWriter>(plan.tmp_path, group);
}

// Flushes, closes and fsyncs the temporary file on the ranks that write it.
void close_tmp(const SavePlan& plan, CheckpointWriter* w) {
  if (w == nullptr) return;
  w->close();
  if (!w->independent_fallbacks().empty())
    log_warn("checkpoint ", plan.tmp_path, ": ", w->independent_fallbacks().size(),
             " dataset writes fell back from collective to independent I/O, e.g. ",
             w->independent_fallbacks().front());
}

// A failed save (disk full, I/O error): the partial file goes, the committed checkpoints and
// `latest` are untouched. Throws Error(kIo) naming the step and `e`.
[[noreturn]] void discard_tmp(const SavePlan& plan, std::unique_ptr<CheckpointWriter>& w,
                              const std::exception& e) {
  if (w) w->abandon();
  w.reset();
  if (plan.rank == 0) std::remove(plan.tmp_path.c_str());
  HP_FAIL(ErrorKind::kIo, "checkpoint of step ", plan.step, " not saved: ", e.what(),
          " (the partial file was removed; the committed checkpoints and 'latest' are unchanged)");
}

// After every writer has closed and fsynced its part: barrier; rank 0 renames the .tmp to
// step_<N>.h5 (fsyncing the directory), points `latest` at it and applies keep_last; barrier.
// Collective over `comm` (the world's ranks: the training thread's world communicator, or a
// background writer's own; null: this rank alone). The stats' size is rank 0's; the time is the
// caller's to fill in.
SaveStats commit_tmp(const SavePlan& plan, Communicator* comm, int64_t keep_last) {
  if (comm != nullptr && comm->size() > 1) comm->barrier();
  SaveStats stats;
  stats.path = plan.final_path;
  if (plan.rank == 0) {
    commit_checkpoint(plan.dir, plan.step);
    maybe_inject_save_fault("rename", plan.rank, plan.step);
    update_latest(plan.dir, plan.step);
    maybe_inject_save_fault("latest", plan.rank, plan.step);
    stats.bytes = file_size(plan.final_path);
    for (const std::string& name : apply_retention(plan.dir, keep_last, plan.step))
      log_info("checkpoint: removed ", name, " (keep_last=", keep_last, ")");
  }
  if (comm != nullptr && comm->size() > 1) comm->barrier();
  return stats;
}

}  // namespace

SaveStats save_checkpoint(const RunState& run, const std::string& dir, int64_t keep_last) {
  const auto t0 = Clock::now();
  const RankContext& ctx = run.ctx;
  make_checkpoint_dir(dir);
  const std::vector<Item> items = checkpoint_items(run.model.params(), false);
  require_finite(run, items, run.position.step);
  // An MPI world writes in parallel; otherwise rank 0 writes alone what the tensor groups gather.
  const std::unique_ptr<CheckpointGroup> group = make_checkpoint_group(*ctx.groups.world);
  const SavePlan plan = plan_save(run, dir, items, group != nullptr);
  // Staging holds what this rank copies from the device: its own rows in parallel, the whole
  // gathered tensor on the serial writer.
  size_t staged = Staging::largest_on_device(items);
  if (!plan.parallel && plan.writes)
    for (const SaveTensor& t : plan.tensors)
      if (t.local.device() != Device::kCPU)
        staged = std::max(
            staged, static_cast<size_t>(shape_numel(t.global_shape)) * dtype_size(plan.dtype));
  Staging staging(run.backend, staged);

  remove_stale_tmp(plan, *ctx.groups.world);
  std::unique_ptr<CheckpointWriter> w;
  try {
    w = create_tmp(plan, group.get());
    maybe_inject_save_fault("begin", plan.rank, plan.step);
    write_planned(plan, run.backend, staging, w.get());
    close_tmp(plan, w.get());
    maybe_inject_save_failure("close", plan.rank, plan.step);
  } catch (const std::exception& e) {
    discard_tmp(plan, w, e);
  }
  maybe_inject_save_fault("close", plan.rank, plan.step);
  SaveStats stats = commit_tmp(plan, ctx.groups.world.get(), keep_last);

  stats.seconds = seconds_since(t0);
  if (plan.rank == 0)
    log_info("checkpoint: saved ", plan.final_path, " (", mib(stats.bytes), ") in ",
             fmt_double(stats.seconds, 3), " s, ",
             fmt_double(stats.bytes / (1 << 20) / std::max(stats.seconds, 1e-9), 4), " MiB/s (",
             plan.parallel ? "parallel HDF5 over MPI-IO" : "serial HDF5 from rank 0", ")");
  return stats;
}

// ---- asynchronous saves: a snapshot now, the write later ----------------------------------

void SnapshotArena::reserve(Backend& be, size_t bytes) {
  if (storage_ && bytes_ >= bytes) return;
  storage_.reset();
  storage_ = be.pinned_host_storage(std::max<size_t>(bytes, 1));
  pinned_ = storage_ != nullptr && be.device() != Device::kCPU;
  if (!storage_)
    storage_ = std::make_shared<Storage>(&host_allocator(), std::max<size_t>(bytes, 1));
  bytes_ = bytes;
}

// A piece of one snapshot tensor (at most kPieceBytes): the unit of the snapshot's copies and
// checksums, which run on all cores (a large model's snapshot is tens of GB).
struct SnapshotPiece {
  size_t tensor = 0;  // index into SavePlan::tensors
  size_t offset = 0;  // bytes into the tensor
  size_t bytes = 0;
};

struct PreparedSave {
  SavePlan plan;
  std::vector<SnapshotPiece> pieces;
  std::vector<uint32_t> crc;  // CRC-32C of each piece, taken at the snapshot
  int64_t bytes = 0;          // snapshot bytes of this rank
};

namespace {

constexpr size_t kSnapshotAlign = 64;

size_t align_up(size_t n) { return (n + kSnapshotAlign - 1) / kSnapshotAlign * kSnapshotAlign; }

// The rows of `t` this rank writes, as a view of its local tensor.
Tensor written_rows(const SaveTensor& t, const Param& p, DType dtype) {
  if (t.rows.count == 0) return t.local.slice(0, 0);
  const auto first = static_cast<int64_t>(t.local_offset / row_bytes(p, dtype));
  return t.local.slice(first, first + t.rows.count);
}

constexpr size_t kPieceBytes = size_t{64} << 20;

std::vector<SnapshotPiece> snapshot_pieces(const std::vector<SaveTensor>& tensors) {
  std::vector<SnapshotPiece> pieces;
  for (size_t i = 0; i < tensors.size(); ++i)
    for (size_t at = 0, n = tensors[i].local.nbytes(); at < n; at += kPieceBytes)
      pieces.push_back({i, at, std::min(kPieceBytes, n - at)});
  return pieces;
}

// fn(k) for every k in [0, n), on up to one thread per core (fn must not throw).
void for_each_parallel(size_t n, const std::function<void(size_t)>& fn) {
  const size_t threads = std::min<size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<size_t> next{0};
  const auto work = [&] {
    for (size_t k = next++; k < n; k = next++) fn(k);
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

std::vector<uint32_t> piece_crcs(const std::vector<SaveTensor>& tensors,
                                 const std::vector<SnapshotPiece>& pieces) {
  std::vector<uint32_t> crc(pieces.size());
  for_each_parallel(pieces.size(), [&](size_t k) {
    const SnapshotPiece& p = pieces[k];
    crc[k] = crc32c(tensors[p.tensor].local.data<char>() + p.offset, p.bytes);
  });
  return crc;
}

// Whether `flag` holds on any rank of `comm` (a rank alone: its own flag).
bool any_of(Communicator* comm, bool flag) {
  if (comm == nullptr || comm->size() <= 1) return flag;
  Tensor f = Tensor::host_from(std::vector<int32_t>{flag ? 1 : 0}, DType::kI32);
  comm->all_reduce(f, ReduceOp::kMax);
  return f.data<int32_t>()[0] != 0;
}

}  // namespace

int64_t snapshot_bytes(const RunState& run, bool parallel) {
  const std::vector<Item> items = checkpoint_items(run.model.params(), false);
  const SavePlan plan = plan_save(run, ".", items, parallel);
  size_t bytes = 0;
  for (size_t i = 0; i < plan.tensors.size(); ++i)
    bytes += align_up(static_cast<size_t>(plan.tensors[i].rows.count) *
                      row_bytes(*items[i].param, plan.dtype));
  return static_cast<int64_t>(bytes);
}

std::shared_ptr<PreparedSave> prepare_save(const RunState& run, const std::string& dir,
                                           SnapshotArena& arena, bool parallel) {
  const RankContext& ctx = run.ctx;
  HP_CHECK(parallel || ctx.world() == 1,
           "a snapshot save without MPI needs world 1 (the gathers run on the training thread)");
  make_checkpoint_dir(dir);
  const std::vector<Item> items = checkpoint_items(run.model.params(), false);
  require_finite(run, items, run.position.step);
  auto save = std::make_shared<PreparedSave>();
  save->plan = plan_save(run, dir, items, parallel);
  SavePlan& plan = save->plan;
  Backend& be = run.backend;
  // Every tensor this rank writes goes into the arena, one aligned slot after the other; device
  // tensors by asynchronous copies in the compute stream's order (after the step's update), then
  // one wait for all of them.
  size_t total = 0;
  for (size_t i = 0; i < plan.tensors.size(); ++i)
    total += align_up(static_cast<size_t>(plan.tensors[i].rows.count) *
                      row_bytes(*items[i].param, plan.dtype));
  arena.reserve(be, total);
  size_t at = 0;
  bool on_device = false;
  std::vector<const char*> host_src(plan.tensors.size(), nullptr);  // host tensors: copied below
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    SaveTensor& t = plan.tensors[i];
    const Tensor src = written_rows(t, *items[i].param, plan.dtype);
    Tensor dst(arena.storage(), static_cast<int64_t>(at / dtype_size(plan.dtype)), src.shape(),
               plan.dtype);
    if (src.numel() > 0) {
      if (src.device() == Device::kCPU) {
        host_src[i] = src.data<char>();
      } else {
        be.copy(src, dst);
        on_device = true;
      }
    }
    at += align_up(src.nbytes());
    t.local = dst;
    t.local_offset = 0;
  }
  save->pieces = snapshot_pieces(plan.tensors);
  for_each_parallel(save->pieces.size(), [&](size_t k) {
    const SnapshotPiece& p = save->pieces[k];
    if (host_src[p.tensor] != nullptr)
      std::memcpy(plan.tensors[p.tensor].local.data<char>() + p.offset,
                  host_src[p.tensor] + p.offset, p.bytes);
  });
  if (on_device) be.synchronize(SyncCause::kOther);
  save->bytes = static_cast<int64_t>(at);
  save->crc = piece_crcs(plan.tensors, save->pieces);
  if (maybe_inject_save_failure("snapshot", plan.rank, plan.step)) {
    for (const SaveTensor& t : plan.tensors)
      if (t.local.numel() > 0) {
        t.local.data<unsigned char>()[0] ^= 0x40;  // one flipped bit, as a damaged buffer
        break;
      }
  }
  maybe_inject_save_fault("snapshot", plan.rank, plan.step);
  return save;
}

int64_t prepared_step(const PreparedSave& save) { return save.plan.step; }
int64_t prepared_bytes(const PreparedSave& save) { return save.bytes; }

SaveStats write_prepared(PreparedSave& save, Backend& be, Communicator* comm, int64_t keep_last) {
  const auto t0 = Clock::now();
  const SavePlan& plan = save.plan;
  HP_CHECK(comm != nullptr || !plan.parallel, "a parallel save needs the writer's communicator");
  // The snapshot must still be what was taken: a damaged host buffer is never written.
  std::string error;
  const std::vector<uint32_t> crc = piece_crcs(plan.tensors, save.pieces);
  for (size_t k = 0; k < crc.size() && error.empty(); ++k) {
    if (crc[k] == save.crc[k]) continue;
    const SnapshotPiece& p = save.pieces[k];
    error = str_cat("the host snapshot of ", plan.tensors[p.tensor].name, " (bytes ", p.offset,
                    "..", p.offset + p.bytes - 1, ") changed after it was taken (CRC-32C ",
                    crc[k], ", taken as ", save.crc[k], "): damaged memory");
  }
  if (any_of(comm, !error.empty())) {
    if (plan.rank == 0) std::remove(plan.tmp_path.c_str());
    HP_FAIL(ErrorKind::kIo, "checkpoint of step ", plan.step, " not saved: ",
            error.empty() ? std::string("another rank's snapshot is damaged (see its message)")
                          : error,
            " (nothing was written; the committed checkpoints and 'latest' are unchanged)");
  }
  const std::unique_ptr<CheckpointGroup> group =
      plan.parallel ? make_checkpoint_group(*comm) : nullptr;
  HP_CHECK(!plan.parallel || group != nullptr, "the writer's communicator is not MPI");
  Staging staging(be, 0);  // the snapshot is host memory: nothing to stage
  if (plan.rank == 0) std::remove(plan.tmp_path.c_str());
  if (plan.parallel) comm->barrier();
  std::unique_ptr<CheckpointWriter> w;
  try {
    w = create_tmp(plan, group.get());
    maybe_inject_save_fault("begin", plan.rank, plan.step);
    write_planned(plan, be, staging, w.get());
    close_tmp(plan, w.get());
    maybe_inject_save_failure("close", plan.rank, plan.step);
  } catch (const std::exception& e) {
    error = e.what();
    if (w) w->abandon();
    w.reset();
  }
  maybe_inject_save_fault("close", plan.rank, plan.step);
  // Every rank's part is written before anything is committed; a failure anywhere removes the
  // partial file everywhere.
  if (any_of(comm, !error.empty())) {
    if (plan.rank == 0) std::remove(plan.tmp_path.c_str());
    HP_FAIL(ErrorKind::kIo, "checkpoint of step ", plan.step, " not saved: ",
            error.empty() ? std::string("the write failed on another rank (see its message)")
                          : error,
            " (the partial file was removed; the committed checkpoints and 'latest' are "
            "unchanged)");
  }
  SaveStats stats = commit_tmp(plan, comm, keep_last);
  stats.seconds = seconds_since(t0);
  return stats;
}

// ---- load ---------------------------------------------------------------------------------------

RunPosition load_checkpoint(const RunState& run, const std::string& path, bool params_only) {
  const auto t0 = Clock::now();
  Backend& be = run.backend;
  CheckpointReader r(path);
  check_saved_config(run.options, r);
  std::vector<Item> items = checkpoint_items(run.model.params(), params_only);
  for (const Item& it : items) {
    const DatasetInfo d = r.info(it.name);
    if (d.shape != it.param->global_shape)
      HP_USER_ERROR(ErrorKind::kData, "checkpoint ", path, " dataset '", it.name, "' has shape ",
                    shape_str(d.shape), " but this model's parameter is ",
                    shape_str(it.param->global_shape),
                    " (the checkpoint belongs to another model config)");
  }
  // Tensors come from the file one at a time through two host staging buffers: tensor i+1 is
  // read while tensor i's host->device copy runs.
  Staging staging(be, items);
  int64_t bytes = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    Item& it = items[i];
    const RowRange rows = held_rows(*it.param);
    if (it.local.device() == Device::kCPU) {
      r.read_rows(it.name, rows, it.local.dtype(), it.local.raw());
    } else {
      Tensor host = staging.acquire(i, it.local);
      r.read_rows(it.name, rows, it.local.dtype(), host.raw());
      staging.copy(i, host, it.local);
    }
    bytes += static_cast<int64_t>(it.local.nbytes());
  }
  staging.finish();
  run.model.refresh_working_copies();
  if (run.params_loaded) run.params_loaded();
  if (params_only) return RunPosition{};

  const auto one = [&](const char* name) {
    const std::vector<int64_t> v = r.read_i64(name);
    if (v.size() != 1)
      HP_USER_ERROR(ErrorKind::kData, "checkpoint ", path, " dataset '", name, "' holds ", v.size(),
                    " values, expected 1");
    return v[0];
  };
  const int64_t step = one("/state/step");
  const int64_t tokens = one("/state/tokens_seen");
  const int64_t seed = one("/state/seed");
  const LoaderState loader = LoaderState::from_vector(r.read_i64("/state/loader"));
  if (static_cast<uint64_t>(seed) != run.options.run.seed)
    log_warn("checkpoint ", path, " was saved with seed=", static_cast<uint64_t>(seed),
             "; this run has seed=", run.options.run.seed);
  double lr[6] = {};
  if (r.info("/state/lr_schedule").shape == Shape{6})
    r.read_rows("/state/lr_schedule", RowRange{0, 6}, DType::kF64, lr);
  const auto saved_total = static_cast<int64_t>(lr[5]);
  if (saved_total != run.schedule.total_steps)
    log_warn("checkpoint ", path, " was saved with an LR schedule over ", saved_total,
             " steps; this run's spans ", run.schedule.total_steps,
             " (the learning rate continues on this run's schedule)");
  run.loader.restore(loader);
  const double secs = seconds_since(t0);
  log_info("checkpoint: loaded ", path, " at step ", step, " (saved by world=", r.int_attr("world"),
           " dp=", r.int_attr("dp"), " ep=", r.int_attr("ep"), "; this rank read ", mib(bytes),
           " in ", fmt_double(secs, 3), " s, ",
           fmt_double(bytes / double(1 << 20) / std::max(secs, 1e-9), 4), " MiB/s)");
  const int64_t skipped = r.has_attr("skipped_steps") ? r.int_attr("skipped_steps") : 0;
  return RunPosition{step, tokens, skipped};
}

bool load_checkpoint_agreed(const RunState& run, const std::string& path, bool params_only,
                            RunPosition* loaded, std::string* error) {
  bool failed = false, mismatch = false;
  try {
    *loaded = load_checkpoint(run, path, params_only);
  } catch (const ConfigMismatch& e) {
    mismatch = true;
    *error = e.what();
  } catch (const std::exception& e) {
    failed = true;
    *error = e.what();
    log_error("cannot load checkpoint ", path, ": ", e.what());
  }
  // A changed config is the user's decision, not damage: every rank stops here (the ranks read
  // the same attributes, so they agree), and resume=auto does not fall back past it.
  if (any_rank(run.ctx, mismatch))
    HP_USER_ERROR(ErrorKind::kConfig,
                  mismatch ? *error : "the checkpoint's model config differs (see rank 0)");
  return !any_rank(run.ctx, failed);
}

namespace {
// An imported Hugging Face checkpoint's parameters into the model (this rank's rows). The
// meaning of its config.json, mapped to a hotpath model config, must be the run's (the rule of
// resume: allow_config_change names the exceptions); the shapes then agree too.
void load_hf_params(const RunState& run, const std::string& dir) {
  {
    const HfImport cfg = read_hf_config(dir);
    refuse_config_changes(run.options, model_config_record(cfg.model),
                          str_cat("the Hugging Face checkpoint ", dir, " (", cfg.architecture,
                                  ", config.json)"));
  }
  const HfImport imp = read_hf_checkpoint(dir);
  Backend& be = run.backend;
  std::vector<Tensor> staged;
  for (auto& p : run.model.params().all()) {
    const NamedTensor* t = nullptr;
    for (const NamedTensor& x : imp.params)
      if (x.name == p->name) t = &x;
    if (t == nullptr || t->shape != p->global_shape)
      HP_USER_ERROR(ErrorKind::kConfig, "config key 'init_from': ", dir, " (", imp.architecture,
                    ") ", t == nullptr ? "has no tensor for parameter " : "has another shape for ",
                    p->name, " ", t ? shape_str(t->shape) : std::string(), " than this model's ",
                    shape_str(p->global_shape), " (import it and train with its config file)");
    const RowRange rows = held_rows(*p);
    const int64_t row = p->global_numel() / p->global_shape[0];
    Tensor host = Tensor::host(p->shape, p->master.dtype());
    const float* src = t->data.data() + rows.begin * row;
    for (int64_t i = 0; i < p->numel(); ++i) {
      if (host.dtype() == DType::kF64)
        host.data<double>()[i] = src[i];
      else
        host.data<float>()[i] = src[i];
    }
    be.copy(host, p->master);
    staged.push_back(host);
  }
  be.synchronize(SyncCause::kOther);
  run.model.refresh_working_copies();
}

// init_from's weights must be finite: a NaN or infinity in them is the file's fault, named as
// such (the first step would otherwise report a diverged run). One sum of squares per parameter;
// every rank agrees.
void refuse_nonfinite_params(const RunState& run, const std::string& path) {
  const std::string bad = first_nonfinite(run, checkpoint_items(run.model.params(), true));
  if (!any_rank(run.ctx, !bad.empty())) return;
  HP_USER_ERROR(ErrorKind::kData, "init_from: checkpoint ", path, " ",
                bad.empty() ? std::string("holds non-finite weights (see the other rank's message)")
                            : str_cat("dataset '", bad, "' holds non-finite values (NaN or inf)"),
                "; its weights cannot start a run (it was saved damaged, or converted from such "
                "weights)");
}

// Where an imported checkpoint's weights came from ("" for a checkpoint a run saved). Files
// import-hf wrote before it recorded `imported_from` are told by what they lack: no model
// config record, no dataset manifest, no command line.
std::string imported_source(const std::string& path) {
  try {
    CheckpointReader r(path);
    if (r.has_attr("imported_from")) {
      const std::string from = r.string_attr("imported_from");
      return from.empty() ? std::string("a Hugging Face checkpoint") : from;
    }
    if (!r.has_attr("model_config") && !r.has_attr("datasets") && r.has_attr("command_line") &&
        r.string_attr("command_line").empty())
      return "a Hugging Face checkpoint";
  } catch (const std::exception&) {
    // Unreadable: the load reports it.
  }
  return std::string();
}
}  // namespace

bool init_from_options(const RunState& run) {
  const std::string& from = run.options.checkpoint.init_from;
  if (from.empty()) return false;
  std::error_code ec;
  if (!fs::exists(from, ec))
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'init_from': '", from, "' does not exist");
  if (fs::is_directory(from, ec) && fs::exists(fs::path(from) / "config.json", ec)) {
    bool failed = false;
    std::string error;
    try {
      load_hf_params(run, from);
    } catch (const std::exception& e) {
      failed = true;
      error = e.what();
    }
    if (any_rank(run.ctx, failed))
      HP_USER_ERROR(ErrorKind::kConfig, "init_from: ",
                    error.empty() ? "it failed on another rank (see its message)" : error);
    log_info("init_from: parameters from the Hugging Face checkpoint ", from);
    return true;
  }
  const std::string path = resolve_checkpoint_arg(from);
  std::string error;
  RunPosition pos;
  if (!load_checkpoint_agreed(run, path, true, &pos, &error))
    HP_USER_ERROR(ErrorKind::kData, "init_from: checkpoint ", path, " cannot be loaded: ",
                  error.empty() ? "it failed on another rank (see its message)" : error);
  refuse_nonfinite_params(run, path);
  log_info("init_from: parameters from ", path, " (fresh optimizer state, step 0)");
  return true;
}

std::string resolve_checkpoint_arg(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return path;
  std::string latest = read_latest(path);
  if (!latest.empty() && fs::exists(latest, ec)) return latest;
  const std::vector<int64_t> steps = committed_steps(path);
  if (steps.empty()) {
    // A Hugging Face directory is not a checkpoint directory: say which it is.
    const fs::path d(path);
    bool safetensors = fs::exists(d / "model.safetensors.index.json", ec);
    for (const auto& e : fs::directory_iterator(d, ec))
      safetensors = safetensors || e.path().extension() == ".safetensors";
    if (fs::exists(d / "config.json", ec))
      HP_USER_ERROR(ErrorKind::kUser, path,
                    " is a Hugging Face checkpoint directory (config.json), not a hotpath "
                    "checkpoint; import it with `hotpath import-hf`, or start a run from it with "
                    "init_from");
    if (safetensors)
      HP_USER_ERROR(ErrorKind::kUser, path,
                    " holds safetensors but no config.json: a Hugging Face checkpoint directory "
                    "needs the config.json that describes its model (and a hotpath checkpoint "
                    "directory holds step_<N>.h5 files)");
    HP_USER_ERROR(ErrorKind::kUser, "no committed checkpoint (step_<N>.h5) in directory ", path);
  }
  return checkpoint_path(path, steps.front());
}

namespace {
// A run that starts at `start` in a checkpoint_dir holding newer committed checkpoints would
// overwrite them (and move `latest` back) as it goes: refused unless allow_overwrite.
void refuse_overwriting_newer(const TrainOptions& o, int64_t start, const std::string& from) {
  if (o.checkpoint.dir.empty() || o.checkpoint.allow_overwrite) return;
  const std::vector<int64_t> steps = committed_steps(o.checkpoint.dir);
  if (steps.empty() || steps.front() <= start) return;
  HP_USER_ERROR(ErrorKind::kConfig, "checkpoint_dir ", o.checkpoint.dir,
                " holds committed checkpoints up to step ", steps.front(), ", newer than ", from,
                " (step ", start,
                "); this run would overwrite them. Resume from the newest with --resume=auto, use "
                "another checkpoint_dir, or allow it with --allow_overwrite=true");
}
}  // namespace

RunPosition resume_from_options(const RunState& run) {
  const TrainOptions& o = run.options;
  const ResumeSpec& resume = o.checkpoint.resume;
  if (resume.kind == ResumeSpec::Kind::kNone) {
    refuse_overwriting_newer(o, 0, "this fresh start (resume=none)");
    return RunPosition{};
  }
  std::string error;
  RunPosition pos;
  if (resume.kind == ResumeSpec::Kind::kPath) {
    std::error_code ec;
    if (!fs::exists(resume.path, ec))
      HP_USER_ERROR(ErrorKind::kConfig, "config key 'resume': checkpoint '", resume.path,
                    "' does not exist (use resume=auto to start fresh when there is none)");
    const std::string path = resolve_checkpoint_arg(resume.path);
    const std::string imported = imported_source(path);
    if (!imported.empty())
      HP_USER_ERROR(ErrorKind::kConfig, "config key 'resume': ", path,
                    " is an imported checkpoint (import-hf, from ", imported,
                    "); it holds weights but no training state (data position, seed, schedule). "
                    "Use init_from=",
                    path, " to start a run from it");
    if (!load_checkpoint_agreed(run, path, false, &pos, &error))
      HP_USER_ERROR(ErrorKind::kData, "resume: checkpoint ", path, " cannot be loaded: ",
                    error.empty() ? "it failed on another rank (see its message)" : error);
    refuse_overwriting_newer(o, pos.step, "the checkpoint resumed from, " + path);
    log_info("resumed from ", path, " at step ", pos.step);
    return pos;
  }
  const std::vector<int64_t> steps = auto_candidates(run.ctx, o.checkpoint.dir);
  if (steps.empty()) {
    log_info("resume=auto: no committed checkpoint in ", o.checkpoint.dir,
             "; starting from step 0");
    return RunPosition{};
  }
  std::vector<std::string> tried;
  for (int64_t s : steps) {
    const std::string path = checkpoint_path(o.checkpoint.dir, s);
    if (load_checkpoint_agreed(run, path, false, &pos, &error)) {
      log_info("resume=auto: resumed from ", path, " at step ", pos.step);
      return pos;
    }
    tried.push_back(path);
    log_warn("resume=auto: ", path,
             " is damaged or unreadable; falling back to the previous committed checkpoint");
  }
  std::string list;
  for (const std::string& p : tried) list += (list.empty() ? "" : ", ") + p;
  HP_USER_ERROR(ErrorKind::kData, "resume=auto: no checkpoint in ", o.checkpoint.dir,
                " could be loaded (tried ", list, "); see the errors above");
}

}  // namespace hp
