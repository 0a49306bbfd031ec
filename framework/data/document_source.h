// DocumentSource: where the loader's documents come from (token files or the synthetic chain).
//
// A source is an indexed set of documents, each a run of token ids ending with the EOT token.
// The loader packs rows knowing only document lengths, and asks for token contents only of the
// rows its rank keeps, so `document_length` must be cheap and `read` may be the expensive part.
//
// Not thread-safe: one loader owns one source and calls it from one thread.
#pragma once

#include <cstdint>
#include <limits>
#include <string>

namespace hp {

class DocumentSource {
 public:
  virtual ~DocumentSource() = default;

  // Number of documents, or -1 for an endless stream (every index >= 0 is a document).
  virtual int64_t num_documents() const = 0;
  // Total tokens over all documents (appended EOTs included), or -1 for an endless stream.
  virtual int64_t num_tokens() const = 0;
  // Length of document i in tokens, including its final EOT; always >= 1.
  virtual int64_t document_length(int64_t i) const = 0;
  // Writes tokens [offset, offset + count) of document i to out[0:count]. Reads in increasing
  // (document, offset) order are the fast path; any order is correct.
  virtual void read(int64_t i, int64_t offset, int64_t count, int32_t* out) = 0;

  // Whether the source carries a per-token loss mask (SFT data: only answer tokens count).
  virtual bool has_loss_mask() const { return false; }
  // Writes the mask of tokens [offset, offset + count) of document i to out[0:count]: 1 where
  // the token is a target the loss counts, 0 where it is context only. Default: all 1.
  virtual void read_loss_mask(int64_t i, int64_t offset, int64_t count, uint8_t* out) {
    (void)i;
    (void)offset;
    for (int64_t k = 0; k < count; ++k) out[k] = 1;
  }

  // One line for logs: what the source is and how big.
  virtual std::string describe() const = 0;
  // Identifies the data (files' document and token counts, or the synthetic parameters), so a
  // saved loader position is never applied to different data.
  virtual uint64_t fingerprint() const = 0;
  // Lower bound on the mean loss per valid target, in nats, where the source knows it (the
  // synthetic chain); NaN otherwise.
  virtual double entropy_floor() const { return std::numeric_limits<double>::quiet_NaN(); }
};

}  // namespace hp
