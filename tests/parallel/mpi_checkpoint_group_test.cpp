// The MPI side of collective checkpoint writes: make_checkpoint_group gives a group for MPI
// communicators only, and a writer over it (parallel HDF5 over MPI-IO, checksums reduced over
// the group) writes a file that reads back like a serial one: in one process, and (label mpi)
// on 2 and 3 ranks, each writing its own chunks.
#include "parallel/mpi_checkpoint_group.h"

#include <gtest/gtest.h>
#include <mpi.h>
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "framework/checkpoint/checkpoint.h"
#include "parallel/mpi_communicator.h"
#include "parallel/store_communicator.h"
#include "tests/common/mpi_case.h"

namespace hp {
namespace {

TEST(CheckpointGroup, OnlyMpiCommunicatorsGiveAGroup) {
  EXPECT_EQ(make_checkpoint_group(*StoreCommunicator::single()), nullptr);
  std::shared_ptr<MpiCommunicator> world = MpiCommunicator::create(MPI_COMM_WORLD, "world");
  EXPECT_NE(make_checkpoint_group(*world), nullptr);
}

void expect_bitwise_or_over_the_world() {
  std::shared_ptr<MpiCommunicator> world = MpiCommunicator::create(MPI_COMM_WORLD, "world");
  const std::unique_ptr<CheckpointGroup> group = make_checkpoint_group(*world);
  ASSERT_NE(group, nullptr);
  // Each rank sets its own bit of word 0 and keeps word 1: the OR has every rank's bit.
  std::vector<uint32_t> words{1u << (world->rank() % 32), 0xa5a5a5a5u};
  group->bitwise_or(words.data(), words.size());
  uint32_t all = 0;
  for (int r = 0; r < world->size(); ++r) all |= 1u << (r % 32);
  EXPECT_EQ(words[0], all);
  EXPECT_EQ(words[1], 0xa5a5a5a5u);
}

void expect_parallel_writer_round_trips() {
  std::shared_ptr<MpiCommunicator> world = MpiCommunicator::create(MPI_COMM_WORLD, "world");
  const std::unique_ptr<CheckpointGroup> group = make_checkpoint_group(*world);
  ASSERT_NE(group, nullptr);
  // One file for the whole world: rank 0 names the directory.
  char name[64] = {};
  if (world->rank() == 0) {
    char tmpl[] = "/tmp/hp_ckpt_group_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    std::snprintf(name, sizeof name, "%s", tmpl);
  }
  MPI_Bcast(name, sizeof name, MPI_CHAR, 0, world->comm());
  const std::string path = std::string(name) + "/c.h5";
  const std::vector<float> all = [] {
    std::vector<float> v(24);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 1000.0f + 0.25f * static_cast<float>(i);
    return v;
  }();
  {
    CheckpointWriter w(path, group.get());
    EXPECT_TRUE(w.parallel());
    // Rows of /params/w [6, 4] in chunks of 2 rows, split over the ranks on chunk boundaries.
    const RowRange rows = split_rows_by_chunk(6, 2, world->size(), world->rank());
    w.write_rows("/params/w", {6, 4}, DType::kF32, 2, rows, all.data() + rows.begin * 4);
    w.write_i64("/state/step", {42}, world->rank() == 0);
    w.set_attr("format", std::string(kCheckpointFormat));
    w.set_attr("format_version", kCheckpointVersion);
    w.close();
  }
  MPI_Barrier(world->comm());
  {
    CheckpointReader r(path);
    EXPECT_EQ(r.read_i64("/state/step"), std::vector<int64_t>{42});
    const DatasetInfo d = r.info("/params/w");
    EXPECT_EQ(d.shape, (Shape{6, 4}));
    EXPECT_EQ(d.chunk_rows, 2);
    EXPECT_TRUE(d.crc32c);
    std::vector<float> back(24);
    r.read_rows("/params/w", RowRange{0, 6}, DType::kF32, back.data());  // checksums verified
    EXPECT_EQ(back, all);
  }
  MPI_Barrier(world->comm());
  if (world->rank() == 0) {
    std::error_code ec;
    std::filesystem::remove_all(name, ec);
  }
}

TEST(CheckpointGroup, BitwiseOrOverTheGroup) { expect_bitwise_or_over_the_world(); }
TEST(CheckpointGroup, ParallelWriterRoundTrips) { expect_parallel_writer_round_trips(); }

HP_MPI_TEST(CheckpointGroupMulti, BitwiseOrOverTheGroup, 2, 3) {
  expect_bitwise_or_over_the_world();
}
HP_MPI_TEST(CheckpointGroupMulti, ParallelWriterRoundTrips, 2, 3) {
  expect_parallel_writer_round_trips();
}

}  // namespace
}  // namespace hp
