// Store: a small key-value table that the ranks of one job share, for rendezvous and rare control
// messages (the NCCL unique id, "everyone has joined", the reason a rank aborted, a step's few
// host scalars). It is the meeting point of launches without MPI, as c10d separates its stores
// from its process groups. It carries no tensors: a value holds at most kMaxValueBytes (64 KiB)
// and set() refuses a larger one; tensors move over NCCL (GPUs) or MPI (the CPU backend).
//
// Semantics, every implementation:
//  - set() replaces any earlier value of the key (the last writer wins); a reader sees one whole
//    value, never a mix of two. Values are opaque bytes, empty allowed, at most kMaxValueBytes:
//    a larger value is refused (Error kind kInternal naming the key, the size and the bound)
//    before anything is stored, and a TcpStore server drops a client that sends a larger frame.
//  - try_get() and check() answer at once; get() and wait() poll until the keys exist, bounded by
//    their timeout, and then throw hp::Error (kind kComm) naming this store's rank and every key
//    still missing: "rank 1: store (file:/shared/rdv.d/...) timed out after 5 s waiting for key
//    'ready'".
//  - erase() removes a key (no-op when absent); the store never removes keys by itself.
//  - Keys are non-empty and printable; '/' separates namespaces by convention.
//
// Implementations:
//  - FileStore: one file per key in a directory on a file system every rank sees. set() writes a
//    temporary file in the same directory and renames it over the key's file (atomic on POSIX
//    file systems, NFS included), so readers never see a partial value. Waits poll the file
//    system: an NFS client may not see another host's new file until its cached lookup expires
//    (seconds), so the file: bootstrap only publishes rank 0's TcpStore through a file.
//  - TcpStore: rank 0 serves the table from a thread of its own; the other ranks connect to it
//    (with retries until the timeout, so rank 0 may start last). One request at a time per
//    connection; waits poll from the client, so the server never blocks. A client that closes
//    its connection without saying goodbye (it crashed or exited early) makes the server set
//    kLostKey, naming the rank, so peers waiting on a dead rank can fail before their timeout.
//    The server outlives its owner's last use: its destructor keeps serving until every client
//    has left or the linger bound passes, so a fast rank 0 does not cut slower ranks off.
//  - HashStore: an in-process table for ranks run as threads (tests).
//
// Ownership: a store is shared (shared_ptr) by the communicators built on it and must outlive
// them. Thread safety: every method may be called from any thread at once.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace hp {

class Store {
 public:
  using Bytes = std::vector<uint8_t>;
  using Clock = std::chrono::steady_clock;

  // Set by a TcpStore server when a client vanishes; see above.
  static constexpr const char* kLostKey = "store/lost";
  // The largest value set() accepts: room for control messages (ids, flags, a step's scalars,
  // host names), far below any tensor of a model.
  static constexpr size_t kMaxValueBytes = size_t{64} * 1024;

  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  virtual void set(const std::string& key, const Bytes& value) = 0;
  // The key's value in *value; false (and *value untouched) when the key does not exist.
  virtual bool try_get(const std::string& key, Bytes* value) = 0;
  // One answer per key: whether it exists now.
  virtual std::vector<bool> check(const std::vector<std::string>& keys) = 0;
  virtual void erase(const std::string& key) = 0;
  // For a rank about to exit after a failure: a TcpStore server keeps serving until every client
  // has left or `bound` has passed, then stops (so the peers can read why this rank gives up);
  // other stores return at once.
  virtual void linger(std::chrono::milliseconds bound) { (void)bound; }

  // Blocks until `key` exists and returns its value; throws after `timeout` (see above).
  Bytes get(const std::string& key, std::chrono::milliseconds timeout);
  // Blocks until every key exists; throws after `timeout` naming the missing ones.
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);

  // The rank that owns this handle and where the store lives, for messages: "file:DIR",
  // "tcp:HOST:PORT", "hash".
  int rank() const { return rank_; }
  const std::string& where() const { return where_; }

 protected:
  Store(int rank, std::string where) : rank_(rank), where_(std::move(where)) {}
  // Throws Error(kInternal) naming the key, `bytes` and kMaxValueBytes when the value is larger.
  void check_value_size(const std::string& key, size_t bytes) const;

 private:
  int rank_;
  std::string where_;
};

// Sleeps between polls: 1 ms, doubling up to 16 ms.
class PollBackoff {
 public:
  void sleep();

 private:
  int ms_ = 1;
};

class FileStore final : public Store {
 public:
  // Keys live in `dir`, created (with missing parents) when absent. Throws Error(kIo) naming the
  // directory when it cannot be created or written.
  FileStore(std::string dir, int rank);

  void set(const std::string& key, const Bytes& value) override;
  bool try_get(const std::string& key, Bytes* value) override;
  std::vector<bool> check(const std::vector<std::string>& keys) override;
  void erase(const std::string& key) override;

  const std::string& dir() const { return dir_; }

 private:
  std::string path_of(const std::string& key) const;

  std::string dir_;
};

class TcpStore final : public Store {
 public:
  // Rank 0: serves on `port` of every IPv4 interface (0: an ephemeral port, see port()).
  // `linger` bounds how long the destructor waits for clients to leave. A port in use is a
  // UserError naming it.
  static std::shared_ptr<TcpStore> serve(int port, std::chrono::milliseconds linger);
  // Other ranks: connects to host:port, retrying until `timeout`. An unknown host is a UserError
  // naming it; no server within the timeout is an Error(kComm) naming host and port.
  static std::shared_ptr<TcpStore> connect(const std::string& host, int port, int rank,
                                           std::chrono::milliseconds timeout);
  ~TcpStore() override;

  void set(const std::string& key, const Bytes& value) override;
  bool try_get(const std::string& key, Bytes* value) override;
  std::vector<bool> check(const std::vector<std::string>& keys) override;
  void erase(const std::string& key) override;
  void linger(std::chrono::milliseconds bound) override;

  int port() const { return port_; }

 private:
  struct Server;
  TcpStore(int rank, std::string where, int port);
  // One request/response round trip over the client connection (mu_ held by the caller).
  Bytes call(uint8_t op, const std::vector<const Bytes*>& args);

  int port_ = 0;
  std::unique_ptr<Server> server_;  // rank 0
  std::mutex mu_;
  int fd_ = -1;  // client connection (other ranks)
};

class HashStore final : public Store {
 public:
  explicit HashStore(int rank = 0) : Store(rank, "hash") {}
  // Another handle on the same table, for rank `rank`.
  std::shared_ptr<HashStore> handle(int rank) const;

  void set(const std::string& key, const Bytes& value) override;
  bool try_get(const std::string& key, Bytes* value) override;
  std::vector<bool> check(const std::vector<std::string>& keys) override;
  void erase(const std::string& key) override;

 private:
  struct Table {
    std::mutex mu;
    std::map<std::string, Bytes> kv;
  };
  std::shared_ptr<Table> table_ = std::make_shared<Table>();
};

}  // namespace hp
