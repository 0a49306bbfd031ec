#include "parallel/cuda/nccl_communicator.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <numeric>
#include <sstream>

#include "framework/backend/cuda/cuda_backend.h"
#include "framework/backend/cuda/cuda_check.h"
#include "framework/core/log.h"
#include "parallel/launch_env.h"

namespace hp {

using Clock = std::chrono::steady_clock;

std::string nccl_last_error(ncclComm_t comm) {
  const char* s = ncclGetLastError(comm);
  return s && *s ? std::string(s) : std::string("no detail");
}

namespace {

// An NCCL call on a communicator of this class: ncclInProgress is waited out, errors throw.
#define HP_NCCL_ENQUEUE(op, stmt) after_call((stmt), op, #stmt)

std::string seconds_str(std::chrono::milliseconds ms) {
  std::ostringstream os;
  os << std::setprecision(3) << static_cast<double>(ms.count()) / 1000.0 << " s";
  return os.str();
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kF64:
      return ncclFloat64;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
  }
  HP_FAIL(ErrorKind::kInternal, "no NCCL type for dtype ", dtype_name(t));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  HP_FAIL(ErrorKind::kInternal, "no NCCL reduction for op ", reduce_op_name(op));
}

ncclConfig_t nonblocking_config(const std::string& name) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = name.c_str();
  return config;
}

void check_device_tensor(const Tensor& t, const char* op, const char* what) {
  HP_CHECK(t.defined() && t.device() == Device::kCUDA, op, ": ", what,
           " must be a CUDA tensor, got ", t.defined() ? t.desc() : std::string("undefined"));
}

char* bytes_of(const Tensor& t) { return static_cast<char*>(t.raw()); }

// NCCL reads NCCL_LAUNCH_ORDER_IMPLICIT when it first prepares a launch and keeps the value, so
// the decision is made before the process's first communicator exists (create() asks first).
// An explicit setting in the environment wins; without one it is turned on.
bool decide_launch_order_implicit() {
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess || version < NCCL_VERSION(2, 26, 0)) return false;
  const char* v = std::getenv("NCCL_LAUNCH_ORDER_IMPLICIT");
  if (v && *v) return std::atoi(v) != 0;
  return ::setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1", /*overwrite=*/0) == 0;
}

}  // namespace

bool nccl_launch_order_implicit() {
  static const bool on = decide_launch_order_implicit();
  return on;
}

NcclCommunicator::NcclCommunicator(std::string name, int rank, int size,
                                   std::vector<int> world_ranks, CommOptions options, int device,
                                   CUstream_st* stream, Backend* be)
    : Communicator(std::move(name), rank, size, std::move(world_ranks), options),
      device_(device),
      stream_(stream),
      be_(be) {}

std::shared_ptr<NcclCommunicator> NcclCommunicator::create(Communicator& host, Backend& be,
                                                           const std::string& name,
                                                           Backend::StreamKind stream) {
  HP_CHECK(stream == Backend::StreamKind::kCompute || stream == Backend::StreamKind::kComm,
           "NCCL communicator '", name.empty() ? host.name() : name,
           "': only the compute or the comm stream can carry collectives");
  auto c = create(
      host, cuda_backend_device(be),
      stream == Backend::StreamKind::kComm ? cuda_comm_stream(be) : cuda_compute_stream(be), name);
  c->be_ = &be;
  return c;
}

void share_nccl_unique_id(Communicator& host, ncclUniqueId* id) {
  // Rank 0 makes it; share_blob hands it out over the host communicator.
  std::memset(id, 0, sizeof(*id));
  std::vector<uint8_t> blob;
  if (host.rank() == 0) {
    NCCL_CHECK(ncclGetUniqueId(id));
    const auto* p = reinterpret_cast<const uint8_t*>(id);
    blob.assign(p, p + sizeof(*id));
  }
  blob = share_blob(host, blob, 0);
  HP_CHECK(blob.size() == sizeof(*id), "NCCL unique id of ", blob.size(), " bytes from rank 0 of '",
           host.name(), "'");
  std::memcpy(id, blob.data(), sizeof(*id));
}

