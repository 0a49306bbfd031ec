// Process groups: the world split into data-parallel (dp) and expert-parallel (ep) groups, and
// the ranks sharing a host (node).
//
// Layout: world = dp × ep, and ep groups are runs of consecutive world ranks:
//   ep_rank = rank % ep_size      (position inside the ep group: which block of experts)
//   dp_rank = rank / ep_size      (which replica of the expert shards)
//   ep group of rank r: ranks [dp_rank * ep_size, (dp_rank + 1) * ep_size)
//   dp group of rank r: ranks ep_rank, ep_rank + ep_size, ep_rank + 2 * ep_size, ...
// Consecutive ranks usually share a node, so the all-to-all of an expert exchange stays on the
// fastest links while the dp all-reduce crosses nodes. Dense gradients are all-reduced over
// world, expert gradients over dp. Example, world 4, ep_size 2: ep groups {0,1} {2,3}, dp groups
// {0,2} {1,3}.
//
// Ownership: the groups are shared_ptrs; any of them may outlive the others.
// Thread safety: building groups is a collective over world (every rank, same ep_size).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace hp {

// The pure arithmetic of the layout; throws UserError unless ep_size divides world.
struct GroupLayout {
  int world = 1;
  int ep_size = 1;
  int dp_size = 1;

  static GroupLayout make(int world, int ep_size);

  int ep_rank(int rank) const { return rank % ep_size; }
  int dp_rank(int rank) const { return rank / ep_size; }
  // World ranks of the groups that `rank` belongs to, in group-rank order.
  std::vector<int> ep_group(int rank) const;
  std::vector<int> dp_group(int rank) const;
};

struct ProcessGroups {
  std::shared_ptr<Communicator> world;
  std::shared_ptr<Communicator> dp;    // ranks holding the same experts (size dp_size)
  std::shared_ptr<Communicator> ep;    // ranks splitting the experts (size ep_size)
  std::shared_ptr<Communicator> node;  // ranks on this host
  int dp_size = 1;
  int ep_size = 1;
  int dp_rank = 0;  // == dp->rank()
  int ep_rank = 0;  // == ep->rank()
};

// Collective over `world`: splits it into the groups above. Throws UserError naming ep_size and
// the world size when ep_size does not divide the world.
ProcessGroups make_process_groups(std::shared_ptr<Communicator> world, int ep_size);

}  // namespace hp
