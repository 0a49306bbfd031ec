// libFuzzer harness of the token-file readers: the input is one file, opened as an llm.c shard
// (fuzz_bin_tokens) or an HDF5 token file (fuzz_h5_tokens, HP_FUZZ_H5). A file the reader accepts
// must then behave: every document reads back in full and in pieces with ids below vocab_size,
// and a DataLoader over it packs well-formed batches.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "framework/data/loader.h"
#include "framework/data/token_files.h"
#include "tests/fuzz/fuzz_common.h"

namespace {

constexpr int64_t kVocab = 50257;
constexpr int32_t kEot = 50256;

void exercise(hp::DocumentSource& src) {
  const int64_t docs = src.num_documents();
  HP_FUZZ_REQUIRE(docs >= 0);
  int64_t total = 0;
  std::vector<int32_t> buf, piece;
  for (int64_t i = 0; i < docs; ++i) {
    const int64_t len = src.document_length(i);
    HP_FUZZ_REQUIRE(len >= 1);
    total += len;
    if (i >= 64) continue;  // bounded work per input; lengths are still summed
    buf.assign(static_cast<size_t>(len), -1);
    src.read(i, 0, len, buf.data());
    for (int32_t t : buf) HP_FUZZ_REQUIRE(t >= 0 && t < kVocab);
    HP_FUZZ_REQUIRE(buf.back() == kEot);
    // The same tokens in two pieces.
    const int64_t cut = len / 2;
    piece.assign(static_cast<size_t>(len), -1);
    src.read(i, 0, cut, piece.data());
    src.read(i, cut, len - cut, piece.data() + cut);
    HP_FUZZ_REQUIRE(piece == buf);
  }
  HP_FUZZ_REQUIRE(total == src.num_tokens());
}

void pack(std::unique_ptr<hp::DocumentSource> src) {
  if (src->num_documents() == 0) return;
  hp::DataConfig c;
  c.source = "fuzz";
  c.vocab_size = kVocab;
  c.eot_token = kEot;
  c.seq_len = 16;
  c.rows_per_batch = 2;
  c.seed = 1;
  hp::DataLoader loader(c, std::move(src));
  for (int b = 0; b < 3; ++b) {
    const hp::PackedBatch batch = loader.next();
    HP_FUZZ_REQUIRE(batch.rows == 2 && batch.seq_len == 16);
    for (int32_t t : batch.inputs) HP_FUZZ_REQUIRE(t >= 0 && t < kVocab);
    HP_FUZZ_REQUIRE(batch.cu_seqlens.front() == 0 && batch.cu_seqlens.back() == 32);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  hp::fuzz::quiet_logs();
#ifdef HP_FUZZ_H5
  if (!hp::fuzz::checksummed_hdf5(data, size)) return 0;
#endif
  const hp::fuzz::ScratchFile file(data, size);
  hp::fuzz::expect_clean([&] {
#ifdef HP_FUZZ_H5
    auto src = hp::open_h5_tokens(file.path(), kVocab, kEot);
#else
    auto src = hp::open_bin_shard(file.path(), kVocab, kEot);
#endif
    exercise(*src);
    pack(std::move(src));
  });
  return 0;
}