std::shared_ptr<NcclCommunicator> NcclCommunicator::create(Communicator& host, int device,
                                                           CUstream_st* stream,
                                                           const std::string& name) {
  // Before any NCCL communicator of the process exists (see decide_launch_order_implicit).
  (void)nccl_launch_order_implicit();
  CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id;
  share_nccl_unique_id(host, &id);
  std::shared_ptr<NcclCommunicator> c(
      new NcclCommunicator(name.empty() ? host.name() : name, host.rank(), host.size(),
                           host.world_ranks(), host.options(), device, stream, nullptr));
  c->init_from_id(id);
  return c;
}

void NcclCommunicator::init_from_id(const ncclUniqueId& id) {
  const auto deadline = Clock::now() + timeout();
  ncclConfig_t config = nonblocking_config(name());
  ncclComm_t comm = nullptr;
  NCCL_CHECK(ncclCommInitRankConfig(&comm, size(), id, rank(), &config));
  try {
    settle(comm, "creating the NCCL communicator", where("init"), deadline);
  } catch (...) {
    ncclCommAbort(comm);  // already failing: its own result adds nothing
    throw;
  }
  comm_ = comm;
  CUDA_CHECK(cudaMallocAsync(&barrier_buf_, sizeof(int32_t), stream_));
  CUDA_CHECK(cudaMemsetAsync(barrier_buf_, 0, sizeof(int32_t), stream_));
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

void NcclCommunicator::settle(ncclComm_t comm, const char* what, const std::string& where,
                              Clock::time_point deadline) {
  // A non-blocking communicator finishes an enqueue in tens of microseconds: poll with yields
  // for the first 2 ms, which costs this (otherwise waiting) thread nothing it needs, and sleep
  // between polls only after that. Sleeping from the start added about 0.1 ms to every call
  // (the sleep's granularity), on the critical path of each MoE layer's exchange.
  const Clock::time_point spin_until = Clock::now() + std::chrono::milliseconds(2);
  for (;;) {
    ncclResult_t state = ncclSuccess;
    NCCL_CHECK(ncclCommGetAsyncError(comm, &state));
    if (state == ncclSuccess) return;
    if (state != ncclInProgress)
      HP_FAIL(ErrorKind::kNccl, where, ": ", what, " failed: ", ncclGetErrorString(state), " (",
              nccl_last_error(comm), ")");
    if (Clock::now() > deadline)
      HP_FAIL(ErrorKind::kComm, where, ": ", what, " timed out (a peer did not take part)");
    if (Clock::now() < spin_until)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

NcclCommunicator::~NcclCommunicator() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  std::lock_guard<std::mutex> lk(mu_);
  // Let enqueued work finish (bounded), then release the communicator. ncclCommAbort, not
  // ncclCommDestroy: destroy may wait for peers that are gone or have moved on.
  const auto deadline =
      Clock::now() + std::min<std::chrono::milliseconds>(timeout(), std::chrono::seconds(30));
  while (comm_ && error_.empty() && !pending_.empty() && Clock::now() < deadline) {
    cudaError_t q = cudaEventQuery(pending_.front().event);
    if (q == cudaSuccess) {
      free_events_.push_back(pending_.front().event);
      pending_.pop_front();
    } else if (q == cudaErrorNotReady) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    } else {
      break;
    }
  }
  if (!pending_.empty() && error_.empty())
    log_warn(where(pending_.front().op), ": still running when the communicator was destroyed");
  if (comm_) {
    ncclResult_t rc = ncclCommAbort(comm_);
    if (rc != ncclSuccess) log_warn(where("destroy"), ": ncclCommAbort: ", ncclGetErrorString(rc));
    comm_ = nullptr;
  }
  for (const Pending& p : pending_) cudaEventDestroy(p.event);
  for (CUevent_st* e : free_events_) cudaEventDestroy(e);
  if (barrier_buf_) cudaFreeAsync(barrier_buf_, stream_);
}

std::string NcclCommunicator::where(const char* op) const {
  return str_cat("rank ", world_rank(), ": ", op, " on '", name(), "'");
}

void NcclCommunicator::check_usable(const char* op) {
  // The stream and events belong to device_: make it current for this call and the next ones.
  int current = -1;
  CUDA_CHECK(cudaGetDevice(&current));
  if (current != device_) CUDA_CHECK(cudaSetDevice(device_));
  std::lock_guard<std::mutex> lk(mu_);
  if (!error_.empty())
    HP_FAIL(error_kind_, error_, "; ", op, " on '", name(),
            "' refused: the communicator is broken");
  HP_CHECK(comm_, op, " on '", name(), "': no NCCL communicator");
}

void NcclCommunicator::after_call(ncclResult_t rc, const char* op, const char* stmt) {
  if (rc == ncclSuccess) return;
  if (rc == ncclInProgress) {
    try {
      settle(comm_, op, where(op), Clock::now() + timeout());
    } catch (const Error& e) {
      error_ = e.what();
      error_kind_ = e.kind();
      if (group_depth_ == 0) abort_locked();
      throw;
    }
    return;
  }
  const std::string detail = nccl_last_error(comm_);
  // Argument mistakes leave the communicator usable; anything else breaks it.
  if (rc != ncclInvalidArgument && rc != ncclInvalidUsage) {
    error_ = str_cat(where(op), " failed: ", ncclGetErrorString(rc), " (", detail, ")");
    error_kind_ = ErrorKind::kNccl;
    if (group_depth_ == 0) abort_locked();
  }
  HP_FAIL(ErrorKind::kNccl, where(op), ": ", stmt, " failed: ", ncclGetErrorString(rc), " (",
          detail, ")");
}

CUevent_st* NcclCommunicator::take_event() {
  if (!free_events_.empty()) {
    CUevent_st* e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void NcclCommunicator::track(const char* op) {
  CUevent_st* e = take_event();
  cudaError_t rc = cudaEventRecord(e, stream_);
  if (rc != cudaSuccess) {
    free_events_.push_back(e);
    CUDA_CHECK(rc);
  }
  pending_.push_back(Pending{e, op, Clock::now()});
}

bool NcclCommunicator::poll_locked() {
  if (!error_.empty()) return true;
  if (!comm_) return false;
  const auto now = Clock::now();
  while (!pending_.empty()) {
    Pending& p = pending_.front();
    cudaError_t q = cudaEventQuery(p.event);
    if (q == cudaSuccess) {
      free_events_.push_back(p.event);
      pending_.pop_front();
      // The next operation could not start before this one ended: its clock starts now.
      if (!pending_.empty()) pending_.front().start = std::max(pending_.front().start, now);
      continue;
    }
    if (q != cudaErrorNotReady) {
      fail_locked(ErrorKind::kCuda, str_cat(where(p.op), " failed on the device: ",
                                            cudaGetErrorName(q), ": ", cudaGetErrorString(q)));
      return true;
    }
    if (now - p.start > timeout()) {
      fail_locked(ErrorKind::kComm,
                  str_cat(where(p.op), " timed out after ", seconds_str(timeout()),
                          " (a peer did not join it; the NCCL communicator was aborted)"));
      return true;
    }
    break;
  }
  if (group_depth_ == 0) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
    if (rc != ncclSuccess) state = rc;
    if (state != ncclSuccess && state != ncclInProgress) {
      fail_locked(ErrorKind::kNccl,
                  str_cat(where(pending_.empty() ? "communicator" : pending_.front().op),
                          " failed asynchronously: ", ncclGetErrorString(state), " (",
                          nccl_last_error(comm_), ")"));
      return true;
    }
  }
  return false;
}

void NcclCommunicator::fail_locked(ErrorKind kind, const std::string& message) {
  if (!error_.empty()) return;
  error_ = message;
  error_kind_ = kind;
  log_error(message);
  // Inside an open group the abort waits for group_end (the group's state is the driving
  // thread's); the watchdog retries until then.
  if (group_depth_ == 0) abort_locked();
}

void NcclCommunicator::abort_locked() {
  if (!comm_) return;
  ncclResult_t rc = ncclCommAbort(comm_);
  if (rc != ncclSuccess)
    log_warn(where("abort"), ": ncclCommAbort: ", ncclGetErrorString(rc), " (",
             nccl_last_error(nullptr), ")");
  comm_ = nullptr;
}

void NcclCommunicator::watchdog_loop() {
  if (cudaSetDevice(device_) != cudaSuccess) {
    log_error(where("watchdog"), ": cannot select CUDA device ", device_);
    return;
  }
  const auto interval = std::clamp<std::chrono::milliseconds>(
      timeout() / 20, std::chrono::milliseconds(1), std::chrono::milliseconds(100));
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    cv_.wait_for(lk, interval, [this] { return stop_; });
    if (stop_) break;
    if (poll_locked() && !comm_) break;  // broken and aborted: nothing left to watch
    if (!error_.empty() && comm_ && group_depth_ == 0) abort_locked();
  }
}

size_t NcclCommunicator::pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  return pending_.size();
}

