// NcclCommunicator: the device-tensor Communicator (device() == kCUDA) over NCCL.
//
// Stream semantics: every call enqueues its NCCL operation on one CUDA stream, fixed at
// construction (the backend's compute stream by default; gradient communicators use its comm
// stream, see make_nccl_grad_groups), after the work already there, and
// returns without waiting for the device. Inputs and outputs must stay alive until the stream
// has run the operation; tensors from the backend's caching allocator satisfy that because the
// allocator reuses memory in the compute stream's order. Other streams order themselves against
// this one with events. Only barrier(), synchronize(), split() and construction block the host.
//
// Failures: the NCCL communicator is non-blocking (ncclConfig_t::blocking = 0), so no NCCL call
// blocks the host forever. Each enqueued operation is recorded (CUDA event, name, start time);
// a watchdog thread per communicator retires completed operations and polls
// ncclCommGetAsyncError. An operation not finished within timeout(), or an asynchronous NCCL
// error, turns into an Error (kind kComm or kNccl) naming this rank, the operation and the
// communicator, e.g. "rank 0: all_reduce on 'world' timed out after 5 s"; the watchdog then
// aborts the NCCL communicator (ncclCommAbort) so that this rank's stream, and with it any host
// thread blocked on that stream, continues. The error is thrown by the next call on this
// communicator (or by synchronize()); the communicator stays broken afterwards.
//
// Errors of NCCL and CUDA calls throw hp::Error through NCCL_CHECK / CUDA_CHECK with the
// statement, file:line, the library's error string and NCCL's last-error text.
//
// Ownership: owns its ncclComm_t and its watchdog thread; the destructor waits (bounded by
// timeout()) for enqueued work, then destroys the NCCL communicator, or aborts it if the wait
// fails. Destroy communicators before the backend whose stream they use.
// Thread safety: one host thread drives a communicator; different NcclCommunicators may be
// driven by different threads. group_start()/group_end() map to ncclGroupStart/End, which group
// the calling thread's NCCL operations across all communicators.
//
// Several communicators on one device at once: operations of different communicators on
// different streams (the expert exchange on the compute stream, gradient reductions on the comm
// stream) may run concurrently. NCCL kernels wait for their peers, so two of them ordered
// differently on two GPUs can deadlock unless NCCL orders their launches. From NCCL 2.26 on,
// NCCL_LAUNCH_ORDER_IMPLICIT=1 makes every device launch NCCL kernels in the order the host
// issued them (on CUDA >= 12.3 through launch-completion events, so the kernels still run side
// by side); then the application only has to issue all NCCL operations of all communicators in
// the same order on every rank, from one thread per device. create() turns it on for the
// process (see nccl_launch_order_implicit()); hotpath issues every NCCL call of a step from the
// one thread that drives the backend, in program order, which is the same on every rank.
#pragma once

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "framework/backend/backend.h"
#include "parallel/communicator.h"
#include "parallel/process_groups.h"

struct CUevent_st;   // cudaEvent_t is CUevent_st*
struct CUstream_st;  // cudaStream_t is CUstream_st*

// Throws hp::Error(kNccl) naming the statement, NCCL's error string and last-error text.
#define NCCL_CHECK(stmt)                                                                         \
  do {                                                                                           \
    ncclResult_t hp_nccl_rc_ = (stmt);                                                           \
    if (hp_nccl_rc_ != ncclSuccess && hp_nccl_rc_ != ncclInProgress)                             \
      HP_FAIL(::hp::ErrorKind::kNccl, #stmt, " failed: ", ncclGetErrorString(hp_nccl_rc_), " (", \
              ::hp::nccl_last_error(nullptr), ")");                                              \
  } while (0)

namespace hp {

// NCCL's description of the last error on `comm` (nullptr: the last error of any communicator);
// "no detail" when NCCL has none.
std::string nccl_last_error(ncclComm_t comm);

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `host` (every rank): rank 0 of `host` creates an NCCL unique id, share_blob
  // hands it to the others, and each rank joins an NCCL communicator with `host`'s ranks, size,
  // world ranks and options, on the backend's device and compute stream. `name` defaults to
  // host's name. Bounded by host.timeout(). The backend must outlive the communicator.
  // `stream` picks the backend stream the operations go on (kCompute or kComm).
  static std::shared_ptr<NcclCommunicator> create(
      Communicator& host, Backend& be, const std::string& name = "",
      Backend::StreamKind stream = Backend::StreamKind::kCompute);
  // Same, on an explicit device and stream (no backend: barrier/synchronize count no syncs).
  static std::shared_ptr<NcclCommunicator> create(Communicator& host, int device,
                                                  CUstream_st* stream,
                                                  const std::string& name = "");
  ~NcclCommunicator() override;

  Device device() const override { return Device::kCUDA; }
  CUstream_st* stream() const { return stream_; }

