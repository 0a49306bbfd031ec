// HostCommunicator: the part of every host-tensor communicator (MPI, Store) that does not depend on
// the transport.
//
// It validates arguments, turns tensors into byte ranges, runs the deterministic reductions on top
// of byte-moving primitives, keeps the recorded point-to-point group, and owns the failure state:
// deadlines, timeout messages, and the "broken" flag after which every call throws at once.
// A transport implements the do_* primitives below; each must finish within op.deadline or call
// fail_timeout(), and report a lost peer through fail().
//
// All reductions fold in rank order: result = ((x_0 op x_1) op x_2) ... Two algorithms, one
// result: small tensors are all-gathered and folded by every rank; larger ones are split into
// size() chunks, chunk r is sent to rank r (all-to-all), folded there, and the folded chunks are
// all-gathered. Either way each element is folded in the same order from the same values, so
// every rank ends with the same bits.
//
// Thread safety: as Communicator (one thread per instance).
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace hp {

// Element-wise acc[i] = acc[i] op x[i] for n elements of dtype (f32, f64, i32, i64). Max and min
// propagate NaN; integer sums wrap around.
void reduce_into(void* acc, const void* x, int64_t n, DType dtype, ReduceOp op);

// Splits n items into `parts` contiguous chunks whose sizes differ by at most one (the first
// n % parts chunks are one larger).
std::vector<int64_t> even_chunks(int64_t n, int parts);

class HostCommunicator : public Communicator {
 public:
  Device device() const override { return Device::kCPU; }

  void all_reduce(Tensor& t, ReduceOp op) final;
  void broadcast(Tensor& t, int root) final;
  void all_gather(const Tensor& in, Tensor& out) final;
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) final;
  void all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts, Tensor& recv,
                    const std::vector<int64_t>& recv_counts) final;
  void barrier() final;
  void send(const Tensor& t, int peer) final;
  void recv(Tensor& t, int peer) final;
  void group_start() final;
  void group_end() final;
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) final;

  // Total bytes at or below which all_reduce gathers everything instead of chunking.
  static constexpr size_t kGatherReduceBytes = size_t{256} * 1024;

 protected:
  using Clock = std::chrono::steady_clock;

  enum class OpKind : uint16_t {
    kAllReduce = 1,
    kBroadcast,
    kAllGather,
    kReduceScatter,
    kAllToAllV,
    kBarrier,
    kSendRecv,
    kSplit,
    kRendezvous
  };
  static const char* op_name(OpKind kind);

  // One public call in flight: what it is (for messages and message framing) and when it gives up.
  struct Op {
    OpKind kind;
    Clock::time_point deadline;
  };

  // One point-to-point transfer of a group (data points into a tensor kept alive by the caller).
  struct P2p {
    bool is_send = false;
    int peer = 0;
    char* data = nullptr;
    size_t bytes = 0;
  };

  HostCommunicator(std::string name, int rank, int size, std::vector<int> world_ranks,
                   CommOptions options);

  // ---- transport primitives (byte counts and displacements, one per rank, self included) ----
  virtual void do_all_to_all(const Op& op, const char* send, const std::vector<size_t>& send_bytes,
                             const std::vector<size_t>& send_displs, char* recv,
                             const std::vector<size_t>& recv_bytes,
                             const std::vector<size_t>& recv_displs) = 0;
  // Gathers `bytes` from every rank into recv; recv_bytes[rank()] == bytes.
  virtual void do_all_gather(const Op& op, const char* send, size_t bytes, char* recv,
                             const std::vector<size_t>& recv_bytes,
                             const std::vector<size_t>& recv_displs) = 0;
  virtual void do_broadcast(const Op& op, char* data, size_t bytes, int root) = 0;
  virtual void do_barrier(const Op& op) = 0;
  // Runs the transfers concurrently (no self transfers; several per peer run in order).
  virtual void do_p2p(const Op& op, const std::vector<P2p>& ops) = 0;
  // Builds the communicator of `members` (ranks here, in new-rank order; empty when this rank
  // passed a negative color). Called on every rank of this communicator after the colors are
  // known; `color` is the same on every member. Returns nullptr for non-members.
  virtual std::shared_ptr<Communicator> do_split(const Op& op, int color,
                                                 const std::vector<int>& members,
                                                 const std::string& name) = 0;

  // ---- failure state ------------------------------------------------------------------------
  // Starts a call: throws if the communicator is broken; returns the op with its deadline.
  Op begin(OpKind kind) const;
  bool broken() const { return !broken_reason_.empty(); }
  const std::string& broken_reason() const { return broken_reason_; }
  // Marks the communicator broken without throwing (abort() does, before tearing down).
  void mark_broken(const std::string& reason);
  // Marks the communicator broken and throws hp::Error(kComm):
  // "rank <world rank>: <op> on '<name>': <what>".
  [[noreturn]] void fail(const Op& op, const std::string& what, const char* file, int line);
  // "rank <world rank>: <op> on '<name>' timed out after <t> waiting for rank <r>": names the
  // peers (ranks here) not heard from; `peers_known` false says the transport cannot tell (an MPI
  // collective).
  [[noreturn]] void fail_timeout(const Op& op, const std::vector<int>& waiting_for,
                                 bool peers_known, const char* file, int line);
  // "rank 3" / "ranks 1, 3" in world ranks, for messages.
  std::string describe_peers(const std::vector<int>& ranks_here) const;

 private:
  void check_tensor(const Op& op, const Tensor& t, bool reduction) const;
  // send (send = true) or recv of t with peer: now, or queued inside a group.
  void point_to_point(const Tensor& t, int peer, bool send);
  [[noreturn]] void raise(const Op& op, const std::string& rest, const char* file, int line);

  std::string broken_reason_;
  int group_depth_ = 0;
  std::vector<P2p> group_ops_;
  std::vector<Tensor> group_keep_;  // keeps the recorded tensors alive until group_end()
};

#define HP_COMM_FAIL(op, ...) fail(op, ::hp::str_cat(__VA_ARGS__), __FILE__, __LINE__)
#define HP_COMM_TIMEOUT(op, waiting, known) fail_timeout(op, waiting, known, __FILE__, __LINE__)

}  // namespace hp