void NcclCommunicator::synchronize() {
  check_usable("synchronize");
  for (int spins = 0;; ++spins) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (poll_locked()) HP_FAIL(error_kind_, error_);
      if (pending_.empty()) break;
    }
    if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  if (be_) be_->syncs().add(SyncCause::kOther);
}

// ---- collectives ------------------------------------------------------------------------------

void NcclCommunicator::all_reduce(Tensor& t, ReduceOp op) {
  check_usable("all_reduce");
  check_device_tensor(t, "all_reduce", "t");
  std::lock_guard<std::mutex> lk(mu_);
  HP_NCCL_ENQUEUE("all_reduce", ncclAllReduce(t.raw(), t.raw(), static_cast<size_t>(t.numel()),
                                              nccl_type(t.dtype()), nccl_op(op), comm_, stream_));
  // Inside a group the reduction is launched by group_end, which records the group for the
  // watchdog.
  if (group_depth_ == 0) track("all_reduce");
}

void NcclCommunicator::broadcast(Tensor& t, int root) {
  check_usable("broadcast");
  check_device_tensor(t, "broadcast", "t");
  HP_CHECK(root >= 0 && root < size(), "broadcast root ", root, " of ", size(), " ranks");
  std::lock_guard<std::mutex> lk(mu_);
  HP_CHECK(group_depth_ == 0, "broadcast inside a group");
  HP_NCCL_ENQUEUE("broadcast",
                  ncclBroadcast(t.raw(), t.raw(), t.nbytes(), ncclInt8, root, comm_, stream_));
  track("broadcast");
}

