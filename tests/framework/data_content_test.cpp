// Data with nothing to learn is refused when it is opened: a token file whose every document is a
// lone EOT token (.bin: only EOT ids; .h5: only EOT ids or empty documents) would train to loss 0.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <vector>

#include "framework/core/error.h"
#include "framework/data/loader.h"
#include "framework/data/token_files.h"
#include "tests/common/fixtures.h"

namespace hp {
namespace {

using test::TempDir;

constexpr int32_t kEot = 15;

DataConfig file_config(const std::string& source) {
  DataConfig c;
  c.source = source;
  c.vocab_size = 16;
  c.eot_token = kEot;
  c.seq_len = 8;
  c.rows_per_batch = 2;
  return c;
}

std::string open_error(const std::string& source) {
  try {
    DataLoader::open(file_config(source));
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(DataContent, OnlyEotTokensAreRefused) {
  TempDir dir;
  const std::string bin = dir.file("eot.bin");
  write_bin_shard(bin, std::vector<int32_t>(100, kEot));
  const std::string h5 = dir.file("eot.h5");
  write_h5_tokens(h5, std::vector<std::vector<int32_t>>(20, std::vector<int32_t>{kEot}));
  const std::string empty_docs = dir.file("empty_docs.h5");
  write_h5_tokens(empty_docs, std::vector<int32_t>{kEot, kEot}, {0, 0, 1, 1, 2});
  for (const std::string& f : {bin, h5, empty_docs}) {
    const std::string m = open_error(f);
    EXPECT_NE(m.find(f), std::string::npos) << m;
    EXPECT_NE(m.find("nothing to learn"), std::string::npos) << m;
    EXPECT_NE(m.find("eot_token 15"), std::string::npos) << m;
  }
}

TEST(DataContent, OneContentTokenIsEnough) {
  TempDir dir;
  std::vector<int32_t> tokens(100, kEot);
  tokens[50] = 3;
  const std::string bin = dir.file("one.bin");
  write_bin_shard(bin, tokens);
  EXPECT_EQ(open_error(bin), "");
}

}  // namespace
}  // namespace hp
