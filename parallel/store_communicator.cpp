#include "parallel/store_communicator.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "framework/core/log.h"

namespace hp {
namespace {

struct Header {
  uint32_t magic;
  uint16_t op;
  uint16_t reserved;
  uint64_t bytes;
};
constexpr uint32_t kMagic = 0x43535048;  // "HPSC"
static_assert(StoreCommunicator::kMaxPayloadBytes + sizeof(Header) <= Store::kMaxValueBytes,
              "a full payload and its header fit one store value");
// How long abort() keeps a TcpStore server up for peers to read the reason: peers that poll see
// it within milliseconds; one that is busy elsewhere fails on its own timeout instead.
constexpr std::chrono::milliseconds kAbortLinger{10000};

}  // namespace

StoreCommunicator::StoreCommunicator(std::shared_ptr<Store> store, std::string prefix,
                                     std::string name, int rank, int size,
                                     std::vector<int> world_ranks, CommOptions options)
    : HostCommunicator(std::move(name), rank, size, std::move(world_ranks), options),
      store_(std::move(store)),
      prefix_(std::move(prefix)) {}

std::shared_ptr<StoreCommunicator> StoreCommunicator::single(const CommOptions& options) {
  return std::shared_ptr<StoreCommunicator>(
      new StoreCommunicator(nullptr, "world", "world", 0, 1, {0}, options));
}

std::shared_ptr<StoreCommunicator> StoreCommunicator::create_world(
    std::shared_ptr<Store> store, int rank, int world, const CommOptions& options,
    const std::function<bool()>& superseded) {
  HP_CHECK(store && world >= 1 && rank >= 0 && rank < world, "rank ", rank, " of ", world);
  std::vector<int> ranks(static_cast<size_t>(world));
  std::iota(ranks.begin(), ranks.end(), 0);
  std::shared_ptr<StoreCommunicator> c(
      new StoreCommunicator(store, "world", "world", rank, world, ranks, options));
  if (world == 1) return c;
  const Op op = c->begin(OpKind::kRendezvous);
  const int64_t mine = world;
  if (rank != 0) {
    c->put(op, str_cat("join/", rank), reinterpret_cast<const char*>(&mine), sizeof(mine));
    PollBackoff backoff;
    for (;;) {
      if (store->check({"ready"})[0]) break;
      if (superseded && superseded()) return nullptr;
      c->await(op, {}, {});  // fails on an abort, a lost rank or the deadline
      if (Clock::now() >= op.deadline) c->fail_timeout(op, {0}, true, __FILE__, __LINE__);
      backoff.sleep();
    }
  } else {
    std::vector<std::string> keys;
    std::vector<int> peers;
    for (int r = 1; r < world; ++r) {
      keys.push_back(str_cat("join/", r));
      peers.push_back(r);
    }
    c->await(op, keys, peers);
    std::string mismatch;
    for (int r = 1; r < world; ++r) {
      int64_t theirs = 0;
      c->take(op, keys[static_cast<size_t>(r - 1)], r, reinterpret_cast<char*>(&theirs),
              sizeof(theirs));
      store->erase(keys[static_cast<size_t>(r - 1)]);
      if (theirs != world && mismatch.empty()) {
        mismatch =
            str_cat("rank ", r, " was started with a world of ", theirs, " ranks and rank 0 with ",
                    world, ": give every rank the same WORLD_SIZE (or SLURM_NTASKS)");
      }
    }
    store->set("ready", Store::Bytes(mismatch.begin(), mismatch.end()));
  }
  const Store::Bytes ready = store->get("ready", options.timeout);
  if (!ready.empty()) {
    HP_USER_ERROR(ErrorKind::kUser, "rank ", rank,
                  ": rendezvous: ", std::string(ready.begin(), ready.end()));
  }
  return c;
}

std::string StoreCommunicator::key(uint64_t seq, const std::string& rest) const {
  return str_cat(prefix_, "/", seq, "/", rest);
}

void StoreCommunicator::put(const Op& op, const std::string& k, const char* data, size_t bytes) {
  if (bytes > kMaxPayloadBytes) refuse(op, bytes, "over the bound");
  Store::Bytes v(sizeof(Header) + bytes);
  const Header h{kMagic, static_cast<uint16_t>(op.kind), 0, bytes};
  std::memcpy(v.data(), &h, sizeof(h));
  if (bytes) std::memcpy(v.data() + sizeof(h), data, bytes);
  try {
    store_->set(k, v);
  } catch (const std::exception& e) {
    HP_COMM_FAIL(op, e.what());
  }
}

void StoreCommunicator::await(const Op& op, const std::vector<std::string>& keys,
                              const std::vector<int>& peers) {
  if (!store_) return;  // a world of one has nobody to wait for
  std::vector<std::string> ask = keys;
  ask.push_back(kAbortKey);
  ask.push_back(Store::kLostKey);
  PollBackoff backoff;
  for (;;) {
    std::vector<bool> have;
    try {
      have = store_->check(ask);
    } catch (const std::exception& e) {
      HP_COMM_FAIL(op, e.what());
    }
    for (size_t i = keys.size(); i < ask.size(); ++i) {
      Store::Bytes why;
      if (have[i] && store_->try_get(ask[i], &why)) {
        HP_COMM_FAIL(op, std::string(why.begin(), why.end()));
      }
    }
    std::vector<int> missing;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!have[i]) missing.push_back(peers[i]);
    }
    if (missing.empty()) return;
    if (Clock::now() >= op.deadline) HP_COMM_TIMEOUT(op, missing, true);
    backoff.sleep();
  }
}