void NcclCommunicator::all_gather(const Tensor& in, Tensor& out) {
  check_usable("all_gather");
  check_device_tensor(in, "all_gather", "in");
  check_device_tensor(out, "all_gather", "out");
  HP_CHECK(in.dtype() == out.dtype() && out.numel() == in.numel() * size(),
           "all_gather: ", in.desc(), " into ", out.desc(), " over ", size(), " ranks");
  std::lock_guard<std::mutex> lk(mu_);
  HP_NCCL_ENQUEUE("all_gather",
                  ncclAllGather(in.raw(), out.raw(), in.nbytes(), ncclInt8, comm_, stream_));
  // Inside a group, group_end launches it and records the group for the watchdog.
  if (group_depth_ == 0) track("all_gather");
}

void NcclCommunicator::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
  check_usable("reduce_scatter");
  check_device_tensor(in, "reduce_scatter", "in");
  check_device_tensor(out, "reduce_scatter", "out");
  HP_CHECK(in.dtype() == out.dtype() && in.numel() == out.numel() * size(),
           "reduce_scatter: ", in.desc(), " into ", out.desc(), " over ", size(), " ranks");
  std::lock_guard<std::mutex> lk(mu_);
  HP_NCCL_ENQUEUE("reduce_scatter",
                  ncclReduceScatter(in.raw(), out.raw(), static_cast<size_t>(out.numel()),
                                    nccl_type(in.dtype()), nccl_op(op), comm_, stream_));
  if (group_depth_ == 0) track("reduce_scatter");
}

