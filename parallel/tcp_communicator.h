// TcpCommunicator: host-tensor communicator over TCP sockets, for launches without MPI
// (RANK/WORLD_SIZE, or srun without --mpi) and for tests that run ranks as threads.
//
// Topology: a full mesh, one connection per pair of ranks (host tensors are small; every
// collective is a direct exchange). The world mesh is made by a rendezvous through rank 0:
//   - "file:PATH": rank 0 listens on an ephemeral port and writes "host:port" to PATH atomically
//     (temporary file + rename); the others poll PATH until it appears. PATH must be on a file
//     system all ranks see; rank 0 removes it once everyone has joined. The host written is the
//     first non-loopback IPv4 address of this host name, or HOTPATH_RENDEZVOUS_HOST when set.
//   - "tcp:HOST:PORT": rank 0 listens on PORT (all interfaces); the others connect to HOST:PORT.
// Every other rank listens on an ephemeral port of its own, connects to rank 0 and introduces
// itself; rank 0 replies with every rank's address as it saw it; then each rank connects to every
// lower rank and accepts every higher one. split() builds an independent mesh for each new
// group the same way, exchanging addresses over the parent. IPv4 only.
//
// Wire format: every message is a 16-byte header (magic, kind, operation, payload bytes) and the
// payload, so a rank that calls a different operation, or passes a different size than its peer,
// gets an error naming that peer instead of corrupt data. Zero-byte messages are still sent: a
// message from every peer is how a collective knows every peer has arrived.
//
// Failures: every socket call is checked and errors name the peer rank; waits use poll() against
// the call's deadline and a timeout names the ranks not heard from. A peer that exits or crashes
// closes its sockets, which fails the waiting calls at once. abort() sends an abort message with
// the reason to every peer it can, then closes every connection: peers blocked on this rank fail
// with "rank R aborted: <reason>" and abort in turn.
//
// Ownership: the communicator owns its sockets and closes them on destruction.
// Thread safety: different TcpCommunicators share nothing and may be driven by different threads
// at once; one communicator is driven by one thread at a time.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "parallel/host_communicator.h"
#include "parallel/launch_env.h"

namespace hp {

class TcpCommunicator final : public HostCommunicator {
 public:
  // Rendezvous of `world` processes (or threads) named "world"; blocks until every rank has
  // joined and the mesh is complete, or throws after options.timeout. `bootstrap` is kFile or
  // kTcp, the same on every rank. Throws UserError on a misconfiguration that one rank can see
  // (unusable PATH or PORT, two processes with one rank, disagreeing world sizes).
  static std::shared_ptr<TcpCommunicator> connect_world(const Bootstrap& bootstrap, int rank,
                                                        int world, const CommOptions& options = {});
  // A world of one rank: no sockets, every collective is a local copy.
  static std::shared_ptr<TcpCommunicator> single(const CommOptions& options = {});

  ~TcpCommunicator() override;

  void abort(const std::string& reason) noexcept override;

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
  struct Transfer;

  TcpCommunicator(std::string name, int rank, int size, std::vector<int> world_ranks,
                  CommOptions options, std::vector<int> fds);

  // Runs the transfers (several per peer run in order) until all are done.
  void run(const Op& op, std::vector<Transfer>& transfers);
  bool progress_send(const Op& op, Transfer& t);
  bool progress_recv(const Op& op, Transfer& t);
  [[noreturn]] void fail_abort_message(const Op& op, int peer, size_t bytes);
  // A peer is gone: fails with an abort message waiting on any link, else with `what`.
  [[noreturn]] void fail_lost_peer(const Op& op, const std::string& what);
  void close_all() noexcept;

  std::vector<int> fds_;          // socket per rank; -1 for this rank
  std::vector<char> dirty_;       // a message was left half-sent: an abort message would garble it
  std::vector<char> rx_partial_;  // a message is half-received: the link is mid-stream
  uint64_t splits_ = 0;           // splits made so far (same count on every rank)
};

}  // namespace hp
