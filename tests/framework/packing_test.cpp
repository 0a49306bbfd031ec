// The two packings (framework/data/loader.h): stream (documents in order, cut at row boundaries,
// no padding) and whole (documents kept whole, rows filled by best fit over a look-ahead
// window). Rows by hand; the document tokens a batch counts against the tokens taken from the
// file, counted here from the file itself; the padding bound of each mode on documents of uniform
// length; resume and world-size independence under both, with shuffle on and off; loss masks
// that follow their tokens across a cut.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "framework/core/error.h"
#include "framework/data/loader.h"
#include "framework/data/packed_batch.h"
#include "framework/data/token_files.h"
#include "tests/common/fixtures.h"

namespace hp {
namespace {

using test::expect_same_batch;
using test::TempDir;

constexpr int32_t kE = 63;  // EOT (vocab 64)
constexpr int32_t I = -1;   // an ignored target

DataConfig file_config(const std::string& path, Packing packing) {
  DataConfig c;
  c.source = path;
  c.vocab_size = 64;
  c.eot_token = kE;
  c.seq_len = 8;
  c.rows_per_batch = 4;
  c.seed = 3;
  c.shuffle = false;
  c.packing = packing;
  return c;
}

// doc0: 1..19 and EOT (20 tokens, longer than a row); doc1: 30 31 EOT; doc2: 40 41 42 43 EOT.
std::string three_documents(const TempDir& dir) {
  std::vector<int32_t> doc0;
  for (int32_t t = 1; t <= 19; ++t) doc0.push_back(t);
  doc0.push_back(kE);
  const std::string path = dir.file("three.h5");
  write_h5_tokens(path, {doc0, {30, 31, kE}, {40, 41, 42, 43, kE}});
  return path;
}

TEST(Packing, StreamRowsByHand) {
  TempDir dir;
  auto loader = DataLoader::open(file_config(three_documents(dir), Packing::kStream));
  EXPECT_TRUE(std::isnan(loader->entropy_floor())) << "files know no entropy floor";
  const PackedBatch b = loader->next();
  // Row r holds stream tokens [8r, 8r + 9): the last one is a target only and starts row r + 1.
  // Row 3 runs past the 28 tokens of the data into epoch 1 (doc0 again).
  EXPECT_EQ(b.inputs, (std::vector<int32_t>{1,  2,  3,  4,  5,  6,  7,  8,   //
                                            9,  10, 11, 12, 13, 14, 15, 16,  //
                                            17, 18, 19, kE, 30, 31, kE, 40,  //
                                            41, 42, 43, kE, 1,  2,  3,  4}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{2,  3,  4,  5,  6,  7,  8,  9,   //
                                             10, 11, 12, 13, 14, 15, 16, 17,  //
                                             18, 19, kE, I,  31, kE, I,  41,  //
                                             42, 43, kE, I,  2,  3,  4,  5}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7,  //
                                               0, 1, 2, 3, 4, 5, 6, 7,  //
                                               0, 1, 2, 3, 0, 1, 2, 0,  //
                                               0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(b.cu_seqlens, (std::vector<int32_t>{0, 8, 16, 20, 23, 24, 28, 32}));
  EXPECT_EQ(b.num_doc_tokens, 32);
  EXPECT_EQ(b.num_valid_targets, 8 + 8 + 6 + 7);
  const LoaderState s = loader->state();
  EXPECT_EQ(s.epoch, 1);
  EXPECT_EQ(s.next_doc, 0);
  EXPECT_EQ(s.doc_offset, 4);  // the next row starts with doc0's token 5
  EXPECT_TRUE(s.window.empty());
}

TEST(Packing, WholeRowsByHand) {
  TempDir dir;
  DataConfig c = file_config(three_documents(dir), Packing::kWhole);
  c.packing_window = 2;
  auto loader = DataLoader::open(c);
  const PackedBatch b = loader->next();
  // doc0 is longer than a row: two row-sized pieces, then its last 4 tokens start row 2, where
  // the best fit in the window {doc1, doc2} for the 5 tokens left is doc2, whose EOT lands on
  // row position T (a target only). Row 3: doc1, then the best fit in {epoch 1's doc0, doc1}
  // for the 6 tokens left is doc1; 3 padding tokens.
  EXPECT_EQ(b.inputs, (std::vector<int32_t>{1,  2,  3,  4,  5,  6,  7,  8,   //
                                            9,  10, 11, 12, 13, 14, 15, 16,  //
                                            17, 18, 19, kE, 40, 41, 42, 43,  //
                                            30, 31, kE, 30, 31, kE, kE, kE}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{2,  3,  4,  5,  6,  7,  8,  9,   //
                                             10, 11, 12, 13, 14, 15, 16, 17,  //
                                             18, 19, kE, I,  41, 42, 43, kE,  //
                                             31, kE, I,  31, kE, I,  I,  I}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7,  //
                                               0, 1, 2, 3, 4, 5, 6, 7,  //
                                               0, 1, 2, 3, 0, 1, 2, 3,  //
                                               0, 1, 2, 0, 1, 2, 0, 1}));
  EXPECT_EQ(b.cu_seqlens, (std::vector<int32_t>{0, 8, 16, 20, 24, 27, 30, 32}));
  EXPECT_EQ(b.seq_is_pad, (std::vector<uint8_t>{0, 0, 0, 0, 0, 0, 1}));
  EXPECT_EQ(b.num_doc_tokens, 30);
  EXPECT_EQ(b.num_valid_targets, 8 + 8 + 7 + 4);
  // The padding piece does no document work: its two positions add no attention pair.
  EXPECT_DOUBLE_EQ(b.attention_pairs(0), 2 * 36 + 10 + 10 + 6 + 6);
  const LoaderState s = loader->state();
  EXPECT_EQ(s.packing, Packing::kWhole);
  EXPECT_EQ(s.window, (std::vector<int64_t>{0, 2}));  // epoch 1's doc0 and doc2 wait
  EXPECT_EQ(s.epoch, 2);  // drawing epoch 1's doc2 into the window ended epoch 1
  EXPECT_EQ(s.next_doc, 0);
}

// Documents of random tokens and lengths, kept by the test to count against.
struct Corpus {
  std::vector<std::vector<int32_t>> docs;
  std::vector<int32_t> stream;  // the documents in file order
};

Corpus random_corpus(int n, int min_len, int max_len, uint32_t seed) {
  std::mt19937 rng(seed);
  Corpus c;
  for (int d = 0; d < n; ++d) {
    const int len = min_len + static_cast<int>(rng() % static_cast<uint32_t>(max_len - min_len + 1));
    std::vector<int32_t> doc;
    for (int k = 0; k + 1 < len; ++k) doc.push_back(static_cast<int32_t>(rng() % kE));
    doc.push_back(kE);
    c.stream.insert(c.stream.end(), doc.begin(), doc.end());
    c.docs.push_back(std::move(doc));
  }
  return c;
}

// Stream packing: the inputs of consecutive batches are the file's tokens in order, each once;
// the batches count exactly the tokens taken; each target is the next token of the stream, or
// ignored where the input is an EOT.
TEST(Packing, StreamCountsEveryTokenTakenFromTheFileOnce) {
  TempDir dir;
  const Corpus corpus = random_corpus(37, 2, 30, 11);
  const std::string path = dir.file("c.h5");
  write_h5_tokens(path, corpus.docs);
  DataConfig c = file_config(path, Packing::kStream);
  auto loader = DataLoader::open(c);
  const int64_t n = static_cast<int64_t>(corpus.stream.size());
  int64_t taken = 0, counted = 0;
  for (int b = 0; b < 25; ++b) {  // 800 positions: more than one epoch
    const PackedBatch x = loader->next();
    counted += x.num_doc_tokens;
    for (int64_t i = 0; i < x.num_tokens(); ++i, ++taken) {
      const int32_t tok = corpus.stream[taken % n];
      ASSERT_EQ(x.inputs[i], tok) << "batch " << b << " position " << i;
      const int32_t next = corpus.stream[(taken + 1) % n];
      ASSERT_EQ(x.targets[i], tok == kE ? I : next) << "batch " << b << " position " << i;
    }
  }
  EXPECT_EQ(counted, taken);
  EXPECT_GT(taken, n);
}

// Whole packing: every document that fits a row arrives whole, none more often than the epochs
// allow, and the batches count exactly the input positions of the documents they hold: every
// token of a held document, less the EOTs that end a row (row position T is a target only).
TEST(Packing, WholeKeepsDocumentsWholeAndCountsTheirTokens) {
  TempDir dir;
  const Corpus corpus = random_corpus(200, 2, 9, 5);  // all fit a row of T + 1 = 9 tokens
  const std::string path = dir.file("c.h5");
  write_h5_tokens(path, corpus.docs);
  DataConfig c = file_config(path, Packing::kWhole);
  c.packing_window = 6;
  auto loader = DataLoader::open(c);
  std::map<std::vector<int32_t>, int> seen;  // document contents -> times seen
  int64_t counted = 0, held = 0, eot_at_row_end = 0, positions = 0;
  for (int b = 0; b < 60; ++b) {  // 1,920 positions: about two epochs of ~1,100 tokens
    const PackedBatch x = loader->next();
    counted += x.num_doc_tokens;
    positions += x.num_tokens();
    for (int64_t s = 0; s < x.num_seqs(); ++s) {
      const int32_t begin = x.cu_seqlens[s], end = x.cu_seqlens[s + 1];
      if (x.seq_is_pad[s]) {
        for (int32_t t = begin; t < end; ++t) ASSERT_EQ(x.inputs[t], kE);
        continue;
      }
      std::vector<int32_t> doc(x.inputs.begin() + begin, x.inputs.begin() + end);
      if (doc.back() != kE) {
        // The document runs to the row's end: its EOT is the last input's target.
        ASSERT_EQ(end % 8, 0) << "only a row's last piece may end without its EOT";
        ASSERT_EQ(x.targets[end - 1], kE) << "a document was cut";
        doc.push_back(kE);
        ++eot_at_row_end;
      }
      ++seen[doc];
      held += static_cast<int64_t>(doc.size());
    }
  }
  EXPECT_EQ(counted, held - eot_at_row_end);
  EXPECT_GT(eot_at_row_end, 0);
  std::map<std::vector<int32_t>, int> in_file;
  for (const auto& d : corpus.docs) ++in_file[d];
  const int64_t epochs = positions / static_cast<int64_t>(corpus.stream.size()) + 1;
  for (const auto& [doc, times] : seen) {
    ASSERT_TRUE(in_file.count(doc)) << "a piece that is no document of the file";
    EXPECT_LE(times, in_file[doc] * epochs);
  }
  // The first epoch's documents all arrived (the window holds at most 6 of them back).
  EXPECT_GE(static_cast<int64_t>(seen.size()), static_cast<int64_t>(in_file.size()) - 6);
}

// Documents of uniform length 64..4095 in rows of 4,096: no padding in stream mode, at most 3%
// in whole mode with the default window.
TEST(Packing, PaddingOfEachModeOnUniformDocuments) {
  for (Packing p : {Packing::kStream, Packing::kWhole}) {
    SCOPED_TRACE(packing_name(p));
    DataConfig c;
    c.vocab_size = 64;
    c.eot_token = kE;
    c.seq_len = 4096;
    c.rows_per_batch = 8;
    c.seed = 9;
    c.synthetic_doc_len = parse_doc_length("uniform:64:4096");
    c.packing = p;
    auto loader = DataLoader::open(c);
    int64_t doc = 0, pos = 0;
    for (int b = 0; b < 40; ++b) {
      const PackedBatch x = loader->next();
      doc += x.num_doc_tokens;
      pos += x.num_tokens();
    }
    const double padding = 1.0 - static_cast<double>(doc) / static_cast<double>(pos);
    if (p == Packing::kStream)
      EXPECT_EQ(padding, 0.0);
    else
      EXPECT_LE(padding, 0.03);
    if (p == Packing::kWhole) EXPECT_GT(padding, 0.0) << "whole documents leave some room";
  }
}

// Mid-epoch resume under both packings, shuffle on and off: the saved state (window included)
// gives the very batches the loader would have produced; so does seek(); and another world size
// restores the same position. A state of one packing is refused by the other.
TEST(Packing, ResumeIsExactUnderBothPackingsWithAndWithoutShuffle) {
  TempDir dir;
  const Corpus corpus = random_corpus(90, 2, 40, 17);  // some longer than a row: cut
  const std::string path = dir.file("c.h5");
  write_h5_tokens(path, corpus.docs);
  for (Packing p : {Packing::kStream, Packing::kWhole}) {
    for (bool shuffle : {false, true}) {
      SCOPED_TRACE(std::string(packing_name(p)) + (shuffle ? " shuffled" : " in order"));
      DataConfig c = file_config(path, p);
      c.shuffle = shuffle;
      c.packing_window = 5;
      auto a = DataLoader::open(c);
      int mid_document = 0, with_window = 0;
      for (int k = 0; k < 40; ++k) {  // ~1,300 positions: several epochs of ~900 tokens
        const LoaderState s = a->state();
        mid_document += s.doc_offset > 0;
        with_window += !s.window.empty();
        const std::vector<int64_t> saved = s.to_vector();
        const PackedBatch x = a->next(), y = a->next();
        auto b = DataLoader::open(c);
        b->restore(LoaderState::from_vector(saved));
        EXPECT_TRUE(b->state() == s);
        expect_same_batch(x, b->next(), "restored, batch " + std::to_string(k));
        expect_same_batch(y, b->next(), "restored, batch " + std::to_string(k + 1));
        auto d = DataLoader::open(c);
        d->seek(k);
        EXPECT_TRUE(d->state() == s) << "seek " << k;
        DataConfig half = c;
        half.world = 2;
        half.rank = 1;
        auto h = DataLoader::open(half);
        h->restore(LoaderState::from_vector(saved));
        EXPECT_EQ(h->next().inputs, std::vector<int32_t>(x.inputs.begin() + 16, x.inputs.end()));
        a->restore(s);
        a->next();
      }
      EXPECT_GT(mid_document, 0);
      EXPECT_EQ(with_window > 0, p == Packing::kWhole);
      DataConfig other = c;
      other.packing = p == Packing::kWhole ? Packing::kStream : Packing::kWhole;
      auto o = DataLoader::open(other);
      try {
        o->restore(a->state());
        ADD_FAILURE() << "restored a state of the other packing";
      } catch (const UserError& e) {
        EXPECT_NE(std::string(e.what()).find("packing"), std::string::npos) << e.what();
      }
    }
  }
}

// Global batch i holds the same rows whatever the world size, under both packings.
TEST(Packing, RowsDoNotDependOnWorldSize) {
  TempDir dir;
  const Corpus corpus = random_corpus(60, 2, 30, 23);
  const std::string path = dir.file("c.h5");
  write_h5_tokens(path, corpus.docs);
  for (Packing p : {Packing::kStream, Packing::kWhole}) {
    SCOPED_TRACE(packing_name(p));
    DataConfig c = file_config(path, p);
    c.shuffle = true;
    c.packing_window = 4;
    auto single = DataLoader::open(c);
    std::vector<std::unique_ptr<DataLoader>> ranks;
    for (int r = 0; r < 4; ++r) {
      DataConfig rc = c;
      rc.rank = r;
      rc.world = 4;
      ranks.push_back(DataLoader::open(rc));
    }
    for (int k = 0; k < 20; ++k) {
      const PackedBatch whole = single->next();
      std::vector<int32_t> inputs, targets;
      int64_t docs = 0;
      for (auto& l : ranks) {
        const PackedBatch part = l->next();
        inputs.insert(inputs.end(), part.inputs.begin(), part.inputs.end());
        targets.insert(targets.end(), part.targets.begin(), part.targets.end());
        docs += part.num_doc_tokens;
      }
      EXPECT_EQ(inputs, whole.inputs) << "batch " << k;
      EXPECT_EQ(targets, whole.targets) << "batch " << k;
      EXPECT_EQ(docs, whole.num_doc_tokens) << "batch " << k;
    }
  }
}

// A loss mask follows its tokens across a stream cut: a target counts exactly when the token it
// predicts has mask 1 (and the input is not an EOT), whichever row the token lands in.
TEST(Packing, LossMasksSurviveTheStreamCut) {
  TempDir dir;
  const Corpus corpus = random_corpus(30, 3, 40, 29);
  std::mt19937 rng(31);
  std::vector<int64_t> offsets{0};
  std::vector<uint8_t> mask;
  for (const auto& d : corpus.docs) {
    offsets.push_back(offsets.back() + static_cast<int64_t>(d.size()));
    for (size_t k = 0; k < d.size(); ++k) mask.push_back(static_cast<uint8_t>(rng() % 2));
  }
  const std::string path = dir.file("masked.h5");
  write_h5_tokens(path, corpus.stream, offsets, &mask);
  auto loader = DataLoader::open(file_config(path, Packing::kStream));
  const int64_t n = static_cast<int64_t>(corpus.stream.size());
  int64_t taken = 0, cut_targets_kept = 0, cut_targets_dropped = 0;
  for (int b = 0; b < 12; ++b) {
    const PackedBatch x = loader->next();
    for (int64_t i = 0; i < x.num_tokens(); ++i, ++taken) {
      const int32_t tok = corpus.stream[taken % n];
      ASSERT_EQ(x.inputs[i], tok);
      const bool counts = tok != kE && mask[(taken + 1) % n] == 1;
      ASSERT_EQ(x.targets[i], counts ? corpus.stream[(taken + 1) % n] : I) << taken;
      // The last input of a row predicts a token that starts the next row.
      if (i % 8 == 7 && tok != kE) ++(counts ? cut_targets_kept : cut_targets_dropped);
    }
  }
  EXPECT_GT(cut_targets_kept, 0);
  EXPECT_GT(cut_targets_dropped, 0);
}

// Data smaller than a batch passes many epochs a batch: one "epoch done" line and one warning
// that says so, not a line per pass.
TEST(Packing, DataSmallerThanABatchSaysSoOnce) {
  TempDir dir;
  const std::string path = dir.file("tiny.h5");
  write_h5_tokens(path, {{5, kE}});  // one document of two tokens
  for (Packing p : {Packing::kStream, Packing::kWhole}) {
    SCOPED_TRACE(packing_name(p));
    auto loader = DataLoader::open(file_config(path, p));
    testing::internal::CaptureStderr();
    for (int b = 0; b < 3; ++b) loader->next();  // 96 positions: dozens of passes
    const std::string err = testing::internal::GetCapturedStderr();
    size_t lines = 0;
    for (size_t at = err.find("done ("); at != std::string::npos; at = err.find("done (", at + 1))
      ++lines;
    EXPECT_EQ(lines, 1u) << "the first epoch's line only:\n" << err;
    EXPECT_NE(err.find("fewer than one global batch"), std::string::npos) << err;
    EXPECT_EQ(err.find("fewer than one global batch"), err.rfind("fewer than one global batch"))
        << "the warning comes once:\n" << err;
    EXPECT_GT(loader->state().epoch, 20);
  }
}

TEST(Packing, BadWindowAndOldStates) {
  DataConfig c;
  c.vocab_size = 64;
  c.eot_token = kE;
  c.seq_len = 8;
  c.rows_per_batch = 2;
  c.packing_window = 0;
  EXPECT_THROW(DataLoader::open(c), UserError);
  c.packing_window = kMaxPackingWindow + 1;
  EXPECT_THROW(DataLoader::open(c), UserError);
  // A state of format 1 (before the packing was recorded) is a position in the document order,
  // which both packings continue from.
  c.packing_window = 3;
  for (Packing p : {Packing::kStream, Packing::kWhole}) {
    c.packing = p;
    auto a = DataLoader::open(c);
    LoaderState s = a->state();
    std::vector<int64_t> v1 = {1, 0, 5, 0, 3, s.fingerprint};
    auto b = DataLoader::open(c);
    b->restore(LoaderState::from_vector(v1));
    EXPECT_EQ(b->state().next_doc, 5);
    EXPECT_EQ(b->state().batches, 3);
  }
  EXPECT_THROW(LoaderState::from_vector({2, 0, 0, 0, 0, 0, 1, 4, 1, 2}), UserError);  // 4 ids, 2 given
  EXPECT_THROW(LoaderState::from_vector({2, 0, 0, 0, 0, 0, 7, 0}), UserError);  // packing 7
}

}  // namespace
}  // namespace hp