void NcclCommunicator::all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts,
                                    Tensor& recv, const std::vector<int64_t>& recv_counts) {
  check_usable("all_to_all_v");
  check_device_tensor(send, "all_to_all_v", "send");
  check_device_tensor(recv, "all_to_all_v", "recv");
  const size_t n = static_cast<size_t>(size());
  HP_CHECK(send_counts.size() == n && recv_counts.size() == n, "all_to_all_v: ", send_counts.size(),
           " send and ", recv_counts.size(), " recv counts for ", n, " ranks");
  HP_CHECK(send.dtype() == recv.dtype(), "all_to_all_v: ", send.desc(), " vs ", recv.desc());
  const int64_t send_rows = std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0});
  const int64_t recv_rows = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
  auto rows_of = [](const Tensor& t) { return t.ndim() == 0 ? t.numel() : t.dim(0); };
  HP_CHECK(rows_of(send) == send_rows && rows_of(recv) == recv_rows, "all_to_all_v: ", send.desc(),
           " for ", send_rows, " rows, ", recv.desc(), " for ", recv_rows, " rows");
  const int64_t send_row_elems = send_rows > 0 ? send.numel() / send_rows : 0;
  const int64_t recv_row_elems = recv_rows > 0 ? recv.numel() / recv_rows : 0;
  HP_CHECK(send_rows == 0 || recv_rows == 0 || send_row_elems == recv_row_elems,
           "all_to_all_v: row sizes differ: ", send.desc(), " vs ", recv.desc());
  const size_t row_bytes =
      static_cast<size_t>(std::max(send_row_elems, recv_row_elems)) * dtype_size(send.dtype());

  std::lock_guard<std::mutex> lk(mu_);
  HP_CHECK(group_depth_ == 0, "all_to_all_v inside a group");
  const char* src = bytes_of(send);
  char* dst = bytes_of(recv);
  std::vector<size_t> send_off(n, 0), recv_off(n, 0);
  for (size_t p = 1; p < n; ++p) {
    send_off[p] = send_off[p - 1] + static_cast<size_t>(send_counts[p - 1]) * row_bytes;
    recv_off[p] = recv_off[p - 1] + static_cast<size_t>(recv_counts[p - 1]) * row_bytes;
  }
  const size_t me = static_cast<size_t>(rank());
  HP_CHECK(send_counts[me] == recv_counts[me], "all_to_all_v: rank ", rank(), " sends ",
           send_counts[me], " rows to itself but receives ", recv_counts[me]);
  // The rows this rank keeps are a send/recv pair to itself inside the group (NCCL supports
  // self-addressed point-to-point in a group and copies it within the group's kernel), so the
  // local copy runs alongside the transfers to the other ranks instead of ahead of them on the
  // stream: with 2 ranks it is half of the bytes. Peers with a zero count get no operation.
  // Every send/recv is recorded first; the group is closed even when one of them fails, so the
  // thread's NCCL group state stays balanced.
  NCCL_CHECK(ncclGroupStart());
  ncclResult_t first = ncclSuccess;
  const char* failed = nullptr;
  for (size_t p = 0; p < n && first == ncclSuccess; ++p) {
    const int peer = static_cast<int>(p);
    if (send_counts[p] > 0) {
      first = ncclSend(src + send_off[p], static_cast<size_t>(send_counts[p]) * row_bytes, ncclInt8,
                       peer, comm_, stream_);
      if (first != ncclSuccess) failed = "ncclSend(...) in all_to_all_v";
    }
    if (first == ncclSuccess && recv_counts[p] > 0) {
      first = ncclRecv(dst + recv_off[p], static_cast<size_t>(recv_counts[p]) * row_bytes, ncclInt8,
                       peer, comm_, stream_);
      if (first != ncclSuccess) failed = "ncclRecv(...) in all_to_all_v";
    }
  }
  ncclResult_t end = ncclGroupEnd();
  if (first != ncclSuccess && first != ncclInProgress) after_call(first, "all_to_all_v", failed);
  HP_NCCL_ENQUEUE("all_to_all_v", end);
  track("all_to_all_v");
}

void NcclCommunicator::barrier() {
  check_usable("barrier");
  {
    std::lock_guard<std::mutex> lk(mu_);
    HP_CHECK(group_depth_ == 0, "barrier inside a group");
    HP_NCCL_ENQUEUE("barrier", ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclInt32, ncclMax,
                                             comm_, stream_));
    track("barrier");
  }
  synchronize();
}

// ---- point to point ---------------------------------------------------------------------------

