// The dp × ep layout arithmetic and its errors (single process; the multi-rank group tests live in
// multi_rank_test.cpp).
#include "parallel/process_groups.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "parallel/store_communicator.h"

namespace hp {
namespace {

TEST(GroupLayout, EpGroupsAreConsecutiveRanks) {
  GroupLayout l = GroupLayout::make(8, 4);
  EXPECT_EQ(l.dp_size, 2);
  EXPECT_EQ(l.ep_rank(6), 2);
  EXPECT_EQ(l.dp_rank(6), 1);
  EXPECT_EQ(l.ep_group(6), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(l.dp_group(6), (std::vector<int>{2, 6}));
  GroupLayout w4 = GroupLayout::make(4, 2);
  EXPECT_EQ(w4.ep_group(0), (std::vector<int>{0, 1}));
  EXPECT_EQ(w4.ep_group(3), (std::vector<int>{2, 3}));
  EXPECT_EQ(w4.dp_group(0), (std::vector<int>{0, 2}));
  EXPECT_EQ(w4.dp_group(3), (std::vector<int>{1, 3}));
}

TEST(GroupLayout, EveryRankInExactlyOneGroupOfEachKind) {
  for (int world : {1, 2, 6, 12}) {
    for (int ep = 1; ep <= world; ++ep) {
      if (world % ep) continue;
      GroupLayout l = GroupLayout::make(world, ep);
      for (int r = 0; r < world; ++r) {
        std::vector<int> e = l.ep_group(r), d = l.dp_group(r);
        ASSERT_EQ(static_cast<int>(e.size()), ep);
        ASSERT_EQ(static_cast<int>(d.size()), world / ep);
        // r sits at its ep_rank in the ep group and at its dp_rank in the dp group, and the two
        // groups meet in r only.
        EXPECT_EQ(e[static_cast<size_t>(l.ep_rank(r))], r);
        EXPECT_EQ(d[static_cast<size_t>(l.dp_rank(r))], r);
        for (int x : e) {
          EXPECT_EQ(l.ep_group(x), e);
          if (x != r) {
            EXPECT_EQ(std::count(d.begin(), d.end(), x), 0);
          }
        }
      }
    }
  }
}

TEST(GroupLayout, EpSizeMustDivideWorld) {
  for (auto bad : {std::pair<int, int>{4, 3}, {4, 0}, {4, -2}, {6, 4}, {4, 8}}) {
    try {
      GroupLayout::make(bad.first, bad.second);
      ADD_FAILURE() << "ep_size " << bad.second << " accepted for world " << bad.first;
    } catch (const UserError& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(str_cat("ep_size=", bad.second)), std::string::npos) << msg;
      EXPECT_NE(msg.find(str_cat("world size ", bad.first)), std::string::npos) << msg;
    }
  }
  try {
    GroupLayout::make(12, 5);
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("1, 2, 3, 4, 6, 12"), std::string::npos) << e.what();
  }
}

TEST(ProcessGroups, SingleRank) {
  ProcessGroups g = make_process_groups(StoreCommunicator::single(), 1);
  EXPECT_EQ(g.world->size(), 1);
  EXPECT_EQ(g.dp->size(), 1);
  EXPECT_EQ(g.ep->size(), 1);
  EXPECT_EQ(g.node->size(), 1);
  EXPECT_EQ(g.dp->name(), "dp");
  EXPECT_EQ(g.ep->name(), "ep");
  EXPECT_EQ(g.node->name(), "node");
  EXPECT_THROW(make_process_groups(StoreCommunicator::single(), 2), UserError);
}

}  // namespace
}  // namespace hp
