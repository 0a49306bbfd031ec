#include "parallel/process_groups.h"

namespace hp {

GroupLayout GroupLayout::make(int world, int ep_size) {
  HP_CHECK(world >= 1, "world size ", world);
  if (ep_size < 1 || world % ep_size != 0) {
    std::string valid;
    for (int d = 1; d <= world; ++d) {
      if (world % d == 0) valid += str_cat(valid.empty() ? "" : ", ", d);
    }
    HP_USER_ERROR(ErrorKind::kConfig, "ep_size=", ep_size, " does not divide the world size ",
                  world, ": the world is dp x ep, so ep_size must be one of ", valid);
  }
  GroupLayout l;
  l.world = world;
  l.ep_size = ep_size;
  l.dp_size = world / ep_size;
  return l;
}

std::vector<int> GroupLayout::ep_group(int rank) const {
  std::vector<int> g;
  g.reserve(static_cast<size_t>(ep_size));
  for (int i = 0; i < ep_size; ++i) g.push_back(dp_rank(rank) * ep_size + i);
  return g;
}

std::vector<int> GroupLayout::dp_group(int rank) const {
  std::vector<int> g;
  g.reserve(static_cast<size_t>(dp_size));
  for (int i = 0; i < dp_size; ++i) g.push_back(ep_rank(rank) + i * ep_size);
  return g;
}

ProcessGroups make_process_groups(std::shared_ptr<Communicator> world, int ep_size) {
  HP_CHECK(world != nullptr, "make_process_groups without a world communicator");
  GroupLayout layout = GroupLayout::make(world->size(), ep_size);
  const int r = world->rank();
  ProcessGroups g;
  g.dp_size = layout.dp_size;
  g.ep_size = layout.ep_size;
  g.dp_rank = layout.dp_rank(r);
  g.ep_rank = layout.ep_rank(r);
  // Key = rank: group ranks follow world order, which makes them dp_rank and ep_rank.
  g.ep = world->split(layout.dp_rank(r), r, "ep");
  g.dp = world->split(layout.ep_rank(r), r, "dp");
  g.node = world->split_by_host("node");
  g.world = std::move(world);
  HP_CHECK(g.ep->size() == g.ep_size && g.ep->rank() == g.ep_rank, "ep group of rank ", r);
  HP_CHECK(g.dp->size() == g.dp_size && g.dp->rank() == g.dp_rank, "dp group of rank ", r);
  return g;
}

}  // namespace hp
