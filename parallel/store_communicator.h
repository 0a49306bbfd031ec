// StoreCommunicator: the host Communicator of launches without MPI, built on a Store.
//
// It carries control messages only: the rendezvous, the NCCL unique ids of the NCCL groups that
// mirror it, a step's few host scalars (valid-target counts, loss sums, flags), split() into the
// process groups, the agreements of a checkpoint save or load. It is not a data path: every
// message is one store value, at most kMaxPayloadBytes per rank (a little under
// Store::kMaxValueBytes, 64 KiB), and there is no all-to-all and no point-to-point transfer.
// A call over the bound, and every all_to_all_v, reduce_scatter, send and recv (and an all_reduce
// large enough to need an all-to-all), throws Error(kind kInternal) naming the operation, the
// communicator and the bytes, before any message is written; the communicator stays usable.
// GPU training without MPI moves its tensors over NCCL groups that mirror the host groups, the
// checkpoint gathers included (launch/train/run_checkpoint.h); the CPU backend needs MPI for
// several ranks (see choose_bootstrap in launch_env.h). Tests run ranks as threads over one store.
//
// Messages: collective call number s of a communicator with key prefix P writes P/s/<from> (one
// value for everyone: all_gather, broadcast, barrier). Every value starts with a header
// (operation, payload bytes), so a rank in a different call, or with a different size, gets an
// error naming the peer instead of wrong data. split() needs no message beyond the colour
// exchange: the members derive the child's prefix (P/s.c<colour>) from the call number.
//
// Cleanup: a value that several ranks read is erased by its writer once it has heard from every
// rank in a later call, because a rank that has written call s has finished reading every earlier
// call; so the store holds a bounded number of values per communicator, whatever the number of
// calls.
//
// Failures: every wait polls the store until the call's deadline and a timeout names the ranks
// not heard from ("rank 0: all_reduce on 'world' timed out after 5 s waiting for rank 3").
// abort() stores its reason under the job's abort key, which every waiting rank of every
// communicator of the job also polls, so the others fail with "rank 1 aborted: <reason>"; a
// TcpStore reports a client that vanished the same way (Store::kLostKey). A rank that dies with a
// FileStore is only noticed through the timeout.
//
// Ownership: shares the store with its sub-communicators. Thread safety: as HostCommunicator;
// different StoreCommunicators may be driven by different threads at once.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "parallel/host_communicator.h"
#include "parallel/store.h"

namespace hp {

class StoreCommunicator final : public HostCommunicator {
 public:
  // Collective over the `world` processes sharing `store`: every rank announces the world size
  // it was started with, rank 0 checks that they agree and answers; returns the communicator
  // named "world". A disagreement is a UserError on every rank that names both sizes; a rank
  // missing at options.timeout is named by rank 0's timeout error. While waiting for rank 0's
  // answer, a non-zero rank calls `superseded` (when given) and returns nullptr when it says true
  // (the file bootstrap's pointer moved on to another run).
  static std::shared_ptr<StoreCommunicator> create_world(
      std::shared_ptr<Store> store, int rank, int world, const CommOptions& options = {},
      const std::function<bool()>& superseded = {});
  // A world of one process, without a store.
  static std::shared_ptr<StoreCommunicator> single(const CommOptions& options = {});

  // Stores "rank R aborted: <reason>" under the job's abort key (best effort), logs, marks this
  // communicator broken; on the rank that serves a TcpStore, keeps serving until the peers have
  // left (at most 10 s or timeout()) so that they can read the reason. Returns; the caller exits
  // non-zero.
  void abort(const std::string& reason) noexcept override;

  // The job's abort key.
  static constexpr const char* kAbortKey = "abort";
  // The largest payload of one rank in one call (the store value less the message header).
  static constexpr size_t kMaxPayloadBytes = Store::kMaxValueBytes - 16;

 protected:
  void do_all_to_all(const Op& op, const char* send, const std::vector<size_t>& send_bytes,
                     const std::vector<size_t>& send_displs, char* recv,
                     const std::vector<size_t>& recv_bytes,
                     const std::vector<size_t>& recv_displs) override;
  void do_all_gather(const Op& op, const char* send, size_t bytes, char* recv,
                     const std::vector<size_t>& recv_bytes,
                     const std::vector<size_t>& recv_displs) override;
  void do_broadcast(const Op& op, char* data, size_t bytes, int root) override;
  void do_barrier(const Op& op) override;
  void do_p2p(const Op& op, const std::vector<P2p>& ops) override;
  std::shared_ptr<Communicator> do_split(const Op& op, int color, const std::vector<int>& members,
                                         const std::string& name) override;

 private:
  StoreCommunicator(std::shared_ptr<Store> store, std::string prefix, std::string name, int rank,
                    int size, std::vector<int> world_ranks, CommOptions options);

  // Throws Error(kInternal): op of `bytes` is not carried by the store (`what` says why).
  [[noreturn]] void refuse(const Op& op, size_t bytes, const char* what) const;
  // Writes `bytes` of `data` under `key`, framed with op's header.
  void put(const Op& op, const std::string& key, const char* data, size_t bytes);
  // Waits (bounded by op's deadline, watching the abort and lost keys) until keys[i], written by
  // peers[i], all exist; throws naming the peers still missing.
  void await(const Op& op, const std::vector<std::string>& keys, const std::vector<int>& peers);
  // Reads the value of `key` written by `peer` into `out`, checking op and size.
  void take(const Op& op, const std::string& key, int peer, char* out, size_t bytes);
  // Call s has heard from every rank: erase what this rank wrote in earlier calls.
  void heard_from_all();
  std::string key(uint64_t seq, const std::string& rest) const;

  std::shared_ptr<Store> store_;
  std::string prefix_;
  uint64_t seq_ = 0;                 // collective calls so far
  std::vector<std::string> shared_;  // values others read, kept until heard_from_all()
  std::vector<std::string> shared_now_;
};

}  // namespace hp
