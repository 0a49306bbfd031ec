// NodeLinkArbiter: the LinkArbiter (framework/backend/link_arbiter.h) of the ranks of one node.
//
// The ranks of the node group share one block of POSIX shared memory (named by node rank 0 and
// broadcast over the node communicator, unlinked once every rank has mapped it). It holds, per
// host link, the ranks on that link and a spinlock-guarded schedule, and per rank, request and
// grant counters per direction. A link's ranks come from `pcie_groups` ("0,1;2,3": node ranks
// 0 and 1 share a link, 2 and 3 another); empty means every rank of the node on one link.
//
// Scheduling, per link: at most `inflight` chunks are granted and not yet released. When capacity
// frees up (a request arrives, a chunk is released), the rank doing so hands out grants: pending
// reloads first, then pending offloads; within a direction round-robin over the link's ranks,
// starting after the rank granted last. So a rank that asks while the link is busy waits for at
// most one chunk per rank ahead of it in the round, however much the others queue.
// Waiting polls this rank's grant counter (sleeping briefly between polls), so no rank spends a
// core spinning; wait() throws hp::Error (kComm) after `timeout`.
//
// Ownership: the arbiter keeps the node communicator only during construction (a collective over
// it); the shared memory lives until the last rank's arbiter is destroyed.
// Thread safety: as LinkArbiter. If a rank dies holding a grant, its link stalls: the others'
// wait() then times out.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "framework/backend/link_arbiter.h"
#include "parallel/communicator.h"

namespace hp {

struct LinkOptions {
  bool enabled = false;   // link_arbiter=on|off; off: LocalLinkArbiter (the baseline)
  int64_t chunk_mib = 8;  // link_chunk_mib
  int inflight = 1;       // link_inflight: chunks in flight per link
  // pcie_groups: "auto" = ranks grouped by link_id, "0,1;2,3" (node ranks), "" = one link per
  // node.
  std::string pcie_groups = "auto";
  // This rank's host link (host_link_of_pci_device of its GPU; "" where unknown), for
  // pcie_groups=auto.
  std::string link_id;
  std::chrono::milliseconds timeout = CommOptions{}.timeout;  // bound on wait()

  int64_t chunk_bytes() const { return chunk_mib << 20; }
  // Throws a config error naming the offending key. pcie_groups is checked as far as it can be
  // without the node's size: rank numbers, each once, none left out below the largest.
  void validate() const;
};

// Parses `pcie_groups` for a node of `n_ranks`: the links, each a list of node ranks. Every
// rank 0..n_ranks-1 must appear exactly once; "" gives one link of all ranks. Throws a config
// error naming key `pcie_groups` and what is wrong.
std::vector<std::vector<int>> parse_pcie_groups(const std::string& text, int n_ranks);

// The host link of the PCI device `bus_id` ("0000:1b:00.0"): its root port, read from the device's
// path under `sysfs_devices` (normally /sys/bus/pci/devices), e.g. "pci0000:17/0000:17:01.0".
// Devices behind the same root port share that port's link to the CPU. "" when the path cannot
// be resolved (no sysfs, no such device, empty bus id).
std::string host_link_of_pci_device(const std::string& sysfs_devices, const std::string& bus_id);

// pcie_groups=auto: node ranks grouped by equal link ids (rank r has ids[r]), links in order of
// their lowest rank, as a pcie_groups string ("0,2;1,3"). When any id is "" (unknown topology),
// every rank goes on one link: sharing is then assumed, never ruled out.
std::string pcie_groups_from_link_ids(const std::vector<std::string>& ids);

// Jain's fairness index (sum x)^2 / (n * sum x^2) of non-negative shares: 1 when all are
// equal, 1/n when one takes everything; 1 for an empty or all-zero list.
double jain_fairness(const std::vector<double>& x);

class NodeLinkArbiter final : public LinkArbiter {
 public:
  // Collective over `node` (every rank of the node, same options).
  NodeLinkArbiter(Communicator& node, const LinkOptions& options);
  ~NodeLinkArbiter() override;
  NodeLinkArbiter(const NodeLinkArbiter&) = delete;
  NodeLinkArbiter& operator=(const NodeLinkArbiter&) = delete;

  int64_t chunk_bytes() const override { return chunk_bytes_; }
  LinkTicket request(CopyDirection dir, int64_t bytes) override;
  bool granted(LinkTicket& t) override;
  void wait(LinkTicket& t) override;
  void release(LinkTicket& t) override;
  void begin_step() override;
  // With link_ranks, link_bytes (since begin_step) and link_jain filled in.
  LinkArbiterStats stats() const override;

  // This rank's link: its node ranks, and the bytes each has released since construction (both
  // directions), in the same order. jain_fairness over differences of these gives a window's
  // fairness.
  const std::vector<int>& link_ranks() const { return link_ranks_; }
  std::vector<int64_t> link_bytes() const;
  // Requests of `dir` on this rank's link not granted yet (for tests and diagnostics).
  int64_t link_pending(CopyDirection dir) const;

  struct Shared;  // the layout in shared memory (link_arbiter.cpp)

 private:
  Shared* shared_ = nullptr;
  size_t shared_bytes_ = 0;
  int rank_ = 0;
  int link_ = 0;
  int inflight_ = 1;
  int64_t chunk_bytes_ = 0;
  std::chrono::milliseconds timeout_;
  std::vector<int> link_ranks_;
  std::vector<int64_t> link_bytes_at_step_;  // link_bytes() at begin_step()
  LinkStatsRecorder recorder_;
};

// The links the node's ranks share, as a pcie_groups string: options.pcie_groups itself, or for
// "auto" the groups found from every rank's link_id (collective over `node`; "" for a node of
// one rank). "" puts the whole node on one link.
std::string resolve_pcie_groups(Communicator& node, const LinkOptions& options);

// link_arbiter=off (or a node of one rank): LocalLinkArbiter; otherwise NodeLinkArbiter over
// `node` (collective over it; pcie_groups=auto is resolved there from every rank's link_id).
// Options are validated first, and with link_arbiter=on pcie_groups against the node's size, also
// for a node of one rank.
std::unique_ptr<LinkArbiter> make_link_arbiter(Communicator& node, const LinkOptions& options);

}  // namespace hp
