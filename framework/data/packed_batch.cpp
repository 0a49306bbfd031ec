#include "framework/data/packed_batch.h"

#include <algorithm>
#include <cstdint>

#include "framework/core/error.h"

namespace hp {

PackedBatch PackedBatch::from_rows(const std::vector<PackedRow>& rows, int64_t seq_len) {
  HP_CHECK(seq_len >= 1, "seq_len ", seq_len);
  PackedBatch b;
  b.rows = static_cast<int64_t>(rows.size());
  b.seq_len = seq_len;
  HP_CHECK(b.rows * seq_len <= INT32_MAX, b.rows, " rows of ", seq_len,
           " tokens overflow the int32 cu_seqlens");
  const size_t n = static_cast<size_t>(b.rows * seq_len);
  b.inputs.resize(n);
  b.targets.resize(n);
  b.positions.resize(n);
  b.cu_seqlens.reserve(rows.size() * 4 + 1);
  b.cu_seqlens.push_back(0);
  b.seq_is_pad.reserve(rows.size() * 4);

  for (int64_t r = 0; r < b.rows; ++r) {
    const PackedRow& row = rows[r];
    HP_CHECK(static_cast<int64_t>(row.tokens.size()) == seq_len + 1, "row ", r, " holds ",
             row.tokens.size(), " tokens, expected seq_len + 1 = ", seq_len + 1);
    HP_CHECK(row.pad >= 0, "row ", r, " has pad ", row.pad);
    HP_CHECK(row.loss_mask.empty() || static_cast<int64_t>(row.loss_mask.size()) == seq_len + 1,
             "row ", r, " has a loss mask of ", row.loss_mask.size(), " entries, expected ",
             seq_len + 1);
    const bool masked = !row.loss_mask.empty();
    int64_t covered = row.pad;
    for (int32_t len : row.segments) {
      HP_CHECK(len > 0, "row ", r, " has a segment of length ", len);
      covered += len;
    }
    HP_CHECK(covered == seq_len + 1, "row ", r, ": segments plus pad cover ", covered,
             " tokens, expected seq_len + 1 = ", seq_len + 1);

    const int64_t base = r * seq_len;
    std::copy(row.tokens.begin(), row.tokens.begin() + seq_len, b.inputs.begin() + base);
    // The pad region is treated as one more segment: it gets positions and a cu_seqlens entry
    // like a document, so the attention kernel never sees a sequence that spans two documents.
    auto emit = [&](int64_t start, int64_t end, bool is_pad) {
      // [start, end) in row coordinates 0..T+1; inputs only cover 0..T, so the segment that runs
      // into row[T] is clipped there (its last token is then only ever a target).
      const int64_t clipped = std::min(end, seq_len);
      if (clipped <= start) return;
      for (int64_t i = start; i < clipped; ++i) {
        b.positions[base + i] = static_cast<int32_t>(i - start);
        // The token after the last one of a segment belongs to another segment (or is pad), so
        // it is not a prediction the model can make from this segment's context.
        const bool last = i == end - 1;
        const bool counted = !masked || row.loss_mask[static_cast<size_t>(i + 1)] != 0;
        b.targets[base + i] = (is_pad || last || !counted) ? -1 : row.tokens[i + 1];
      }
      b.cu_seqlens.push_back(static_cast<int32_t>(base + clipped));
      b.seq_is_pad.push_back(is_pad ? 1 : 0);
      if (!is_pad) b.num_doc_tokens += clipped - start;
      b.max_seqlen = std::max(b.max_seqlen, static_cast<int32_t>(clipped - start));
    };
    int64_t start = 0;
    for (int32_t len : row.segments) {
      emit(start, start + len, false);
      start += len;
    }
    if (row.pad > 0) emit(start, start + row.pad, true);
  }
  b.num_valid_targets =
      std::count_if(b.targets.begin(), b.targets.end(), [](int32_t t) { return t >= 0; });
  return b;
}

PackedBatch PackedBatch::from_tokens(std::vector<int32_t> inputs, std::vector<int32_t> targets,
                                     std::vector<int32_t> positions, int64_t seq_len) {
  HP_CHECK(seq_len >= 1, "seq_len ", seq_len);
  const int64_t n = static_cast<int64_t>(inputs.size());
  HP_CHECK(static_cast<int64_t>(targets.size()) == n && static_cast<int64_t>(positions.size()) == n,
           "inputs, targets and positions differ in length: ", n, ", ", targets.size(), ", ",
           positions.size());
  HP_CHECK(n % seq_len == 0, "token count ", n, " is not a multiple of seq_len ", seq_len);
  HP_CHECK(n <= INT32_MAX, n, " tokens overflow the int32 cu_seqlens");
  PackedBatch b;
  b.rows = n / seq_len;
  b.seq_len = seq_len;
  b.cu_seqlens.push_back(0);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t i = t % seq_len;
    if (i == 0) {
      HP_CHECK(positions[t] == 0, "row ", t / seq_len, " starts with position ", positions[t],
               ", expected 0 (a sequence never spans two rows)");
    } else if (positions[t] == 0) {
      b.cu_seqlens.push_back(static_cast<int32_t>(t));
    } else {
      HP_CHECK(positions[t] == positions[t - 1] + 1, "position ", positions[t], " at token ", t,
               " does not follow ", positions[t - 1], " (positions restart at 0 or count up by 1)");
    }
    if (i == seq_len - 1) b.cu_seqlens.push_back(static_cast<int32_t>(t + 1));
    HP_CHECK(targets[t] >= -1, "target ", targets[t], " at token ", t, " (valid: >= 0, or -1)");
  }
  for (size_t s = 1; s < b.cu_seqlens.size(); ++s) {
    b.max_seqlen = std::max(b.max_seqlen, b.cu_seqlens[s] - b.cu_seqlens[s - 1]);
  }
  b.num_valid_targets =
      std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t >= 0; });
  b.num_doc_tokens = n;  // no padding: every position belongs to a sequence of the caller's
  b.seq_is_pad.assign(b.cu_seqlens.size() - 1, 0);
  b.inputs = std::move(inputs);
  b.targets = std::move(targets);
  b.positions = std::move(positions);
  return b;
}

double PackedBatch::attention_pairs(int64_t window) const {
  double pairs = 0;
  for (size_t s = 1; s < cu_seqlens.size(); ++s) {
    if (s - 1 < seq_is_pad.size() && seq_is_pad[s - 1] != 0) continue;
    const double len = cu_seqlens[s] - cu_seqlens[s - 1];
    if (window <= 0 || window >= len) {
      pairs += len * (len + 1) / 2;
    } else {
      // Query i sees min(i + 1, W) keys: a triangle of W rows, then full windows.
      const double w = static_cast<double>(window);
      pairs += w * (w + 1) / 2 + (len - w) * w;
    }
  }
  return pairs;
}

}  // namespace hp
