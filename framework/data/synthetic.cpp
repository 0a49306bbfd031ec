#include "framework/data/synthetic.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "framework/core/error.h"

namespace hp {
namespace {

uint64_t odd_inverse(uint64_t m) {
  // Newton's iteration doubles the correct low bits each step: 3 -> 6 -> ... -> 96 >= 64.
  uint64_t x = m;
  for (int i = 0; i < 5; ++i) x *= 2 - m * x;
  return x;
}

uint64_t bits_of(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

}  // namespace

void validate_synthetic_params(const SyntheticParams& p) {
  if (p.vocab_size < 1)
    HP_USER_ERROR(ErrorKind::kConfig, "vocab_size must be >= 1 (got ", p.vocab_size, ")");
  if (p.eot_token < 0 || p.eot_token >= p.vocab_size)
    HP_USER_ERROR(ErrorKind::kConfig, "eot_token ", p.eot_token,
                  " is not a token id: valid ids are 0..vocab_size-1 = ", p.vocab_size - 1);
  if (p.content_vocab < 2 || p.content_vocab > p.vocab_size)
    HP_USER_ERROR(ErrorKind::kConfig, "synthetic_vocab ", p.content_vocab,
                  " is out of range: the synthetic source needs 2 <= synthetic_vocab <= "
                  "vocab_size (",
                  p.vocab_size, ")");
  if (p.eot_token < p.content_vocab)
    HP_USER_ERROR(ErrorKind::kConfig, "eot_token ", p.eot_token,
                  " is one of the synthetic content tokens 0..synthetic_vocab-1 = 0..",
                  p.content_vocab - 1, "; use synthetic_vocab <= eot_token");
  if (p.content_vocab > (int64_t{1} << 30))
    HP_USER_ERROR(ErrorKind::kConfig, "synthetic_vocab ", p.content_vocab,
                  " is too large (max 2^30)");
  if (!(p.zipf >= 0) || !std::isfinite(p.zipf))
    HP_USER_ERROR(ErrorKind::kConfig, "synthetic_zipf must be a finite number >= 0 (got ", p.zipf,
                  ")");
  if (!(p.mean_doc_len >= 1) || !(p.mean_doc_len <= 1e12))
    HP_USER_ERROR(ErrorKind::kConfig, "synthetic_mean_doc_len must be in [1, 1e12] (got ",
                  p.mean_doc_len, ")");

  if (p.doc_len_max > 0 && !(p.doc_len_min >= 2 && p.doc_len_min < p.doc_len_max))
    HP_USER_ERROR(ErrorKind::kConfig, "synthetic_doc_len=uniform:", p.doc_len_min, ":",
                  p.doc_len_max, " needs 2 <= MIN < MAX (lengths count the EOT)");
}

SyntheticSource::SyntheticSource(const SyntheticParams& params)
    : params_(params),
      doc_rng_(params.seed, "data.synthetic"),
      table_rng_(params.seed, "data.synthetic.table") {
  validate_synthetic_params(params_);
  const SyntheticParams& p = params_;
  p_ = 1.0 / p.mean_doc_len;
  log_continue_ = std::log1p(-p_);
  const int64_t vc = p.content_vocab;
  std::vector<double> q(vc);
  double z = 0;
  for (int64_t r = 0; r < vc; ++r) z += q[r] = std::pow(static_cast<double>(r + 1), -p.zipf);
  rank_log_q_.resize(vc);
  for (int64_t r = 0; r < vc; ++r) {
    q[r] /= z;
    rank_log_q_[r] = std::log(q[r]);
    if (q[r] > 0) h_zipf_ -= q[r] * rank_log_q_[r];  // a rank that underflowed adds 0, not NaN
  }

  // Walker/Vose alias table: column i keeps its own rank with probability alias_prob_[i] and
  // gives the rest of its 1/Vc share to alias_[i]; every rank's total is exactly q(r).
  alias_prob_.assign(vc, 1.0);
  alias_.resize(vc);
  std::vector<double> scaled(vc);
  std::vector<int32_t> small, large;
  for (int64_t r = 0; r < vc; ++r) {
    alias_[r] = static_cast<int32_t>(r);
    scaled[r] = q[r] * static_cast<double>(vc);
    (scaled[r] < 1.0 ? small : large).push_back(static_cast<int32_t>(r));
  }
  while (!small.empty() && !large.empty()) {
    const int32_t s = small.back(), l = large.back();
    small.pop_back();
    large.pop_back();
    alias_prob_[s] = scaled[s];
    alias_[s] = l;
    scaled[l] -= 1.0 - scaled[s];
    (scaled[l] < 1.0 ? small : large).push_back(l);
  }

  bits_ = 2;
  while ((int64_t{1} << bits_) < vc) ++bits_;
  mask_ = (uint64_t{1} << bits_) - 1;
  shift_ = (bits_ + 1) / 2;  // x ^= x >> shift is its own inverse when 2·shift >= bits

  if ((vc + 1) * vc * vc <= (int64_t{1} << 20)) {
    table_.resize(static_cast<size_t>((vc + 1) * vc * vc));
    for (int64_t a = 0; a <= vc; ++a) {
      for (int64_t b = 0; b < vc; ++b) {
        const Bijection f = bijection(static_cast<int32_t>(a), static_cast<int32_t>(b));
        uint16_t* row = &table_[static_cast<size_t>((a * vc + b) * vc)];
        for (int64_t r = 0; r < vc; ++r) row[r] = static_cast<uint16_t>(permute(f, r));
      }
    }
  }
}

double SyntheticSource::entropy_floor() const {
  if (params_.doc_len_max > 0) return std::numeric_limits<double>::quiet_NaN();
  const double p = p_;
  const double hb = (p > 0 && p < 1) ? -p * std::log(p) - (1 - p) * std::log1p(-p) : 0.0;
  return hb + (1 - p) * h_zipf_;
}

int64_t SyntheticSource::document_length(int64_t i) const {
  HP_CHECK(i >= 0, "document ", i);
  if (p_ >= 1) return 2;
  const Philox rng(doc_rng_.u64(static_cast<uint64_t>(i)), doc_purpose_);
  if (params_.doc_len_max > 0)
    return params_.doc_len_min +
           static_cast<int64_t>(
               rng.below(0, static_cast<uint64_t>(params_.doc_len_max - params_.doc_len_min)));
  const double u = 1.0 - rng.uniform(0);  // (0, 1]
  // Content tokens after the first: the number of "continue" outcomes before the first stop.
  const double extra = std::floor(std::log(u) / log_continue_);
  return 2 + static_cast<int64_t>(extra);
}

void SyntheticSource::start(Cursor& c, int64_t doc) const {
  c.doc = doc;
  c.pos = 0;
  c.length = document_length(doc);
  c.key = doc_rng_.u64(static_cast<uint64_t>(doc));
  c.a = c.b = static_cast<int32_t>(params_.content_vocab);  // the sentinel context
}

int32_t SyntheticSource::step(Cursor& c) const {
  const Philox rng(c.key, doc_purpose_);
  int32_t tok;
  if (c.pos == c.length - 1) {
    tok = params_.eot_token;
  } else if (c.pos == 0) {
    tok = static_cast<int32_t>(rng.below(1, static_cast<uint64_t>(params_.content_vocab)));
  } else {
    const int64_t rank = sample_rank(rng.uniform(static_cast<uint64_t>(c.pos) + 1));
    const int64_t vc = params_.content_vocab;
    tok = table_.empty()
              ? static_cast<int32_t>(permute(bijection(c.a, c.b), static_cast<uint64_t>(rank)))
              : table_[static_cast<size_t>((c.a * vc + c.b) * vc + rank)];
  }
  c.a = c.b;
  c.b = tok;
  ++c.pos;
  return tok;
}

void SyntheticSource::read(int64_t i, int64_t offset, int64_t count, int32_t* out) {
  HP_CHECK(i >= 0 && offset >= 0 && count >= 0, "read(", i, ", ", offset, ", ", count, ")");
  // The chain needs the two tokens before `offset`, so generation always runs from the
  // document start; the cursor makes the pieces of a cut document cost one pass in total.
  if (cursor_.doc != i || cursor_.pos > offset) start(cursor_, i);
  HP_CHECK(offset + count <= cursor_.length, "read past the end of synthetic document ", i, ": ",
           offset, "+", count, " > ", cursor_.length);
  while (cursor_.pos < offset) step(cursor_);
  for (int64_t k = 0; k < count; ++k) out[k] = step(cursor_);
}

std::vector<int32_t> SyntheticSource::document(int64_t i) const {
  Cursor c;
  start(c, i);
  std::vector<int32_t> doc(static_cast<size_t>(c.length));
  for (auto& t : doc) t = step(c);
  return doc;
}

int64_t SyntheticSource::sample_rank(double u) const {
  // One uniform picks the column (integer part) and decides the coin (fractional part).
  const int64_t vc = params_.content_vocab;
  const double x = u * static_cast<double>(vc);
  const int64_t i = std::min(static_cast<int64_t>(x), vc - 1);
  return x - static_cast<double>(i) < alias_prob_[i] ? i : alias_[i];
}

SyntheticSource::Bijection SyntheticSource::bijection(int32_t a, int32_t b) const {
  const int64_t vc = params_.content_vocab;
  const int64_t ai = a == kNoContext ? vc : a;
  HP_CHECK(ai >= 0 && ai <= vc && b >= 0 && b < vc, "context (", a, ", ", b, ")");
  const auto w = table_rng_.block(static_cast<uint64_t>(ai * vc + b));
  Bijection f;
  const uint64_t w01 = (uint64_t{w[0]} << 32) | w[1], w23 = (uint64_t{w[2]} << 32) | w[3];
  f.mul[0] = w01 | 1;
  f.add[0] = w23;
  f.mul[1] = (w23 * 0x9E3779B97F4A7C15ull) | 1;
  f.add[1] = w01 * 0xC2B2AE3D27D4EB4Full;
  f.mul[2] = ((w01 ^ w23) * 0x165667B19E3779F9ull) | 1;
  f.add[2] = (w01 + w23) * 0xD6E8FEB86659FD93ull;
  return f;
}

uint64_t SyntheticSource::permute(const Bijection& f, uint64_t x) const {
  const uint64_t vc = static_cast<uint64_t>(params_.content_vocab);
  // Cycle walking: the bijection of [0, 2^m) restricted to [0, Vc) by following each element's
  // cycle until it lands back inside; 2^m < 2·Vc, so that takes under two steps on average.
  do {
    for (int r = 0; r < 3; ++r) {
      x = (x * f.mul[r] + f.add[r]) & mask_;
      x ^= x >> shift_;
    }
  } while (x >= vc);
  return x;
}

uint64_t SyntheticSource::unpermute(const Bijection& f, uint64_t y) const {
  const uint64_t vc = static_cast<uint64_t>(params_.content_vocab);
  const uint64_t inv[3] = {odd_inverse(f.mul[0]), odd_inverse(f.mul[1]), odd_inverse(f.mul[2])};
  do {
    for (int r = 2; r >= 0; --r) {
      y ^= y >> shift_;
      y = ((y - f.add[r]) * inv[r]) & mask_;
    }
  } while (y >= vc);
  return y;
}

int32_t SyntheticSource::token_at_rank(int32_t a, int32_t b, int64_t rank) const {
  HP_CHECK(rank >= 0 && rank < params_.content_vocab, "rank ", rank);
  return static_cast<int32_t>(permute(bijection(a, b), static_cast<uint64_t>(rank)));
}

int64_t SyntheticSource::rank_of(int32_t a, int32_t b, int32_t token) const {
  HP_CHECK(token >= 0 && token < params_.content_vocab, "token ", token, " is not a content token");
  return static_cast<int64_t>(unpermute(bijection(a, b), static_cast<uint64_t>(token)));
}

double SyntheticSource::log_prob(int32_t a, int32_t b, int32_t next) const {
  if (next == params_.eot_token) return std::log(p_);
  if (next < 0 || next >= params_.content_vocab) return -std::numeric_limits<double>::infinity();
  return log_continue_ + rank_log_q_[rank_of(a, b, next)];
}

std::string SyntheticSource::describe() const {
  return str_cat("synthetic order-2 Markov chain: ", params_.content_vocab, " content tokens, EOT ",
                 params_.eot_token, ", zipf ", params_.zipf,
                 params_.doc_len_max > 0 ? str_cat(", doc lengths uniform ", params_.doc_len_min,
                                                   "..", params_.doc_len_max - 1)
                                         : str_cat(", mean_doc_len ", params_.mean_doc_len),
                 ", seed ", params_.seed, ", entropy floor ", entropy_floor(), " nats/target");
}

uint64_t SyntheticSource::fingerprint() const {
  uint64_t h = hash64("synthetic");
  for (uint64_t v :
       {static_cast<uint64_t>(params_.content_vocab), static_cast<uint64_t>(params_.eot_token),
        bits_of(params_.zipf), bits_of(params_.mean_doc_len), params_.seed}) {
    h = hash64(std::to_string(v), h ^ 0x2F);
  }
  if (params_.doc_len_max > 0)  // geometric sources keep the fingerprints they always had
    h = hash64(str_cat("uniform:", params_.doc_len_min, ":", params_.doc_len_max), h ^ 0x2F);
  return h;
}

}  // namespace hp
