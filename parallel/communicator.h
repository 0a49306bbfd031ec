// Communicator: collectives and point-to-point messages among the ranks of one group.
//
// One interface, several implementations: MpiCommunicator moves host tensors (the CPU backend's
// multi-rank path, bootstrap and small control messages); StoreCommunicator carries the control
// messages of launches without MPI through a Store (store_communicator.h); a stream-ordered NCCL
// implementation moves device tensors. Groups (world, dp, ep, node) are Communicator objects made
// by split() and passed around explicitly, never globals (see process_groups.h).
//
// What every implementation guarantees:
//  - Matching calls. Collectives are called by every rank of the communicator, in the same order,
//    with the same dtype and matching sizes. Ranks passed in and returned are ranks of this
//    communicator (0..size()-1); error messages name world ranks, which match launcher output.
//  - Completion. Host implementations (device() == kCPU) finish the operation before returning:
//    inputs may be reused and outputs read at once. Device implementations are stream-ordered: a
//    call enqueues the operation on the communicator's stream after the work already there and
//    returns; other streams are ordered against it with events (the implementation's header says
//    how), never with device-wide synchronizations.
//  - Determinism. all_reduce and reduce_scatter give bitwise-identical results on every rank.
//    Host implementations promise more: element i of a sum is ((x_0 + x_1) + x_2) + ... over the
//    ranks in rank order, computed in the tensor's own dtype, whatever the message algorithm, so
//    the result equals a single process folding the same inputs in the same order.
//  - Timeouts and failures. Every blocking wait is bounded by timeout() (default 300 s; bootstrap
//    and split are bounded too). When it expires the call throws hp::Error (kind kComm) naming
//    this rank, the operation, the communicator and, when the implementation can tell, the peers
//    not heard from: "rank 1: all_reduce on 'world' timed out after 5 s waiting for rank 3". A
//    peer that exits, crashes or aborts makes the call throw as soon as that is known. After any
//    failure the communicator is broken and every later call throws at once. The caller (the top
//    level in launch/) logs, calls abort() and exits non-zero: that is what keeps the other ranks
//    from hanging.
//  - Tensors are contiguous (every hp::Tensor is) and live on device(). Reductions take f32, f64,
//    i32 and i64; movement-only operations (broadcast, all_gather, all_to_all_v, send/recv) also
//    take bf16. Integer sums wrap around on overflow (two's complement). Input and output tensors
//    of one call must not overlap unless the call says so.
//
// Thread safety: one host thread drives a communicator at a time. Whether different communicators
// may be driven by different threads at once is the implementation's to say (MPI: no, only the
// thread that initialised MPI calls it; Store: yes).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "framework/core/tensor.h"

namespace hp {

enum class ReduceOp { kSum, kMax, kMin };

const char* reduce_op_name(ReduceOp op);

// Settings every implementation honours. Sub-communicators made by split() inherit them.
struct CommOptions {
  // Bound on every blocking wait of every call, rendezvous included.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The group's name ("world", "dp", "ep", "node"): it appears in every error message.
  const std::string& name() const { return name_; }
  // World rank of this communicator's rank r; world_ranks()[r] for every r.
  int world_rank(int r) const;
  int world_rank() const { return world_rank(rank_); }
  const std::vector<int>& world_ranks() const { return world_ranks_; }

  std::chrono::milliseconds timeout() const { return options_.timeout; }
  // Applies to calls started afterwards, on this rank. Ranks may set different values.
  void set_timeout(std::chrono::milliseconds timeout) { options_.timeout = timeout; }
  const CommOptions& options() const { return options_; }

  // The device whose tensors this communicator moves.
  virtual Device device() const = 0;