  // Reductions: f32, f64, bf16, i32, i64 (bf16 sums in NCCL's own order: identical on every
  // rank, not the host implementations' rank-order fold). Unlike the other collectives,
  // all_reduce, reduce_scatter and all_gather may also be recorded between group_start() and
  // group_end(): the group then launches them together (NCCL aggregates them; see GradSync for
  // when that keeps the sums bitwise equal to separate launches).
  void all_reduce(Tensor& t, ReduceOp op) override;
  void broadcast(Tensor& t, int root) override;
  void all_gather(const Tensor& in, Tensor& out) override;
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override;
  // Grouped ncclSend/ncclRecv, one pair per peer with a nonzero count, this rank included: the
  // rows it keeps travel as a send/recv to itself inside the same group, so NCCL copies them in
  // the same kernel while the other peers' rows cross the links (no separate device copy ahead
  // of the group that the transfers would wait for).
  void all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor& recv,
                    const std::vector<int64_t>& recv_counts) override;
  // A one-element all-reduce, then a bounded host wait for it (counts one sync of cause other
  // when built with a backend).
  void barrier() override;

  void send(const Tensor& t, int peer) override;
  void recv(Tensor& t, int peer) override;
  void group_start() override;
  void group_end() override;

  // ncclCommSplit; the new communicator's world ranks come from a device all-gather of
  // (color, key) over this one. Same stream and device.
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) override;
  // Logs `reason`, aborts the NCCL communicator (its kernels exit), marks this one broken.
  void abort(const std::string& reason) noexcept override;

  // Blocks until every operation enqueued so far has finished on the device, bounded by
  // timeout(); throws the watchdog's error (naming the stuck operation) or a kNccl error.
  void synchronize();
  // Operations enqueued and not yet seen complete (for tests).
  size_t pending() const;

 private:
  struct Pending {
    CUevent_st* event;
    const char* op;
    std::chrono::steady_clock::time_point start;
  };

  NcclCommunicator(std::string name, int rank, int size, std::vector<int> world_ranks,
                   CommOptions options, int device, CUstream_st* stream, Backend* be);
  // Waits (polling ncclCommGetAsyncError) until `comm` leaves ncclInProgress; aborts it and
  // throws on an error or when `deadline` passes.
  static void settle(ncclComm_t comm, const char* what, const std::string& where,
                     std::chrono::steady_clock::time_point deadline);
  // Joins an NCCL communicator from a unique id (collective over the ranks of the id).
  void init_from_id(const ncclUniqueId& id);

  // Entry of every call: throws when broken.
  void check_usable(const char* op);
  // After an NCCL call that may return ncclInProgress: waits for the enqueue to finish.
  void after_call(ncclResult_t rc, const char* op, const char* stmt);
  // Records one enqueued operation for the watchdog (outside groups; group_end records one).
  void track(const char* op);
  // With mu_ held: retires completed operations; detects a timeout or an asynchronous error,
  // then aborts. Returns true when the communicator is (now) broken.
  bool poll_locked();
  void fail_locked(ErrorKind kind, const std::string& message);
  void abort_locked();
  void watchdog_loop();
  std::string where(const char* op) const;
  CUevent_st* take_event();

  int device_ = 0;
  CUstream_st* stream_ = nullptr;
  Backend* be_ = nullptr;
  ncclComm_t comm_ = nullptr;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  std::vector<CUevent_st*> free_events_;
  std::string error_;  // non-empty: broken
  ErrorKind error_kind_ = ErrorKind::kComm;
  int group_depth_ = 0;
  bool stop_ = false;
  std::thread watchdog_;
  void* barrier_buf_ = nullptr;  // one i32 on the device
};

// Collective over `host`: rank 0's new NCCL unique id, handed to every rank of `host`.
void share_nccl_unique_id(Communicator& host, ncclUniqueId* id);

// Collective over host_groups.world: NCCL communicators for world, dp, ep (and node when the
// host groups have one) with exactly the ranks, names and options of the host groups, on the
// backend's device and compute stream. Each comes from a unique id shared over its host group
// (create() above), so it mirrors that group by construction.
ProcessGroups make_nccl_groups(const ProcessGroups& host_groups, Backend& be);

// Whether NCCL kernels of different communicators on one device are launched in host issue
// order (NCCL_LAUNCH_ORDER_IMPLICIT, NCCL >= 2.26; set for the process by the first create()
// unless the environment already says otherwise). Only then may communicators on different
// streams have operations in flight at the same time; callers fall back to the compute stream
// otherwise. Never throws.
bool nccl_launch_order_implicit();

// Collective over host_groups.world: the communicators of the gradient reductions (GradSync),
// world and dp, named "<host name>.grad", on the backend's comm stream (StreamKind::kComm), so
// reductions overlap backward compute while the expert exchange keeps the compute stream's
// communicators. When dp has the world's ranks (ep_size 1) both are one communicator. ep and
// node stay empty. When nccl_launch_order_implicit() is false on any rank (agreed over the host
// world), logs why and returns empty groups (world == nullptr): the caller keeps its gradient
// reductions on the compute stream.
ProcessGroups make_nccl_grad_groups(const ProcessGroups& host_groups, Backend& be);

}  // namespace hp