void NcclCommunicator::send(const Tensor& t, int peer) {
  check_usable("send");
  check_device_tensor(t, "send", "t");
  HP_CHECK(peer >= 0 && peer < size(), "send to rank ", peer, " of ", size());
  std::lock_guard<std::mutex> lk(mu_);
  HP_NCCL_ENQUEUE("send", ncclSend(t.raw(), t.nbytes(), ncclInt8, peer, comm_, stream_));
  if (group_depth_ == 0) track("send");
}

void NcclCommunicator::recv(Tensor& t, int peer) {
  check_usable("recv");
  check_device_tensor(t, "recv", "t");
  HP_CHECK(peer >= 0 && peer < size(), "recv from rank ", peer, " of ", size());
  std::lock_guard<std::mutex> lk(mu_);
  HP_NCCL_ENQUEUE("recv", ncclRecv(t.raw(), t.nbytes(), ncclInt8, peer, comm_, stream_));
  if (group_depth_ == 0) track("recv");
}

void NcclCommunicator::group_start() {
  check_usable("group_start");
  std::lock_guard<std::mutex> lk(mu_);
  NCCL_CHECK(ncclGroupStart());
  ++group_depth_;
}

void NcclCommunicator::group_end() {
  std::lock_guard<std::mutex> lk(mu_);
  HP_CHECK(group_depth_ > 0, "group_end without group_start on '", name(), "'");
  --group_depth_;
  if (!comm_) {
    // Broken while the group was open: close NCCL's group state, report the stored error.
    ncclGroupEnd();
    HP_FAIL(error_kind_, error_);
  }
  HP_NCCL_ENQUEUE("group", ncclGroupEnd());
  if (group_depth_ == 0) {
    track("group");
    if (!error_.empty()) abort_locked();
  }
}

// ---- groups -----------------------------------------------------------------------------------

std::shared_ptr<Communicator> NcclCommunicator::split(int color, int key, const std::string& name) {
  check_usable("split");
  const int n = size();
  // Who joins whom: (color, key) of every rank, gathered on the device and read once.
  std::vector<int32_t> mine = {color, key};
  std::vector<int32_t> all(static_cast<size_t>(2 * n), 0);
  void* dev = nullptr;
  CUDA_CHECK(cudaMallocAsync(&dev, sizeof(int32_t) * (2 + 2 * n), stream_));
  std::shared_ptr<void> release(dev, [this](void* p) { cudaFreeAsync(p, stream_); });
  int32_t* dev_mine = static_cast<int32_t*>(dev);
  int32_t* dev_all = dev_mine + 2;
  CUDA_CHECK(
      cudaMemcpyAsync(dev_mine, mine.data(), sizeof(int32_t) * 2, cudaMemcpyHostToDevice, stream_));
  {
    std::lock_guard<std::mutex> lk(mu_);
    HP_CHECK(group_depth_ == 0, "split inside a group");
    HP_NCCL_ENQUEUE("split", ncclAllGather(dev_mine, dev_all, 2, ncclInt32, comm_, stream_));
    track("split");
  }
  CUDA_CHECK(cudaMemcpyAsync(all.data(), dev_all, sizeof(int32_t) * 2 * n, cudaMemcpyDeviceToHost,
                             stream_));
  synchronize();

  std::vector<int> members;
  for (int r = 0; r < n; ++r)
    if (color >= 0 && all[2 * r] == color) members.push_back(r);
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });

  std::shared_ptr<NcclCommunicator> child;
  if (color >= 0) {
    std::vector<int> world;
    for (int r : members) world.push_back(world_rank(r));
    const int my =
        static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
    child.reset(new NcclCommunicator(name, my, static_cast<int>(members.size()), world, options(),
                                     device_, stream_, be_));
  }
  const auto deadline = Clock::now() + timeout();
  ncclConfig_t config = nonblocking_config(child ? child->name() : name);
  // A non-blocking split writes the new handle from NCCL's background job once it is ready, so
  // the slot lives on the heap: if we give up waiting, the late write still lands somewhere valid.
  auto* slot = new ncclComm_t(nullptr);
  {
    std::lock_guard<std::mutex> lk(mu_);
    HP_NCCL_ENQUEUE(
        "split", ncclCommSplit(comm_, color >= 0 ? color : NCCL_SPLIT_NOCOLOR, key, slot, &config));
    // The parent reports ncclInProgress until its part of the split is done, whatever the call
    // returned.
    try {
      settle(comm_, "split", where("split"), deadline);
    } catch (const Error& e) {
      error_ = e.what();
      error_kind_ = e.kind();
      abort_locked();
      throw;
    }
  }
  if (!child) {
    delete slot;
    return nullptr;
  }
  ncclComm_t nc = nullptr;
  for (int spins = 0; (nc = __atomic_load_n(slot, __ATOMIC_ACQUIRE)) == nullptr; ++spins) {
    if (Clock::now() > deadline)
      HP_FAIL(ErrorKind::kComm, child->where("split"),
              ": ncclCommSplit gave no communicator for "
              "color ",
              color, " within ", seconds_str(timeout()));
    if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  delete slot;
  try {
    settle(nc, "creating the split NCCL communicator", child->where("split"), deadline);
  } catch (...) {
    ncclCommAbort(nc);
    throw;
  }
  child->comm_ = nc;
  CUDA_CHECK(cudaMallocAsync(&child->barrier_buf_, sizeof(int32_t), stream_));
  CUDA_CHECK(cudaMemsetAsync(child->barrier_buf_, 0, sizeof(int32_t), stream_));
  child->watchdog_ = std::thread([c = child.get()] { c->watchdog_loop(); });
  return child;
}

