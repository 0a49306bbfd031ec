// Checkpoint files and directories: chunking and row splits, write/read round trips (serial; the
// MPI-IO writer with its group in tests/parallel/mpi_checkpoint_group_test.cpp), attributes, damage
// detection (flipped byte, truncation, missing dataset, foreign file), the commit protocol's file
// names, `latest`, and retention.
#include "framework/checkpoint/checkpoint.h"

#include <gtest/gtest.h>
#include <hdf5.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "framework/core/error.h"
#include "tests/common/damaged_checkpoint.h"
#include "tests/common/fixtures.h"

namespace hp {
namespace {

using test::TempDir;

namespace fs = std::filesystem;

std::vector<float> iota_floats(size_t n, float start) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = start + 0.25f * static_cast<float>(i);
  return v;
}

// A small checkpoint: /params/w [6, 4] f32, /params/b [4] f64, /state/step, attributes.
void write_small(const std::string& path, const CheckpointGroup* group) {
  CheckpointWriter w(path, group);
  const std::vector<float> wv = iota_floats(24, 1000.0f);
  w.write_rows("/params/w", {6, 4}, DType::kF32, 2, RowRange{0, 6}, wv.data());
  const std::vector<double> bv{0.5, -1.5, 2.5, 3.25};
  w.write_rows("/params/b", {4}, DType::kF64, 4, RowRange{0, 4}, bv.data());
  w.write_i64("/state/step", {42}, true);
  w.set_attr("format", std::string(kCheckpointFormat));
  w.set_attr("format_version", kCheckpointVersion);
  w.set_attr("config", std::string("d_model = 8\n"));
  w.set_attr("layout", std::vector<int64_t>{4, 2, 2});
  w.close();
}

// 64-bit FNV-1a of n bytes (what CheckpointReader::verify digests), computed here on its own.
uint64_t fnv1a64(const void* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<const unsigned char*>(p)[i];
    h *= 1099511628211ull;
  }
  return h;
}

