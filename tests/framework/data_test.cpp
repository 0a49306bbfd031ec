// Data layer: PackedBatch metadata, packing, the three sources, global order, resume, errors.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <set>
#include <string>
#include <vector>

#include "framework/core/error.h"
#include "framework/data/loader.h"
#include "framework/data/packed_batch.h"
#include "framework/data/synthetic.h"
#include "framework/data/token_files.h"
#include "tests/common/fixtures.h"

namespace hp {
namespace {

using test::expect_same_batch;
using test::TempDir;

constexpr int32_t kE = 63;  // EOT of the small-vocab tests (vocab 64)

DataConfig small_config() {
  DataConfig c;
  c.vocab_size = 64;
  c.eot_token = kE;
  c.seq_len = 32;
  c.rows_per_batch = 8;
  c.seed = 7;
  c.synthetic_vocab = 63;
  c.synthetic_mean_doc_len = 24;
  return c;
}

std::vector<int32_t> flatten(const std::vector<std::vector<int32_t>>& docs) {
  std::vector<int32_t> out;
  for (const auto& d : docs) out.insert(out.end(), d.begin(), d.end());
  return out;
}

// The batch of all ranks' rows, in rank order (what one rank would hold with world size 1).
PackedBatch concat(const std::vector<PackedBatch>& parts) {
  PackedBatch out;
  out.seq_len = parts.front().seq_len;
  out.cu_seqlens.push_back(0);
  for (const auto& p : parts) {
    const int32_t base = static_cast<int32_t>(out.rows * out.seq_len);
    out.rows += p.rows;
    out.inputs.insert(out.inputs.end(), p.inputs.begin(), p.inputs.end());
    out.targets.insert(out.targets.end(), p.targets.begin(), p.targets.end());
    out.positions.insert(out.positions.end(), p.positions.begin(), p.positions.end());
    for (size_t s = 1; s < p.cu_seqlens.size(); ++s)
      out.cu_seqlens.push_back(base + p.cu_seqlens[s]);
    out.seq_is_pad.insert(out.seq_is_pad.end(), p.seq_is_pad.begin(), p.seq_is_pad.end());
    out.num_doc_tokens += p.num_doc_tokens;
    out.max_seqlen = std::max(out.max_seqlen, p.max_seqlen);
    out.num_valid_targets += p.num_valid_targets;
  }
  return out;
}

// Runs fn, expects a UserError whose message contains every one of `facts`.
void expect_user_error(const std::function<void()>& fn, std::initializer_list<std::string> facts) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one mentioning " << *facts.begin();
  } catch (const UserError& e) {
    const std::string msg = e.what();
    for (const auto& f : facts)
      EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a UserError: " << e.what();
  }
}

// ---- PackedBatch ---------------------------------------------------------------------------