  // ---- collectives --------------------------------------------------------------------------
  // In place: t (same shape and dtype on every rank) becomes the element-wise reduction of every
  // rank's t.
  virtual void all_reduce(Tensor& t, ReduceOp op) = 0;
  // t on every rank becomes root's t. Same numel and dtype on every rank.
  virtual void broadcast(Tensor& t, int root) = 0;
  // out = every rank's `in` concatenated in rank order: out.numel() == size() * in.numel(), so an
  // [n, ...] input gathers into a [size()*n, ...] output. Same dtype.
  virtual void all_gather(const Tensor& in, Tensor& out) = 0;
  // in.numel() == size() * out.numel(). Rank r receives the reduction over ranks of chunk r of
  // `in`, the elements [r * out.numel(), (r + 1) * out.numel()).
  virtual void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) = 0;
  // Personalised exchange; counts are in rows of the leading dimension (the tokens of an expert
  // exchange), one count per rank of this communicator, zero allowed. `send` holds the rows for
  // rank 0, then the rows for rank 1, ...: send.dim(0) == sum(send_counts); `recv` receives the
  // rows from rank 0, then from rank 1, ...: recv.dim(0) == sum(recv_counts). send and recv have
  // the same dtype and the same trailing dimensions (a 1-D tensor's rows are its elements).
  // recv_counts[p] must equal what rank p passes as send_counts[rank()]; exchanging the counts
  // first is the caller's job (an all_to_all_v of one i64 per rank does it).
  virtual void all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts,
                            Tensor& recv, const std::vector<int64_t>& recv_counts) = 0;
  // Returns once every rank has entered the barrier.
  virtual void barrier() = 0;

  // ---- point to point -----------------------------------------------------------------------
  // Outside a group, send returns once t may be reused (which may mean: once the peer has
  // received it) and recv once t holds the message. Two ranks that send to each other first
  // can deadlock: put exchanges between group_start() and group_end(). recv's t has the numel
  // and dtype the peer sends.
  virtual void send(const Tensor& t, int peer) = 0;
  virtual void recv(Tensor& t, int peer) = 0;
  // Between group_start() and group_end() send and recv only record the operation; group_end()
  // runs every recorded operation concurrently and returns when all are done (device
  // implementations: when all are enqueued). The tensors must stay alive and unchanged until
  // then. Groups nest; only the outermost group_end() runs them. Collectives are not allowed
  // inside a group.
  virtual void group_start() = 0;
  virtual void group_end() = 0;

  // ---- groups -------------------------------------------------------------------------------
  // Collective over this communicator: ranks passing the same color >= 0 form a new
  // communicator, ordered by (key, rank here); ranks passing a negative color get nullptr. The
  // new communicator inherits options() and is independent of this one (either may be destroyed
  // first). Bounded by timeout().
  virtual std::shared_ptr<Communicator> split(int color, int key, const std::string& name) = 0;
  // Collective: the ranks that share this host, in rank order. The default implementation
  // compares host names (split_by_label); MPI uses MPI_Comm_split_type(SHARED).
  virtual std::shared_ptr<Communicator> split_by_host(const std::string& name);

  // ---- failure ------------------------------------------------------------------------------
  // Best effort to tear the job down so that no peer waits forever: logs `reason`, tells the
  // peers it can reach, releases the transport. MPI does not return (MPI_Abort ends the job);
  // other implementations return and the caller exits non-zero. Never throws.
  virtual void abort(const std::string& reason) noexcept = 0;

 protected:
  // world_ranks[r] is the world rank of rank r (size entries).
  Communicator(std::string name, int rank, int size, std::vector<int> world_ranks,
               CommOptions options);

 private:
  std::string name_;
  int rank_ = 0;
  int size_ = 1;
  std::vector<int> world_ranks_;
  CommOptions options_;
};

// Collective over `parent`: the ranks whose `label` strings are equal form one communicator,
// ordered by rank in `parent`. Labels of any length; split_by_host passes host names.
std::shared_ptr<Communicator> split_by_label(Communicator& parent, const std::string& label,
                                             const std::string& name);

// This machine's host name (gethostname()).
std::string local_hostname();

}  // namespace hp