// HDF5's own error printing off while a test calls it directly.
class QuietHdf5 {
 public:
  QuietHdf5() {
    H5Eget_auto2(H5E_DEFAULT, &func_, &data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~QuietHdf5() { H5Eset_auto2(H5E_DEFAULT, func_, data_); }

 private:
  H5E_auto2_t func_ = nullptr;
  void* data_ = nullptr;
};

void expect_throws_with(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no exception";
  } catch (const std::exception& e) {
    for (const std::string& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << " lacks " << p;
  }
}

TEST(CheckpointFormat, ChunkRowsAndChunkAlignedSplits) {
  EXPECT_EQ(checkpoint_chunk_rows({8}, DType::kF32), 8);
  EXPECT_EQ(checkpoint_chunk_rows({100000, 1024}, DType::kF32), 4096);  // 16 MiB of 4 KiB rows
  EXPECT_EQ(checkpoint_chunk_rows({3, 1 << 24}, DType::kF32), 1);       // rows over 16 MiB
  for (int parts : {1, 2, 3, 4, 7}) {
    int64_t next = 0;
    for (int p = 0; p < parts; ++p) {
      const RowRange r = split_rows_by_chunk(10, 3, parts, p);
      EXPECT_EQ(r.begin, next);
      if (r.count > 0 && r.begin + r.count < 10) {
        EXPECT_EQ((r.begin + r.count) % 3, 0);
      }
      next = r.begin + r.count;
    }
    EXPECT_EQ(next, 10) << parts << " parts";
  }
}

void round_trip(const CheckpointGroup* group) {
  TempDir dir;
  const std::string path = dir.file("c.h5");
  write_small(path, group);
  CheckpointReader r(path);
  EXPECT_EQ(r.string_attr("config"), "d_model = 8\n");
  EXPECT_EQ(r.int_attr("format_version"), kCheckpointVersion);
  EXPECT_EQ(r.ints_attr("layout"), (std::vector<int64_t>{4, 2, 2}));
  EXPECT_EQ(r.read_i64("/state/step"), std::vector<int64_t>{42});
  const DatasetInfo w = r.info("/params/w");
  EXPECT_EQ(w.shape, (Shape{6, 4}));
  EXPECT_EQ(w.dtype, DType::kF32);
  EXPECT_EQ(w.chunk_rows, 2);
  EXPECT_TRUE(w.crc32c);
  EXPECT_FALSE(w.fletcher32);
  // Rows [2, 5) only, as a rank holding those experts would read them.
  std::vector<float> part(12);
  r.read_rows("/params/w", RowRange{2, 3}, DType::kF32, part.data());
  const std::vector<float> all = iota_floats(24, 1000.0f);
  EXPECT_EQ(part, std::vector<float>(all.begin() + 8, all.begin() + 20));
  // f64 on disk, read as f32 (HDF5 converts).
  std::vector<float> b(4);
  r.read_rows("/params/b", RowRange{0, 4}, DType::kF32, b.data());
  EXPECT_EQ(b, (std::vector<float>{0.5f, -1.5f, 2.5f, 3.25f}));
  std::vector<std::string> names;
  for (const DatasetInfo& d : r.datasets()) names.push_back(d.name);
  EXPECT_EQ(names, (std::vector<std::string>{"/params/b", "/params/w", "/state/step"}));
  EXPECT_TRUE(r.has_dataset("/params/w"));
  EXPECT_FALSE(r.has_dataset("/params/missing"));
  EXPECT_FALSE(r.has_dataset("/nogroup/x"));
  // verify() reads every chunk (checksums checked) and digests the stored bytes: the FNV-1a of
  // exactly what was written, and different for different data. (A damaged chunk: below.)
  EXPECT_EQ(r.verify("/params/w"), fnv1a64(all.data(), all.size() * sizeof(float)));
  const std::vector<double> bv{0.5, -1.5, 2.5, 3.25};
  EXPECT_EQ(r.verify("/params/b"), fnv1a64(bv.data(), bv.size() * sizeof(double)));
  EXPECT_NE(r.verify("/params/w"), r.verify("/params/b"));
}

TEST(CheckpointFormat, SerialRoundTrip) { round_trip(nullptr); }

// A dataset that is one chunk larger than HDF5's chunk cache (1 MiB), written whole, keeps its
// data (HDF5 1.10 dropped it under incremental chunk allocation).
TEST(CheckpointFormat, LargeSingleChunkDatasetRoundTrips) {
  TempDir dir;
  const std::string path = dir.file("big.h5");
  const int64_t rows = 512, cols = 1024;  // 2 MiB of f32
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.5f + static_cast<float>((i * 2654435761u) % 9973);
  {
    CheckpointWriter w(path, nullptr);
    w.write_rows("/params/big", {rows, cols}, DType::kF32, rows, RowRange{0, rows}, v.data());
    w.set_attr("format", std::string(kCheckpointFormat));
    w.set_attr("format_version", kCheckpointVersion);
    w.close();
  }
  CheckpointReader r(path);
  EXPECT_EQ(r.info("/params/big").chunk_rows, rows);
  std::vector<float> back(v.size());
  r.read_rows("/params/big", RowRange{0, rows}, DType::kF32, back.data());
  EXPECT_EQ(back, v);
}

TEST(CheckpointFormat, FlippedByteIsNamed) {
  TempDir dir;
  const std::string path = dir.file("c.h5");
  write_small(path, nullptr);
  uint64_t pristine = 0;
  EXPECT_NO_THROW(pristine = CheckpointReader(path).verify("/params/w"));
  // Find the stored bytes of element 13 of /params/w (chunk rows 2-3) and flip one.
  std::vector<char> bytes;
  {
    std::ifstream f(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  }
  const float needle = 1000.0f + 0.25f * 13;
  size_t at = std::string::npos;
  for (size_t i = 0; i + 4 <= bytes.size(); ++i)
    if (std::memcmp(bytes.data() + i, &needle, 4) == 0) at = i;
  ASSERT_NE(at, std::string::npos);
  bytes[at + 1] ^= 0x10;
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  CheckpointReader r(path);
  std::vector<float> rows(8);
  r.read_rows("/params/w", RowRange{0, 2}, DType::kF32, rows.data());  // other chunk: fine
  expect_throws_with(
      [&] {
        r.read_rows("/params/w", RowRange{2, 2}, DType::kF32, rows.data());
      },
      {path, "'/params/w'", "chunk 1", "CRC-32C"});
  expect_throws_with([&] { r.verify("/params/w"); }, {path, "'/params/w'"});
  EXPECT_NE(pristine, 0u);
  EXPECT_NO_THROW(r.verify("/params/b"));  // the other dataset is intact
  // A read of part of the damaged chunk, or with a conversion, checks the whole chunk.
  expect_throws_with(
      [&] {
        r.read_rows("/params/w", RowRange{3, 1}, DType::kF32, rows.data());
      },
      {path, "'/params/w'", "chunk 1"});
  std::vector<double> wide(8);
  expect_throws_with(
      [&] {
        r.read_rows("/params/w", RowRange{2, 2}, DType::kF64, wide.data());
      },
      {path, "'/params/w'", "chunk 1"});
  r.read_rows("/params/w", RowRange{0, 1}, DType::kF64, wide.data());  // chunk 0 is intact
  EXPECT_DOUBLE_EQ(wide[0], 1000.0);
}

TEST(CheckpointFormat, TruncatedMissingAndForeignFiles) {
  TempDir dir;
  const std::string path = dir.file("c.h5");
  write_small(path, nullptr);
  {
    CheckpointReader r(path);
    expect_throws_with([&] { r.info("/optim/w/m"); }, {path, "'/optim/w/m'", "missing"});
  }
  fs::resize_file(path, fs::file_size(path) / 2);
  expect_throws_with([&] { CheckpointReader r(path); }, {path, "truncated"});
  try {
    CheckpointReader r(dir.file("absent.h5"));
    ADD_FAILURE();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("absent.h5"), std::string::npos);
  }
  // An HDF5 file that is not a checkpoint.
  const std::string other = dir.file("other.h5");
  {
    CheckpointWriter w(other, nullptr);
    w.write_i64("/x", {1}, true);
    w.close();
  }
  try {
    CheckpointReader r(other);
    ADD_FAILURE();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("not a hotpath checkpoint"), std::string::npos);
  }
}

// Every dataset hotpath writes carries its checksums: one without them cannot be verified and is
// an error, whatever its type.
TEST(CheckpointFormat, ADatasetWithoutChecksumsIsAnError) {
  TempDir dir;
  const std::string path = dir.file("c.h5");
  write_small(path, nullptr);
  {
    QuietHdf5 quiet;
    const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    for (const char* name : {"/params/w", "/params/b", "/state/step"})
      ASSERT_GE(H5Adelete_by_name(f, name, "crc32c", H5P_DEFAULT), 0) << name;
    H5Fclose(f);
  }
  CheckpointReader r(path);
  std::vector<double> buf(24);
  for (const char* name : {"/params/w", "/params/b", "/state/step"}) {
    const DatasetInfo d = r.info(name);
    EXPECT_FALSE(d.crc32c);
    expect_throws_with(
        [&] {
          r.read_rows(name, RowRange{0, 1}, d.dtype, buf.data());
        },
        {path, std::string("'") + name + "'", "no checksum"});
    expect_throws_with([&] { r.verify(name); }, {path, "no checksum"});
  }
}

// datasets() walks the groups itself, each object once and to a bounded depth: a group linked
// into itself lists its datasets once, and groups nested past any checkpoint's depth (as a damaged
// file's links can make them, endlessly) are an error naming the file, not a walk without end.
TEST(CheckpointFormat, DatasetWalkEndsOnCyclesAndDeepNesting) {
  TempDir dir;
  const std::string path = dir.file("c.h5");
  auto write = [&](int depth) {
    {
      CheckpointWriter w(path, nullptr);
      const std::vector<float> v = iota_floats(4, 1.0f);
      w.write_rows("/params/w", {4}, DType::kF32, 4, RowRange{0, 4}, v.data());
      w.set_attr("format", std::string(kCheckpointFormat));
      w.set_attr("format_version", kCheckpointVersion);
      w.close();
    }
    const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    ASSERT_GE(H5Lcreate_hard(f, "/params", f, "/params/loop", H5P_DEFAULT, H5P_DEFAULT), 0);
    std::string g;
    for (int i = 0; i < depth; ++i) {
      g += "/g";
      const hid_t id = H5Gcreate2(f, g.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      ASSERT_GE(id, 0);
      H5Gclose(id);
    }
    H5Fclose(f);
  };
  write(3);
  {
    CheckpointReader r(path);
    std::vector<std::string> names;
    for (const DatasetInfo& d : r.datasets()) names.push_back(d.name);
    EXPECT_EQ(names, std::vector<std::string>{"/params/w"});
  }
  write(20);
  CheckpointReader r(path);
  try {
    r.datasets();
    ADD_FAILURE() << "no error for groups 20 levels deep";
  } catch (const UserError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find("deeper than 16 levels"), std::string::npos) << m;
  }
}

// Damaged metadata (a group's object header whose checksum fails) is corruption, not a
// missing dataset.
TEST(CheckpointFormat, DamagedMetadataIsCorruptionNotMissing) {
  TempDir dir;
  const std::string path = dir.file("c.h5");
  test::write_damaged_checkpoint(path);
  CheckpointReader r(path);
  for (const char* name :
       {"/params/a_rather_long_parameter_name", "/params/another_long_parameter_name"}) {
    try {
      r.info(name);
      ADD_FAILURE() << name << ": no error";
    } catch (const std::exception& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("corrupt"), std::string::npos) << m;
      EXPECT_EQ(m.find("missing"), std::string::npos) << m;
    }
  }
}

