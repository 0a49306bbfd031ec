// PackedBatch: one rank's share of a global batch, packed into rows of T tokens, with the
// sequence metadata every layer needs (docs/architecture.md, "Rule 1: metadata once per batch").
//
// Built once per batch on the host from the loader's document boundaries; the backend uploads it
// once (Backend::upload_batch) and every layer of forward and backward reads that one BatchMeta.
// Nothing here is ever recomputed from device data on the hot path, so metadata costs 0 syncs.
#pragma once

#include <cstdint>
#include <vector>

namespace hp {

// One row of T+1 tokens as the loader packed it: pieces of EOT-terminated documents, then
// padding. segments[i] is the length of the i-th piece in tokens of this row; padding is the
// trailing `pad` tokens (filled with EOT).
struct PackedRow {
  std::vector<int32_t> tokens;    // T + 1 tokens
  std::vector<int32_t> segments;  // lengths of the document pieces, in order
  int32_t pad = 0;                // trailing padding tokens
  // Empty, or T + 1 entries: 0 where the token must not be a target (the prediction of it is
  // ignored like a padding target), 1 where it counts. From the source's loss mask.
  std::vector<uint8_t> loss_mask;
};

struct PackedBatch {
  int64_t rows = 0;
  int64_t seq_len = 0;  // T
  // Flattened over rows: token t = row * T + i.
  std::vector<int32_t> inputs;      // row[0:T]
  std::vector<int32_t> targets;     // row[1:T+1]; -1 where ignored (EOT position, piece end, pad,
                                    // a target whose loss mask is 0)
  std::vector<int32_t> positions;   // position within the document piece, restarting at 0
  std::vector<int32_t> cu_seqlens;  // n_seqs + 1 offsets into the flattened tokens
  int32_t max_seqlen = 0;
  int64_t num_valid_targets = 0;  // on this rank
  // Input positions that hold a document's token, on this rank: num_tokens() less the padding.
  // Throughput and MFU count these, never the padding.
  int64_t num_doc_tokens = 0;
  // Per sequence of cu_seqlens: 1 where it is a row's padding, not a document piece.
  std::vector<uint8_t> seq_is_pad;

  // Positions (input tokens) of the batch on this rank, padding included.
  int64_t num_tokens() const { return rows * seq_len; }
  int64_t num_seqs() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }

  // Builds the metadata from rows of T+1 tokens. Throws if a row is malformed.
  static PackedBatch from_rows(const std::vector<PackedRow>& rows, int64_t seq_len);
  // Builds from flat arrays (used by tests and tools): positions define the sequences (a new
  // sequence starts at every position 0).
  static PackedBatch from_tokens(std::vector<int32_t> inputs, std::vector<int32_t> targets,
                                 std::vector<int32_t> positions, int64_t seq_len);

  // Sum over the document pieces (padding left out) of the causal attention pairs, for MFU
  // accounting, with an optional window.
  double attention_pairs(int64_t window) const;
};

}  // namespace hp