void StoreCommunicator::take(const Op& op, const std::string& k, int peer, char* out,
                             size_t bytes) {
  Store::Bytes v;
  bool found = false;
  try {
    found = store_->try_get(k, &v);
  } catch (const std::exception& e) {
    HP_COMM_FAIL(op, e.what());
  }
  Header h{};
  if (!found || v.size() < sizeof(h)) {
    HP_COMM_FAIL(op, "message '", k, "' from rank ", world_rank(peer), " is missing or truncated");
  }
  std::memcpy(&h, v.data(), sizeof(h));
  if (h.magic != kMagic || h.bytes != v.size() - sizeof(h)) {
    HP_COMM_FAIL(op, "message '", k, "' from rank ", world_rank(peer), " is corrupt");
  }
  if (h.op != static_cast<uint16_t>(op.kind)) {
    HP_COMM_FAIL(op, "rank ", world_rank(peer), " sent a message of ",
                 op_name(static_cast<OpKind>(h.op)), " where this rank is in ", op_name(op.kind));
  }
  if (h.bytes != bytes) {
    HP_COMM_FAIL(op, "rank ", world_rank(peer), " sent ", h.bytes,
                 " bytes where this rank expects ", bytes);
  }
  if (bytes) std::memcpy(out, v.data() + sizeof(h), bytes);
}

void StoreCommunicator::heard_from_all() {
  for (const std::string& k : shared_) {
    try {
      store_->erase(k);
    } catch (const std::exception&) {
      // Left behind; the next call that needs the store reports the failure.
    }
  }
  shared_.swap(shared_now_);
  shared_now_.clear();
}

void StoreCommunicator::refuse(const Op& op, size_t bytes, const char* what) const {
  HP_FAIL(ErrorKind::kInternal, "rank ", world_rank(), ": ", op_name(op.kind), " on '", name(),
          "' of ", bytes, " bytes: ", what,
          "; the store communicator carries control messages only (at most ", kMaxPayloadBytes,
          " bytes per rank, no all-to-all, no point-to-point): tensors move over the device "
          "groups (NCCL) or MPI");
}

void StoreCommunicator::do_all_to_all(const Op& op, const char*,
                                      const std::vector<size_t>& send_bytes,
                                      const std::vector<size_t>&, char*, const std::vector<size_t>&,
                                      const std::vector<size_t>&) {
  size_t total = 0;
  for (size_t b : send_bytes) total += b;
  refuse(op, total, "a personalised exchange (all-to-all) of tensor rows");
}