TEST(CheckpointDir, NamesCommitLatestAndRetention) {
  EXPECT_EQ(checkpoint_file_name(12), "step_00000012.h5");
  EXPECT_EQ(checkpoint_step_of("step_00000012.h5"), 12);
  EXPECT_EQ(checkpoint_step_of("step_12.h5"), 12);
  EXPECT_EQ(checkpoint_step_of("step_00000012.h5.tmp"), -1);
  EXPECT_EQ(checkpoint_step_of("step_.h5"), -1);
  EXPECT_EQ(checkpoint_step_of("step_1x.h5"), -1);
  EXPECT_EQ(checkpoint_step_of("latest"), -1);

  TempDir dir;
  const std::string d = dir.path();
  EXPECT_EQ(read_latest(d), "");
  EXPECT_TRUE(committed_steps(d).empty());
  for (int64_t s : {2, 4, 6}) {
    write_small(checkpoint_tmp_path(d, s), nullptr);
    commit_checkpoint(d, s);
    update_latest(d, s);
  }
  write_small(checkpoint_tmp_path(d, 8), nullptr);  // an interrupted save
  EXPECT_EQ(committed_steps(d), (std::vector<int64_t>{6, 4, 2}));
  EXPECT_EQ(read_latest(d), checkpoint_path(d, 6));
  EXPECT_FALSE(fs::exists(d + "/latest.tmp"));

  // Retention after committing 6 keeps {6, 4} and leaves the newer .tmp of step 8 alone.
  EXPECT_EQ(apply_retention(d, 2, 6), std::vector<std::string>{"step_00000002.h5"});
  EXPECT_EQ(committed_steps(d), (std::vector<int64_t>{6, 4}));
  EXPECT_TRUE(fs::exists(checkpoint_tmp_path(d, 8)));
  // Committing 10 removes the stale .tmp of 8 and, with keep_last=1, step 6 and 4.
  write_small(checkpoint_tmp_path(d, 10), nullptr);
  commit_checkpoint(d, 10);
  update_latest(d, 10);
  apply_retention(d, 1, 10);
  EXPECT_EQ(committed_steps(d), std::vector<int64_t>{10});
  EXPECT_FALSE(fs::exists(checkpoint_tmp_path(d, 8)));

  std::ofstream(d + "/latest") << "\x01garbage";
  expect_throws_with([&] { read_latest(d); }, {d + "/latest", "not the name of a committed"});
}

}  // namespace
}  // namespace hp
