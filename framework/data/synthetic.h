// SyntheticSource: an endless stream of documents from a seeded order-2 Markov chain whose
// entropy is known exactly, so a training run can be judged against the best achievable loss.
//
// Content tokens are 0..Vc-1 (Vc = content_vocab, the EOT id is not among them). Document i:
//   - the first token is uniform over the content tokens;
//   - then, repeatedly: with probability p = 1/mean_doc_len emit EOT and end; otherwise emit the
//     next content token from P(.|a,b), where (a,b) are the previous two tokens (a = the sentinel
//     kNoContext for the step after the first token).
// P(.|a,b) is a Zipf law over ranks, q(r) ∝ 1/(r+1)^zipf, mapped to tokens by a pseudo-random
// permutation π_{a,b} of the content tokens, one per context, keyed by
// Philox(seed, "data.synthetic.table"). Every context has the same entropy H_zipf, so every
// valid target (each token after a document's first, its EOT included) has conditional entropy
// exactly H_b(p) + (1-p)·H_zipf given the document so far: entropy_floor().
//
// π_{a,b} is defined without tables (Vc² contexts × Vc entries would not fit for large Vc):
// rank → token is a keyed bijection on [0, 2^m) (rounds of odd multiply, add and xor-shift, keys
// from one Philox block of the context) restricted to [0, Vc) by cycle walking, so it costs a few
// integer operations per token and has a cheap inverse (rank_of). For small Vc ((Vc+1)·Vc² <=
// 2^20 entries, i.e. Vc <= 101) the same permutations are also tabulated at construction, purely
// as a cache. Ranks are drawn with Walker's alias method (one uniform, O(1)).
//
// Document i draws from Philox(seed, "data.synthetic") at counter i a key for its own stream,
// so any document can be generated without the ones before it. Its length is drawn up front by
// inverting the geometric law with one 53-bit uniform, which is the same distribution as the
// step-by-step stop decision (lengths are never capped; the inversion's resolution bounds them
// at about 37·mean_doc_len, an event of probability 2^-53).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "framework/core/rng.h"
#include "framework/data/document_source.h"

namespace hp {

struct SyntheticParams {
  int64_t vocab_size = 0;     // ids the model knows; content tokens and EOT must be below it
  int32_t eot_token = -1;     // must not be a content token (>= content_vocab)
  int64_t content_vocab = 0;  // Vc >= 2
  double zipf = 1.0;          // exponent s >= 0 (0: uniform)
  double mean_doc_len = 64;   // 1/p, >= 1: the mean number of content tokens per document
  // When doc_len_max > 0: document lengths (EOT included) uniform in [doc_len_min, doc_len_max)
  // instead of geometric, as realistic corpora have documents of hundreds to thousands of
  // tokens. The stop is then not memoryless, so entropy_floor() is not known (NaN).
  int64_t doc_len_min = 0;
  int64_t doc_len_max = 0;
  uint64_t seed = 0;
};

// Throws UserError(kConfig) naming the key of the first parameter out of range.
void validate_synthetic_params(const SyntheticParams& p);

class SyntheticSource final : public DocumentSource {
 public:
  static constexpr int32_t kNoContext = -1;  // the `a` of the step after a document's first token

  // Validates the parameters (UserError naming the DataConfig key on a bad one).
  explicit SyntheticSource(const SyntheticParams& params);

  int64_t num_documents() const override { return -1; }
  int64_t num_tokens() const override { return -1; }
  int64_t document_length(int64_t i) const override;
  void read(int64_t i, int64_t offset, int64_t count, int32_t* out) override;
  std::string describe() const override;
  uint64_t fingerprint() const override;
  // H_b(p) + (1-p)·H_zipf in nats: the exact conditional entropy of every valid target, hence a
  // lower bound on the mean loss any model can reach on this data.
  double entropy_floor() const override;

  // Document i in full (ends with EOT).
  std::vector<int32_t> document(int64_t i) const;
  // log P(next | a, b): the probability that the token after content tokens (a, b) is `next`,
  // stop decision included (next == EOT: log p). a may be kNoContext.
  double log_prob(int32_t a, int32_t b, int32_t next) const;
  // The content token of Zipf rank `rank` in context (a, b), and its inverse.
  int32_t token_at_rank(int32_t a, int32_t b, int64_t rank) const;
  int64_t rank_of(int32_t a, int32_t b, int32_t token) const;

  const SyntheticParams& params() const { return params_; }

 private:
  // Generation state inside one document: the next position and the two previous tokens.
  struct Cursor {
    int64_t doc = -1;
    int64_t pos = 0;
    int64_t length = 0;
    uint64_t key = 0;
    int32_t a = 0, b = 0;
  };
  struct Bijection {
    uint64_t mul[3], add[3];
  };

  void start(Cursor& c, int64_t doc) const;
  int32_t step(Cursor& c) const;
  int64_t sample_rank(double u) const;
  Bijection bijection(int32_t a, int32_t b) const;
  uint64_t permute(const Bijection& f, uint64_t x) const;
  uint64_t unpermute(const Bijection& f, uint64_t y) const;

  SyntheticParams params_;
  double p_ = 0;
  double log_continue_ = 0;  // log(1 - p); -inf when p == 1
  double h_zipf_ = 0;
  std::vector<double> alias_prob_;  // Walker alias table over ranks: keep column i with
  std::vector<int32_t> alias_;      // probability alias_prob_[i], else take alias_[i]
  std::vector<double> rank_log_q_;
  std::vector<uint16_t> table_;  // π_{a,b}(rank) at ((a·Vc) + b)·Vc + rank; empty for large Vc
  int bits_ = 0, shift_ = 0;
  uint64_t mask_ = 0;
  Philox doc_rng_;
  // Each document's own stream is Philox(document key, doc_purpose_): counter 0 for its length,
  // counter pos + 1 for the token at pos.
  uint64_t doc_purpose_ = hash64("data.synthetic.doc");
  Philox table_rng_;
  Cursor cursor_;  // where the last read stopped; sequential reads continue from it
};

}  // namespace hp
