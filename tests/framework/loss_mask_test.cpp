// The HDF5 token file's /loss_mask: packing turns the targets of masked-out tokens into ignored
// ones (-1), everything else as without a mask; bad masks are refused naming the dataset.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "framework/core/error.h"
#include "framework/data/loader.h"
#include "framework/data/token_files.h"

namespace hp {
namespace {

struct Dir {
  std::string path;
  Dir() {
    char t[] = "/tmp/hp_mask_XXXXXX";
    path = mkdtemp(t);
  }
  ~Dir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& n) const { return path + "/" + n; }
};

DataConfig config(const std::string& source) {
  DataConfig c;
  c.source = source;
  c.vocab_size = 50;
  c.eot_token = 49;
  c.seq_len = 24;
  c.rows_per_batch = 4;
  c.shuffle = false;
  return c;
}

TEST(LossMask, MaskedTargetsAreIgnoredAndTheRestUnchanged) {
  Dir dir;
  std::mt19937 rng(7);
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets{0};
  std::vector<uint8_t> mask;
  for (int d = 0; d < 40; ++d) {
    const int len = 3 + static_cast<int>(rng() % 30);  // some longer than a row: cut
    for (int k = 0; k < len; ++k) {
      tokens.push_back(static_cast<int32_t>(rng() % 49));
      mask.push_back(static_cast<uint8_t>(rng() % 2));
    }
    if (d % 3 != 0) {  // every third document without its EOT (appended with the last mask)
      tokens.push_back(49);
      mask.push_back(1);
    }
    offsets.push_back(static_cast<int64_t>(tokens.size()));
  }
  write_h5_tokens(dir.file("plain.h5"), tokens, offsets);
  write_h5_tokens(dir.file("masked.h5"), tokens, offsets, &mask);
  auto plain = DataLoader::open(config(dir.file("plain.h5")));
  auto masked = DataLoader::open(config(dir.file("masked.h5")));
  EXPECT_NE(masked->source().describe().find("loss mask"), std::string::npos);
  // The mask of every token in document order, appended EOTs included, to follow the stream.
  std::vector<uint8_t> stream_mask;
  for (size_t d = 0; d + 1 < offsets.size(); ++d) {
    for (int64_t k = offsets[d]; k < offsets[d + 1]; ++k) stream_mask.push_back(mask[k]);
    if (tokens[offsets[d + 1] - 1] != 49) stream_mask.push_back(mask[offsets[d + 1] - 1]);
  }
  int64_t dropped = 0;
  for (int b = 0; b < 6; ++b) {
    const PackedBatch x = plain->next(), y = masked->next();
    ASSERT_EQ(x.inputs, y.inputs);
    ASSERT_EQ(x.positions, y.positions);
    ASSERT_EQ(x.cu_seqlens, y.cu_seqlens);
    for (size_t i = 0; i < x.targets.size(); ++i) {
      if (x.targets[i] < 0) {
        EXPECT_EQ(y.targets[i], -1) << i;  // ignored stays ignored
      } else if (y.targets[i] != x.targets[i]) {
        EXPECT_EQ(y.targets[i], -1) << i;  // only ever dropped, never changed
        ++dropped;
      }
    }
    EXPECT_EQ(y.num_valid_targets,
              std::count_if(y.targets.begin(), y.targets.end(), [](int32_t t) { return t >= 0; }));
  }
  EXPECT_GT(dropped, 0);
  // The first row, by hand: documents packed from the start, each target kept iff its mask is 1.
  auto again = DataLoader::open(config(dir.file("masked.h5")));
  auto ref = DataLoader::open(config(dir.file("plain.h5")));
  const PackedBatch y = again->next(), x = ref->next();
  // Row 0 starts with document 0 at stream offset 0; while it lasts, target i is token i + 1.
  const int64_t first_len = offsets[1] - offsets[0] + (tokens[offsets[1] - 1] != 49);
  for (int64_t i = 0; i + 1 < std::min<int64_t>(first_len, 25); ++i)
    EXPECT_EQ(y.targets[i], stream_mask[i + 1] ? x.targets[i] : -1) << i;
}

TEST(LossMask, BadMasksAreRefusedNamingTheDataset) {
  Dir dir;
  const std::vector<int32_t> tokens = {1, 2, 3, 49};
  const std::vector<int64_t> offsets = {0, 4};
  const std::vector<uint8_t> two = {0, 1, 2, 1}, short_mask = {1, 1};
  write_h5_tokens(dir.file("two.h5"), tokens, offsets, &two);
  write_h5_tokens(dir.file("short.h5"), tokens, offsets, &short_mask);
  try {
    DataLoader::open(config(dir.file("two.h5")));
    ADD_FAILURE() << "a mask entry of 2 was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("/loss_mask[2] = 2"), std::string::npos) << e.what();
  }
  try {
    DataLoader::open(config(dir.file("short.h5")));
    ADD_FAILURE() << "a short mask was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("has 2 entries"), std::string::npos) << e.what();
  }
}

// Adds /loss_mask of HDF5 type `type` holding `values` to an existing token file.
void add_mask(const std::string& path, hid_t type, const std::vector<int64_t>& values) {
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  const hsize_t n[1] = {values.size()};
  const hid_t space = H5Screate_simple(1, n, nullptr);
  const hid_t ds = H5Dcreate2(f, "/loss_mask", type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(ds, 0);
  ASSERT_GE(H5Dwrite(ds, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), 0);
  H5Dclose(ds);
  H5Sclose(space);
  H5Fclose(f);
}

std::string open_error(const std::string& path) {
  try {
    DataLoader::open(config(path));
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// Masks are read as stored, not converted to uint8 (which clips -1 to 0 and 300 to 255): a
// value other than 0 or 1 is named with its index and the file.
TEST(LossMask, ValuesOtherThanZeroOrOneAreRefusedNotClipped) {
  Dir dir;
  std::mt19937 rng(11);
  std::vector<int32_t> tokens;
  for (int k = 0; k < 63; ++k) tokens.push_back(static_cast<int32_t>(rng() % 49));
  tokens.push_back(49);
  const std::vector<int64_t> offsets = {0, 20, 64};
  std::vector<int64_t> mask;
  for (size_t k = 0; k < tokens.size(); ++k) mask.push_back(static_cast<int64_t>(rng() % 2));
  mask[0] = 1;
  struct Case {
    const char* name;
    hid_t type;
    int64_t value;
  };
  for (const Case& c : {Case{"minus_one.h5", H5T_STD_I8LE, -1}, Case{"big.h5", H5T_STD_I16LE, 300},
                        Case{"two.h5", H5T_STD_U8LE, 2}}) {
    const std::string path = dir.file(c.name);
    write_h5_tokens(path, tokens, offsets);
    std::vector<int64_t> bad = mask;
    bad[37] = c.value;
    add_mask(path, c.type, bad);
    const std::string m = open_error(path);
    EXPECT_NE(m.find("/loss_mask[37] = " + std::to_string(c.value) + " in " + path),
              std::string::npos)
        << c.name << ": " << (m.empty() ? "accepted" : m);
  }
  // The same mask without the bad entry, stored as int16, is read as it is.
  const std::string good = dir.file("good.h5");
  write_h5_tokens(good, tokens, offsets);
  add_mask(good, H5T_STD_I16LE, mask);
  EXPECT_EQ(open_error(good), "");
}

TEST(LossMask, AMaskThatSelectsNothingIsRefused) {
  Dir dir;
  const std::vector<int32_t> tokens = {5, 9, 3, 49, 7, 8, 49};
  const std::vector<int64_t> offsets = {0, 4, 7};
  const std::vector<uint8_t> zeros(tokens.size(), 0);
  const std::string path = dir.file("nothing.h5");
  write_h5_tokens(path, tokens, offsets, &zeros);
  const std::string m = open_error(path);
  EXPECT_NE(m.find("dataset /loss_mask of " + path + " selects nothing"), std::string::npos)
      << (m.empty() ? "accepted" : m);
}

}  // namespace
}  // namespace hp