void StoreCommunicator::do_all_gather(const Op& op, const char* send, size_t bytes, char* recv,
                                      const std::vector<size_t>& recv_bytes,
                                      const std::vector<size_t>& recv_displs) {
  if (bytes > kMaxPayloadBytes) refuse(op, bytes, "over the bound");
  const uint64_t s = seq_++;
  const int me = rank();
  if (bytes) std::memcpy(recv + recv_displs[static_cast<size_t>(me)], send, bytes);
  if (size() == 1) return;
  const std::string mine = key(s, std::to_string(me));
  put(op, mine, send, bytes);
  shared_now_.push_back(mine);
  std::vector<std::string> keys;
  std::vector<int> peers;
  for (int p = 0; p < size(); ++p) {
    if (p == me) continue;
    keys.push_back(key(s, std::to_string(p)));
    peers.push_back(p);
  }
  await(op, keys, peers);
  for (size_t i = 0; i < keys.size(); ++i) {
    const size_t q = static_cast<size_t>(peers[i]);
    take(op, keys[i], peers[i], recv + recv_displs[q], recv_bytes[q]);
  }
  heard_from_all();
}

void StoreCommunicator::do_broadcast(const Op& op, char* data, size_t bytes, int root) {
  if (bytes > kMaxPayloadBytes) refuse(op, bytes, "over the bound");
  const uint64_t s = seq_++;
  if (size() == 1) return;
  const std::string k = key(s, std::to_string(root));
  if (rank() == root) {
    put(op, k, data, bytes);
    shared_.push_back(k);  // erased once this rank hears from everyone in a later call
    return;
  }
  await(op, {k}, {root});
  take(op, k, root, data, bytes);
}

void StoreCommunicator::do_barrier(const Op& op) {
  const uint64_t s = seq_++;
  if (size() == 1) return;
  const std::string mine = key(s, std::to_string(rank()));
  put(op, mine, nullptr, 0);
  shared_now_.push_back(mine);
  std::vector<std::string> keys;
  std::vector<int> peers;
  for (int p = 0; p < size(); ++p) {
    if (p == rank()) continue;
    keys.push_back(key(s, std::to_string(p)));
    peers.push_back(p);
  }
  await(op, keys, peers);
  for (size_t i = 0; i < keys.size(); ++i) take(op, keys[i], peers[i], nullptr, 0);
  heard_from_all();
}

void StoreCommunicator::do_p2p(const Op& op, const std::vector<P2p>& ops) {
  size_t total = 0;
  for (const P2p& t : ops) total += t.bytes;
  refuse(op, total, "a point-to-point transfer");
}

std::shared_ptr<Communicator> StoreCommunicator::do_split(const Op&, int color,
                                                          const std::vector<int>& members,
                                                          const std::string& name) {
  if (members.empty()) return nullptr;
  std::vector<int> world_ranks;
  int me = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    world_ranks.push_back(world_rank(members[i]));
    if (members[i] == rank()) me = static_cast<int>(i);
  }
  HP_CHECK(me >= 0, "split: rank ", rank(), " is not among its group's members");
  return std::shared_ptr<Communicator>(
      new StoreCommunicator(store_, str_cat(prefix_, "/", seq_, ".c", color), name, me,
                            static_cast<int>(members.size()), world_ranks, options()));
}

void StoreCommunicator::abort(const std::string& reason) noexcept {
  try {
    log_error("rank ", world_rank(), ": aborting (communicator '", name(), "'): ", reason);
    mark_broken(str_cat("aborted: ", reason));
    if (store_ && !store_->check({kAbortKey})[0]) {
      const std::string v = str_cat("rank ", world_rank(), " aborted: ", reason);
      store_->set(kAbortKey, Store::Bytes(v.begin(), v.end()));
    }
    // A TcpStore server on this rank serves on until the peers have read the reason and left.
    if (store_) store_->linger(std::min(timeout(), kAbortLinger));
  } catch (...) {
    // Best effort: the peers time out instead.
  }
}

}  // namespace hp