void NcclCommunicator::abort(const std::string& reason) noexcept {
  try {
    std::lock_guard<std::mutex> lk(mu_);
    log_error(where("abort"), ": ", reason);
    if (error_.empty()) {
      error_ = str_cat(where("abort"), ": communicator aborted: ", reason);
      error_kind_ = ErrorKind::kComm;
    }
    if (group_depth_ == 0) abort_locked();
  } catch (...) {
    // abort never throws; logging is best effort.
  }
}

// ---- process groups ---------------------------------------------------------------------------

ProcessGroups make_nccl_groups(const ProcessGroups& host, Backend& be) {
  HP_CHECK(host.world, "make_nccl_groups: no host world communicator");
  ProcessGroups g = host;
  // Each group gets its own unique id over its host group, so ranks, order and world ranks are
  // the host group's by construction. Groups are created one kind at a time, in the same order
  // on every rank (each creation is collective over the ranks of one group).
  auto mirror = [&](const std::shared_ptr<Communicator>& h) -> std::shared_ptr<Communicator> {
    if (!h) return nullptr;
    return NcclCommunicator::create(*h, be, h->name());
  };
  g.world = mirror(host.world);
  g.dp = mirror(host.dp);
  g.ep = mirror(host.ep);
  // Every rank has a node group or none does (it comes from one collective split).
  g.node = mirror(host.node);
  return g;
}

ProcessGroups make_nccl_grad_groups(const ProcessGroups& host, Backend& be) {
  HP_CHECK(host.world, "make_nccl_grad_groups: no host world communicator");
  // Every rank must take the same decision (the creations below are collective).
  Tensor agreed =
      Tensor::host_from(std::vector<int64_t>{nccl_launch_order_implicit() ? 1 : 0}, DType::kI64);
  host.world->all_reduce(agreed, ReduceOp::kMin);
  if (agreed.data<int64_t>()[0] == 0) {
    log_warn(
        "gradient reductions stay on the compute stream: NCCL orders launches of "
        "concurrent communicators only from 2.26 on with NCCL_LAUNCH_ORDER_IMPLICIT=1 "
        "(missing on at least one rank)");
    return ProcessGroups{};
  }
  ProcessGroups g = host;
  g.ep = nullptr;
  g.node = nullptr;
  // Created in the same order on every rank, like make_nccl_groups.
  auto mirror = [&](const std::shared_ptr<Communicator>& h) -> std::shared_ptr<Communicator> {
    if (!h) return nullptr;
    return NcclCommunicator::create(*h, be, h->name() + ".grad", Backend::StreamKind::kComm);
  };
  g.world = mirror(host.world);
  // dp with the world's ranks in the world's order (ep_size 1): the same decision on every rank,
  // and one communicator (one set of NCCL buffers) serves both.
  const bool dp_is_world = host.dp && host.dp->world_ranks() == host.world->world_ranks();
  g.dp = dp_is_world ? g.world : mirror(host.dp);
  return g;
}

}  // namespace hp