TEST(PackedBatch, FromRowsHandChecked) {
  const int64_t T = 8;
  std::vector<PackedRow> rows(4);
  // Two whole documents, then 2 pad tokens (the pad segment keeps one input position).
  rows[0] = {{5, 6, kE, 7, 8, 9, kE, kE, kE}, {3, 4}, 2, {}};
  // A full-row piece of a long document: every target is inside it.
  rows[1] = {{1, 2, 3, 4, 5, 6, 7, 8, 9}, {9}, 0, {}};
  // A document whose last token is row[T]: its segment is clipped at T, its last input predicts
  // row[T] normally.
  rows[2] = {{4, kE, 10, 11, 12, 13, 14, 15, 16}, {2, 7}, 0, {}};
  // A one-token segment at row[T] has no input position: it is dropped from cu_seqlens.
  rows[3] = {{20, 21, 22, 23, 24, 25, 26, kE, 30}, {8, 1}, 0, {}};
  const PackedBatch b = PackedBatch::from_rows(rows, T);

  EXPECT_EQ(b.rows, 4);
  EXPECT_EQ(b.seq_len, T);
  const int32_t I = -1;
  EXPECT_EQ(b.inputs, (std::vector<int32_t>{5,  6,  kE, 7,  8,  9,  kE, kE,  //
                                            1,  2,  3,  4,  5,  6,  7,  8,   //
                                            4,  kE, 10, 11, 12, 13, 14, 15,  //
                                            20, 21, 22, 23, 24, 25, 26, kE}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{6,  kE, I,  8,  9,  kE, I,  I,   //
                                             2,  3,  4,  5,  6,  7,  8,  9,   //
                                             kE, I,  11, 12, 13, 14, 15, 16,  //
                                             21, 22, 23, 24, 25, 26, kE, I}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 3, 0,  //
                                               0, 1, 2, 3, 4, 5, 6, 7,  //
                                               0, 1, 0, 1, 2, 3, 4, 5,  //
                                               0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(b.cu_seqlens, (std::vector<int32_t>{0, 3, 7, 8, 16, 18, 24, 32}));
  EXPECT_EQ(b.num_seqs(), 7);
  EXPECT_EQ(b.max_seqlen, 8);
  EXPECT_EQ(b.num_valid_targets, 5 + 8 + 7 + 7);
  EXPECT_EQ(b.num_tokens(), 32);
}

TEST(PackedBatch, FromRowsPadOfOneAndMalformedRows) {
  // pad == 1 lives only in row[T]: no pad segment among the inputs.
  const PackedBatch b = PackedBatch::from_rows({{{1, 2, kE, 3, 4, 5, kE, kE}, {3, 4}, 1, {}}}, 7);
  EXPECT_EQ(b.cu_seqlens, (std::vector<int32_t>{0, 3, 7}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{2, kE, -1, 4, 5, kE, -1}));
  EXPECT_EQ(b.num_valid_targets, 5);

  EXPECT_THROW(PackedBatch::from_rows({{{1, 2, 3}, {3}, 0, {}}}, 3), Error);     // T+1 = 4 tokens
  EXPECT_THROW(PackedBatch::from_rows({{{1, 2, 3, 4}, {2}, 1, {}}}, 3), Error);  // covers 3 of 4
  EXPECT_THROW(PackedBatch::from_rows({{{1, 2, 3, 4}, {0, 4}, 0, {}}}, 3), Error);  // empty segment
}

TEST(PackedBatch, FromTokensMatchesFromRows) {
  std::vector<PackedRow> rows = {{{5, 6, kE, 7, 8, 9, kE, kE, kE}, {3, 4}, 2, {}},
                                 {{1, 2, 3, 4, 5, 6, 7, 8, 9}, {9}, 0, {}}};
  const PackedBatch a = PackedBatch::from_rows(rows, 8);
  PackedBatch b = PackedBatch::from_tokens(a.inputs, a.targets, a.positions, 8);
  // Flat arrays carry no padding: from_tokens counts every position as a document token.
  EXPECT_EQ(a.num_doc_tokens, 15);
  EXPECT_EQ(b.num_doc_tokens, 16);
  EXPECT_EQ(b.seq_is_pad, (std::vector<uint8_t>{0, 0, 0, 0}));
  b.num_doc_tokens = a.num_doc_tokens;
  b.seq_is_pad = a.seq_is_pad;
  expect_same_batch(a, b, "from_tokens(from_rows)");

  // A row must start a sequence; positions count up by one inside a sequence.
  EXPECT_THROW(PackedBatch::from_tokens({1, 2, 3, 4}, {2, 3, 4, 5}, {0, 1, 2, 3}, 2), Error);
  EXPECT_THROW(PackedBatch::from_tokens({1, 2, 3, 4}, {2, 3, 4, 5}, {0, 1, 3, 4}, 4), Error);
  EXPECT_THROW(PackedBatch::from_tokens({1, 2, 3}, {2, 3, 4}, {0, 1, 2}, 2), Error);
}

TEST(PackedBatch, AttentionPairs) {
  // Sequences of 3, 4 and 1 tokens.
  const PackedBatch b = PackedBatch::from_tokens(
      {1, 2, 3, 4, 5, 6, 7, 8}, std::vector<int32_t>(8, -1), {0, 1, 2, 0, 1, 2, 3, 0}, 8);
  EXPECT_EQ(b.cu_seqlens, (std::vector<int32_t>{0, 3, 7, 8}));
  EXPECT_DOUBLE_EQ(b.attention_pairs(0), 6 + 10 + 1);
  EXPECT_DOUBLE_EQ(b.attention_pairs(2), (1 + 2 + 2) + (1 + 2 + 2 + 2) + 1);
  EXPECT_DOUBLE_EQ(b.attention_pairs(4), 6 + 10 + 1);
  EXPECT_EQ(b.num_valid_targets, 0);
}

// ---- Loader: packing -----------------------------------------------------------------------

// The packings row by row: tests/framework/packing_test.cpp.

TEST(DataLoader, SyntheticRowsAreWellFormed) {
  DataConfig c = small_config();
  c.synthetic_mean_doc_len = 40;  // some documents are cut (T+1 = 33)
  auto loader = DataLoader::open(c);
  int64_t cut_rows = 0;
  for (int k = 0; k < 20; ++k) {
    const PackedBatch b = loader->next();
    ASSERT_EQ(b.rows, 8);
    ASSERT_EQ(b.num_tokens(), 8 * 32);
    for (int64_t t = 0; t < b.num_tokens(); ++t) {
      ASSERT_GE(b.inputs[t], 0);
      ASSERT_LT(b.inputs[t], 64);
      // The EOT position's target (the next document's first token) is always ignored.
      if (b.inputs[t] == kE) {
        ASSERT_EQ(b.targets[t], -1) << t;
      }
    }
    for (int64_t r = 0; r < b.rows; ++r) cut_rows += b.positions[r * 32 + 31] == 31;
  }
  EXPECT_GT(cut_rows, 0);
}

// ---- Sources: formats round-trip -----------------------------------------------------------

TEST(DataFiles, BinRoundTripsSyntheticDocuments) {
  TempDir dir;
  DataConfig c = small_config();
  c.seq_len = 64;
  c.synthetic_mean_doc_len = 48;  // some documents longer than a row
  const auto docs = synthetic_documents(c, 1500);
  for (const auto& d : docs) ASSERT_EQ(d.back(), kE);
  const std::string path = dir.file("synthetic.bin");
  write_bin_shard(path, flatten(docs));

  auto synthetic = DataLoader::open(c);
  DataConfig f = c;
  f.source = path;
  f.shuffle = false;
  auto file = DataLoader::open(f);
  EXPECT_EQ(file->source().num_documents(), 1500);
  for (int k = 0; k < 10; ++k)
    expect_same_batch(synthetic->next(), file->next(), "batch " + std::to_string(k));
}

TEST(DataFiles, H5RoundTripsSyntheticDocumentsAndAppendsMissingEot) {
  TempDir dir;
  DataConfig c = small_config();
  c.seq_len = 64;
  c.synthetic_mean_doc_len = 48;
  auto docs = synthetic_documents(c, 1500);
  // Every third document is stored without its EOT; the reader appends it back.
  for (size_t i = 0; i < docs.size(); i += 3) docs[i].pop_back();
  const std::string path = dir.file("synthetic.h5");
  write_h5_tokens(path, docs);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  auto synthetic = DataLoader::open(c);
  DataConfig f = c;
  f.source = path;
  f.shuffle = false;
  auto file = DataLoader::open(f);
  EXPECT_EQ(file->source().num_documents(), 1500);
  for (int k = 0; k < 10; ++k)
    expect_same_batch(synthetic->next(), file->next(), "batch " + std::to_string(k));
}

// /tokens stored with another integer type and/or chunked (HDF5 reads it instead of a mapping).
void write_h5_variant(const std::string& path, const std::vector<std::vector<int32_t>>& docs,
                      hid_t token_type, bool chunked) {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets{0};
  for (const auto& d : docs) {
    tokens.insert(tokens.end(), d.begin(), d.end());
    offsets.push_back(static_cast<int64_t>(tokens.size()));
  }
  const hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  const hsize_t n_tok[1] = {tokens.size()}, n_off[1] = {offsets.size()}, chunk[1] = {1000};
  const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
  if (chunked) H5Pset_chunk(dcpl, 1, chunk);
  hid_t sp = H5Screate_simple(1, n_tok, nullptr);
  hid_t ds = H5Dcreate2(f, "tokens", token_type, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
  ASSERT_GE(ds, 0);
  EXPECT_GE(H5Dwrite(ds, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, tokens.data()), 0);
  H5Dclose(ds);
  H5Sclose(sp);
  sp = H5Screate_simple(1, n_off, nullptr);
  ds = H5Dcreate2(f, "doc_offsets", H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  EXPECT_GE(H5Dwrite(ds, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, offsets.data()), 0);
  H5Dclose(ds);
  H5Sclose(sp);
  H5Pclose(dcpl);
  H5Fclose(f);
}

TEST(DataFiles, H5LayoutsAndTypesReadTheSame) {
  TempDir dir;
  DataConfig c = small_config();
  c.synthetic_mean_doc_len = 40;
  const auto docs = synthetic_documents(c, 400);
  write_h5_tokens(dir.file("plain.h5"), docs);
  write_h5_variant(dir.file("chunked.h5"), docs, H5T_STD_U32LE, true);
  write_h5_variant(dir.file("u16.h5"), docs, H5T_STD_U16LE, false);
  write_h5_variant(dir.file("i64.h5"), docs, H5T_STD_I64LE, false);
  write_h5_variant(dir.file("i32be.h5"), docs, H5T_STD_I32BE, true);
  DataConfig f = c;
  f.source = dir.file("plain.h5");
  auto plain = DataLoader::open(f);
  std::vector<std::unique_ptr<DataLoader>> others;
  for (const char* name : {"chunked.h5", "u16.h5", "i64.h5", "i32be.h5"}) {
    f.source = dir.file(name);
    others.push_back(DataLoader::open(f));
  }
  // Contiguous 16/32-bit little-endian tokens are mapped; the others go through HDF5.
  const std::string slow = "read through HDF5";
  EXPECT_EQ(plain->source().describe().find(slow), std::string::npos) << plain->source().describe();
  EXPECT_EQ(others[1]->source().describe().find(slow), std::string::npos);
  for (int k : {0, 2, 3}) EXPECT_NE(others[k]->source().describe().find(slow), std::string::npos);
  for (int k = 0; k < 50; ++k) {  // several epochs
    const PackedBatch x = plain->next();
    for (auto& o : others) expect_same_batch(x, o->next(), o->config().source);
  }
}

TEST(DataFiles, BinTrailingRunBecomesADocument) {
  TempDir dir;
  const std::string path = dir.file("trail.bin");
  write_bin_shard(path, {1, 2, kE, 3, 4});  // the last document lacks its EOT
  auto src = open_token_file(path, 64, kE);
  ASSERT_EQ(src->num_documents(), 2);
  EXPECT_EQ(src->document_length(0), 3);
  EXPECT_EQ(src->document_length(1), 3);
  EXPECT_EQ(src->num_tokens(), 6);
  std::vector<int32_t> got(3);
  src->read(1, 0, 3, got.data());
  EXPECT_EQ(got, (std::vector<int32_t>{3, 4, kE}));
}

TEST(DataFiles, GlobListAndSingleFileGiveTheSameStream) {
  TempDir dir;
  DataConfig c = small_config();
  const auto docs = synthetic_documents(c, 600);
  // Three shards split at document boundaries, and one file with everything.
  for (int s = 0; s < 3; ++s) {
    std::vector<std::vector<int32_t>> part(docs.begin() + s * 200, docs.begin() + (s + 1) * 200);
    write_bin_shard(dir.file("shard_" + std::to_string(s) + ".bin"), flatten(part));
  }
  write_bin_shard(dir.file("all.bin"), flatten(docs));
  EXPECT_EQ(expand_source_paths(dir.file("shard_*.bin")),
            (std::vector<std::string>{dir.file("shard_0.bin"), dir.file("shard_1.bin"),
                                      dir.file("shard_2.bin")}));

  for (bool shuffle : {false, true}) {
    DataConfig one = c, glob = c, list = c;
    one.shuffle = glob.shuffle = list.shuffle = shuffle;
    one.source = dir.file("all.bin");
    glob.source = dir.file("shard_*.bin");
    list.source =
        dir.file("shard_0.bin") + "," + dir.file("shard_1.bin") + ", " + dir.file("shard_2.bin");
    auto a = DataLoader::open(one), b = DataLoader::open(glob), d = DataLoader::open(list);
    for (int k = 0; k < 80; ++k) {  // past the end of the first epoch
      const PackedBatch x = a->next();
      expect_same_batch(x, b->next(), "glob");
      expect_same_batch(x, d->next(), "list");
    }
  }
}

// ---- Global order --------------------------------------------------------------------------

TEST(DataLoader, RowsDoNotDependOnWorldSize) {
  TempDir dir;
  DataConfig c = small_config();
  write_bin_shard(dir.file("small.bin"), flatten(synthetic_documents(c, 120)));
  for (const std::string& source : {std::string("synthetic"), dir.file("small.bin")}) {
    SCOPED_TRACE(source);
    DataConfig one = c;
    one.source = source;
    auto single = DataLoader::open(one);
    for (int world : {2, 4}) {
      std::vector<std::unique_ptr<DataLoader>> ranks;
      for (int r = 0; r < world; ++r) {
        DataConfig rc = one;
        rc.rank = r;
        rc.world = world;
        ranks.push_back(DataLoader::open(rc));
        EXPECT_EQ(ranks.back()->rows_per_rank(), 8 / world);
      }
      single->seek(0);
      // 120 documents of ~25 tokens fill ~11 batches: this crosses several epochs.
      for (int k = 0; k < 30; ++k) {
        std::vector<PackedBatch> parts;
        for (auto& l : ranks) parts.push_back(l->next());
        expect_same_batch(single->next(), concat(parts),
                          "world " + std::to_string(world) + " batch " + std::to_string(k));
      }
    }
  }
}

// ---- Resume --------------------------------------------------------------------------------

TEST(DataLoader, RestoredStateGivesIdenticalNextBatches) {
  TempDir dir;
  DataConfig c = small_config();
  c.synthetic_mean_doc_len = 100;  // most documents are cut: states land inside documents
  write_bin_shard(dir.file("long.bin"), flatten(synthetic_documents(c, 40)));
  for (const std::string& source : {std::string("synthetic"), dir.file("long.bin")}) {
    SCOPED_TRACE(source);
    DataConfig cfg = c;
    cfg.source = source;
    auto a = DataLoader::open(cfg);
    int mid_document = 0;
    for (int k = 0; k < 12; ++k) {
      const LoaderState s = a->state();
      EXPECT_EQ(s.batches, k);
      mid_document += s.doc_offset > 0;
      const std::vector<int64_t> saved = s.to_vector();
      const PackedBatch x = a->next(), y = a->next();

      auto b = DataLoader::open(cfg);
      b->restore(LoaderState::from_vector(saved));
      EXPECT_TRUE(b->state() == s);
      expect_same_batch(x, b->next(), "restored, batch " + std::to_string(k));
      expect_same_batch(y, b->next(), "restored, batch " + std::to_string(k + 1));

      auto d = DataLoader::open(cfg);
      d->seek(k);
      EXPECT_TRUE(d->state() == s);
      expect_same_batch(x, d->next(), "seek, batch " + std::to_string(k));

      // A different world size resumes from the same saved position.
      DataConfig half = cfg;
      half.world = 2;
      half.rank = 1;
      auto h = DataLoader::open(half);
      h->restore(LoaderState::from_vector(saved));
      const PackedBatch hx = h->next();
      EXPECT_EQ(hx.inputs, std::vector<int32_t>(x.inputs.begin() + 4 * 32, x.inputs.end()));
      EXPECT_EQ(hx.targets, std::vector<int32_t>(x.targets.begin() + 4 * 32, x.targets.end()));

      a->restore(s);  // rewind a, then step it one batch for the next round
      a->next();
    }
    EXPECT_GT(mid_document, 0);
  }
}

TEST(DataLoader, RestoreRejectsOtherDataAndBadArrays) {
  DataConfig c = small_config();
  auto a = DataLoader::open(c);
  a->next();
  const LoaderState s = a->state();
  DataConfig other = c;
  other.seed = 8;
  auto b = DataLoader::open(other);
  expect_user_error([&] { b->restore(s); }, {"fingerprint", "synthetic"});
  expect_user_error([] { LoaderState::from_vector({1, 2, 3}); }, {"format", "got 3 integers"});
  LoaderState bad = s;
  bad.epoch = 2;  // the synthetic stream has no epochs
  expect_user_error([&] { a->restore(bad); }, {"out of range", "epoch 2"});
}

// ---- Shuffle -------------------------------------------------------------------------------

// Document ids in the order the loader packs them: doc i is [i, i, ..., EOT]. Under stream
// packing the inputs of consecutive batches are the document stream itself, so a document starts
// after each EOT.
std::vector<int32_t> document_stream(const DataConfig& c, int n) {
  auto loader = DataLoader::open(c);
  std::vector<int32_t> ids;
  bool at_start = true;
  while (static_cast<int>(ids.size()) < n) {
    const PackedBatch b = loader->next();
    for (int32_t t : b.inputs) {
      if (at_start && t != c.eot_token) ids.push_back(t);
      at_start = t == c.eot_token;
    }
  }
  ids.resize(n);
  return ids;
}

TEST(DataLoader, ShuffleIsDeterministicPerSeedAndEpoch) {
  TempDir dir;
  const int n = 300;
  std::vector<std::vector<int32_t>> docs;
  for (int i = 0; i < n; ++i) {
    docs.emplace_back(1 + i % 7, i);
    docs.back().push_back(4095);
  }
  const std::string path = dir.file("ids.h5");
  write_h5_tokens(path, docs);
  DataConfig c;
  c.source = path;
  c.vocab_size = 4096;
  c.eot_token = 4095;
  c.seq_len = 16;
  c.rows_per_batch = 4;
  c.seed = 1;

  const auto a = document_stream(c, 2 * n);
  EXPECT_EQ(a, document_stream(c, 2 * n));  // same seed, same order
  std::vector<int32_t> identity(n);
  for (int i = 0; i < n; ++i) identity[i] = i;
  const std::vector<int32_t> epoch0(a.begin(), a.begin() + n), epoch1(a.begin() + n, a.end());
  // Each epoch visits every document once, in its own order.
  for (const auto* e : {&epoch0, &epoch1}) {
    std::vector<int32_t> sorted = *e;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, identity);
  }
  EXPECT_NE(epoch0, identity);
  EXPECT_NE(epoch0, epoch1);

  DataConfig other = c;
  other.seed = 2;
  const auto b = document_stream(other, n);
  EXPECT_NE(b, epoch0);

  DataConfig ordered = c;
  ordered.shuffle = false;
  EXPECT_EQ(document_stream(ordered, n), identity);
}

// ---- Synthetic -----------------------------------------------------------------------------

SyntheticParams params_of(const DataConfig& c) {
  SyntheticParams p;
  p.vocab_size = c.vocab_size;
  p.eot_token = c.eot_token;
  p.content_vocab = c.synthetic_vocab;
  p.zipf = c.synthetic_zipf;
  p.mean_doc_len = c.synthetic_mean_doc_len;
  p.seed = c.seed;
  return p;
}

TEST(DataSynthetic, EntropyFloorFormula) {
  DataConfig c = small_config();
  c.synthetic_mean_doc_len = 64;
  c.synthetic_zipf = 1.0;
  auto loader = DataLoader::open(c);
  const double p = 1.0 / 64;
  double z = 0, hz = 0;
  for (int r = 1; r <= 63; ++r) z += 1.0 / r;
  for (int r = 1; r <= 63; ++r) hz -= (1.0 / r / z) * std::log(1.0 / r / z);
  const double expected = -p * std::log(p) - (1 - p) * std::log(1 - p) + (1 - p) * hz;
  EXPECT_NEAR(loader->entropy_floor(), expected, 1e-12);
  std::printf("entropy_floor(vocab 64, Vc 63, eot 63, zipf 1, mean_doc_len 64) = %.6f nats\n",
              loader->entropy_floor());
}

TEST(DataSynthetic, EmpiricalLossMatchesEntropyFloor) {
  struct Case {
    int64_t vocab, vc;
    int32_t eot;
    double zipf, mean;
  };
  for (const Case k : {Case{64, 63, 63, 1.0, 64}, Case{512, 300, 511, 1.2, 20}}) {
    DataConfig c = small_config();
    c.vocab_size = k.vocab;
    c.synthetic_vocab = k.vc;
    c.eot_token = k.eot;
    c.synthetic_zipf = k.zipf;
    c.synthetic_mean_doc_len = k.mean;
    const SyntheticSource src(params_of(c));
    double nll = 0;
    int64_t targets = 0, content = 0, n_docs = 0;
    for (int64_t i = 0; targets < 300000; ++i, ++n_docs) {
      const auto d = src.document(i);
      ASSERT_EQ(d.back(), k.eot);
      content += static_cast<int64_t>(d.size()) - 1;
      // The valid targets of a document: every token after the first, its EOT included.
      for (size_t j = 1; j < d.size(); ++j) {
        const int32_t a = j >= 2 ? d[j - 2] : SyntheticSource::kNoContext;
        nll -= src.log_prob(a, d[j - 1], d[j]);
        ++targets;
      }
    }
    const double mean = nll / static_cast<double>(targets);
    SCOPED_TRACE("Vc " + std::to_string(k.vc));
    EXPECT_NEAR(mean / src.entropy_floor(), 1.0, 0.01) << mean << " vs " << src.entropy_floor();
    EXPECT_NEAR(static_cast<double>(content) / n_docs / k.mean, 1.0, 0.05);
  }
}

TEST(DataSynthetic, EveryContextHasItsOwnPermutation) {
  DataConfig c = small_config();
  c.vocab_size = 512;
  c.eot_token = 511;
  c.synthetic_vocab = 300;  // not a power of two: the bijection walks cycles
  const SyntheticSource src(params_of(c));
  std::set<std::vector<int32_t>> distinct;
  for (int32_t a : {SyntheticSource::kNoContext, 0, 17, 299}) {
    for (int32_t b : {0, 5, 299}) {
      std::vector<int32_t> perm(300);
      std::vector<bool> seen(300, false);
      for (int64_t r = 0; r < 300; ++r) {
        perm[r] = src.token_at_rank(a, b, r);
        ASSERT_GE(perm[r], 0);
        ASSERT_LT(perm[r], 300);
        ASSERT_FALSE(seen[perm[r]]);
        seen[perm[r]] = true;
        ASSERT_EQ(src.rank_of(a, b, perm[r]), r);
      }
      distinct.insert(perm);
    }
  }
  EXPECT_EQ(distinct.size(), 12u);
}

TEST(DataSynthetic, RandomAccessMatchesSequentialGeneration) {
  DataConfig c = small_config();
  c.synthetic_mean_doc_len = 200;
  SyntheticSource src(params_of(c));
  for (int64_t i : {int64_t{5}, int64_t{3}, int64_t{1000000007}, int64_t{3}}) {
    const auto doc = src.document(i);
    ASSERT_EQ(static_cast<int64_t>(doc.size()), src.document_length(i));
    // Pieces out of order, overlapping, and from a fresh cursor.
    for (int64_t off : {int64_t{0}, static_cast<int64_t>(doc.size()) / 2, int64_t{1}}) {
      const int64_t n = std::min<int64_t>(40, static_cast<int64_t>(doc.size()) - off);
      std::vector<int32_t> got(n);
      src.read(i, off, n, got.data());
      EXPECT_EQ(got, std::vector<int32_t>(doc.begin() + off, doc.begin() + off + n));
    }
  }
  // Same seed, same documents; another seed, others.
  DataConfig other = c;
  other.seed = c.seed + 1;
  EXPECT_EQ(SyntheticSource(params_of(c)).document(9), src.document(9));
  EXPECT_NE(SyntheticSource(params_of(other)).document(9), src.document(9));
}

// ---- Errors --------------------------------------------------------------------------------

DataConfig file_config(const std::string& path) {
  DataConfig c = small_config();
  c.source = path;
  return c;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

void patch_int32(const std::string& path, int64_t index, int32_t value) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(index * 4);
  f.write(reinterpret_cast<const char*>(&value), 4);
}

// An HDF5 file with only the given 1-D int64 datasets.
void write_raw_h5(const std::string& path,
                  const std::vector<std::pair<std::string, std::vector<int64_t>>>& datasets) {
  const hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  for (const auto& [name, v] : datasets) {
    const hsize_t dims[1] = {v.size()};
    const hid_t sp = H5Screate_simple(1, dims, nullptr);
    const hid_t ds =
        H5Dcreate2(f, name.c_str(), H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    ASSERT_GE(ds, 0);
    if (!v.empty()) H5Dwrite(ds, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    H5Dclose(ds);
    H5Sclose(sp);
  }
  H5Fclose(f);
}

TEST(DataErrors, MissingFileAndUnknownKind) {
  TempDir dir;
  const std::string missing = dir.file("nope.bin");
  expect_user_error([&] { DataLoader::open(file_config(missing)); }, {missing, "No such file"});
  const std::string missing_h5 = dir.file("nope.h5");
  expect_user_error([&] { DataLoader::open(file_config(missing_h5)); },
                    {missing_h5, "No such file"});
  expect_user_error([&] { DataLoader::open(file_config(dir.file("a.txt"))); },
                    {"a.txt", "unknown data source", ".bin", ".h5"});
  expect_user_error([&] { DataLoader::open(file_config(dir.file("x_*.bin"))); },
                    {"x_*.bin", "no data file matches"});
}

TEST(DataErrors, TruncatedBadMagicBadVersion) {
  TempDir dir;
  std::vector<int32_t> tokens(100, 1);
  const std::string trunc = dir.file("trunc.bin");
  write_bin_shard(trunc, tokens);
  std::filesystem::resize_file(trunc, 1024 + 100);  // 50 of the 100 tokens
  expect_user_error([&] { DataLoader::open(file_config(trunc)); },
                    {trunc, "truncated: header says 100 tokens, file holds 50"});

  const std::string tiny = dir.file("tiny.bin");
  write_bytes(tiny, "0123456789");
  expect_user_error([&] { DataLoader::open(file_config(tiny)); }, {tiny, "truncated", "header"});

  const std::string magic = dir.file("magic.bin");
  write_bin_shard(magic, tokens);
  patch_int32(magic, 0, 12345);
  expect_user_error([&] { DataLoader::open(file_config(magic)); },
                    {"bad magic 12345 in " + magic + ", expected 20240520 (llm.c token shard)"});

  const std::string version = dir.file("version.bin");
  write_bin_shard(version, tokens);
  patch_int32(version, 1, 2);
  expect_user_error([&] { DataLoader::open(file_config(version)); },
                    {version, "version 2", "expected 1"});

  const std::string empty = dir.file("empty.bin");
  write_bin_shard(empty, {});
  expect_user_error([&] { DataLoader::open(file_config(empty)); }, {empty, "empty data"});
}

// A token file cut short after the loader validated it (a shard being rewritten under a running
// job): the read that reaches past the new end throws a UserError naming the file, where a
// memory-mapped read would kill the process with SIGBUS.
TEST(DataErrors, FileTruncatedWhileInUseFailsTheReadNamingTheFile) {
  TempDir dir;
  std::vector<int32_t> tokens;
  for (int d = 0; d < 400; ++d) {
    for (int k = 0; k < 9; ++k) tokens.push_back((d + k) % kE);
    tokens.push_back(kE);
  }
  std::vector<int64_t> offsets;
  for (int64_t d = 0; d <= 400; ++d) offsets.push_back(d * 10);
  const std::string bin = dir.file("cut.bin");
  const std::string h5 = dir.file("cut.h5");
  write_bin_shard(bin, tokens);
  write_h5_tokens(h5, tokens, offsets);
  // Where the first 300 tokens end in each file.
  const int64_t bin_cut = kBinHeaderBytes + 2 * 300;
  int64_t h5_cut = 0;
  {
    const hid_t f = H5Fopen(h5.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    const hid_t ds = H5Dopen2(f, "/tokens", H5P_DEFAULT);
    ASSERT_GE(ds, 0);
    const haddr_t at = H5Dget_offset(ds);
    H5Dclose(ds);
    H5Fclose(f);
    ASSERT_NE(at, HADDR_UNDEF) << "write_h5_tokens stores /tokens contiguously";
    h5_cut = static_cast<int64_t>(at) + 4 * 300;
  }
  for (const auto& [path, cut] : {std::pair{bin, bin_cut}, std::pair{h5, h5_cut}}) {
    SCOPED_TRACE(path);
    DataConfig c = file_config(path);
    c.shuffle = false;  // file order: the first batches lie before the cut
    auto loader = DataLoader::open(c);
    // A row of 33 tokens holds 3 documents of 10: a batch of 8 rows reads 240 tokens.
    EXPECT_NO_THROW(loader->next());
    std::filesystem::resize_file(path, static_cast<uintmax_t>(cut));
    // The second batch reads tokens 240..479, past the cut.
    expect_user_error(
        [&] {
          for (int b = 0; b < 4; ++b) loader->next();
        },
        {path, "truncated while in use"});
  }
}

TEST(DataErrors, TokenOutsideVocabNamesFileAndOffset) {
  TempDir dir;
  std::vector<int32_t> tokens = {1, 2, kE, 3, 4, 70, 5, kE};
  const std::string bin = dir.file("big.bin");
  write_bin_shard(bin, tokens);
  expect_user_error([&] { DataLoader::open(file_config(bin)); },
                    {bin, "token id 70", "token offset 5", "vocab_size 64"});
  const std::string h5 = dir.file("big.h5");
  write_h5_tokens(h5, tokens, {0, 3, 8});
  expect_user_error([&] { DataLoader::open(file_config(h5)); },
                    {h5, "token id 70", "token offset 5", "vocab_size 64"});
}

TEST(DataErrors, MalformedH5Files) {
  TempDir dir;
  const std::vector<int32_t> tokens = {1, 2, kE, 3, 4, kE};
  struct Bad {
    std::vector<int64_t> offsets;
    std::string fact;
  };
  for (const Bad& b :
       {Bad{{1, 3, 6}, "/doc_offsets[0] = 1"}, Bad{{0, 4, 3, 6}, "/doc_offsets[2] = 3"},
        Bad{{0, 3, 5}, "/doc_offsets[2] = 5"}, Bad{{}, "/doc_offsets"}}) {
    const std::string path = dir.file("bad.h5");
    write_h5_tokens(path, tokens, b.offsets);
    expect_user_error([&] { DataLoader::open(file_config(path)); }, {path, b.fact});
  }
  const std::string no_offsets = dir.file("no_offsets.h5");
  write_raw_h5(no_offsets, {{"tokens", {1, 2, kE}}});
  expect_user_error([&] { DataLoader::open(file_config(no_offsets)); },
                    {no_offsets, "no dataset /doc_offsets"});
  const std::string no_tokens = dir.file("no_tokens.hdf5");
  write_raw_h5(no_tokens, {{"doc_offsets", {0, 3}}});
  expect_user_error([&] { DataLoader::open(file_config(no_tokens)); },
                    {no_tokens, "no dataset /tokens"});
  const std::string text = dir.file("text.h5");
  write_bytes(text, "not hdf5 at all");
  expect_user_error([&] { DataLoader::open(file_config(text)); }, {text, "not an HDF5 file"});
}

// A dataset that declares more values than the file stores (a damaged header, or a file whose
// data was never written) is rejected before anything of that size is allocated or read.
TEST(DataErrors, H5DatasetLongerThanItsStorageIsRejected) {
  TempDir dir;
  const std::string path = dir.file("declared.h5");
  {
    const hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    const std::vector<int32_t> tokens = {1, 2, kE};
    const hsize_t n[1] = {3}, huge[1] = {hsize_t{1} << 40}, chunk[1] = {1024};
    const hid_t s1 = H5Screate_simple(1, n, nullptr);
    const hid_t t =
        H5Dcreate2(f, "/tokens", H5T_STD_U32LE, s1, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(t, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, tokens.data());
    // 2^40 offsets declared, none written: HDF5 would serve fill values for all of them.
    const hid_t s2 = H5Screate_simple(1, huge, nullptr);
    const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_chunk(dcpl, 1, chunk);
    const hid_t o =
        H5Dcreate2(f, "/doc_offsets", H5T_STD_I64LE, s2, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    ASSERT_GE(o, 0);
    H5Dclose(o);
    H5Dclose(t);
    H5Pclose(dcpl);
    H5Sclose(s1);
    H5Sclose(s2);
    H5Fclose(f);
  }
  expect_user_error([&] { DataLoader::open(file_config(path)); },
                    {path, "/doc_offsets", "declares 1099511627776 values", "stores only 0 bytes"});
}

TEST(DataErrors, BadConfig) {
  DataConfig c = small_config();
  c.rows_per_batch = 6;
  c.world = 4;
  expect_user_error([&] { DataLoader::open(c); }, {"rows_per_batch 6", "world size 4"});
  c = small_config();
  c.eot_token = 64;
  expect_user_error([&] { DataLoader::open(c); }, {"eot_token 64", "vocab_size"});
  c = small_config();
  c.seq_len = 1;
  expect_user_error([&] { DataLoader::open(c); }, {"seq_len", "got 1"});
  c = small_config();
  c.synthetic_vocab = 64;  // would include the EOT id 63
  expect_user_error([&] { DataLoader::open(c); }, {"synthetic_vocab", "eot_token 63"});
}

TEST(DataErrors, WritersLeaveNoPartialFile) {
  TempDir dir;
  const std::string path = dir.file("w.bin");
  expect_user_error([&] { write_bin_shard(path, {1, 70000}); }, {path, "70000", "offset 1"});
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  EXPECT_THROW(write_h5_tokens(dir.file("missing_dir/x.h5"), {1, kE}, {0, 2}), Error);
  EXPECT_FALSE(std::filesystem::exists(dir.file("missing_dir/x.h5.tmp")));
}

}  // namespace
}  // namespace hp
