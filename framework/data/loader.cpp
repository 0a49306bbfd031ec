#include "framework/data/loader.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "framework/core/error.h"
#include "framework/core/log.h"
#include "framework/core/rng.h"
#include "framework/data/synthetic.h"
#include "framework/data/token_files.h"

namespace hp {
namespace {

// Format 1 (epoch, next_doc, doc_offset, batches, fingerprint) is still read: its position means
// the same in both packings, with an empty window. Format 2 adds the packing and the window.
constexpr int64_t kStateFormat = 2;
constexpr size_t kStateFieldsV1 = 6;
constexpr size_t kStateFieldsV2 = 8;  // + packing, window size; then the window's ids

void validate(const DataConfig& c) {
  if (c.vocab_size < 1 || c.vocab_size > INT32_MAX)
    HP_USER_ERROR(ErrorKind::kConfig, "vocab_size must be in 1..2^31-1 (got ", c.vocab_size, ")");
  if (c.eot_token < 0 || c.eot_token >= c.vocab_size)
    HP_USER_ERROR(ErrorKind::kConfig, "eot_token ", c.eot_token,
                  " is not a token id: valid ids are 0..vocab_size-1 = 0..", c.vocab_size - 1);
  if (c.seq_len < 2 || c.seq_len >= (int64_t{1} << 30))
    HP_USER_ERROR(ErrorKind::kConfig, "seq_len must be in 2..2^30-1 (got ", c.seq_len, ")");
  if (c.rows_per_batch < 1)
    HP_USER_ERROR(ErrorKind::kConfig, "rows_per_batch must be >= 1 (got ", c.rows_per_batch, ")");
  if (c.world < 1 || c.rank < 0 || c.rank >= c.world)
    HP_USER_ERROR(ErrorKind::kConfig, "rank ", c.rank, " is not in 0..world-1 for world size ",
                  c.world);
  if (c.packing_window < 1 || c.packing_window > kMaxPackingWindow)
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'packing_window': must be in 1..",
                  kMaxPackingWindow, " documents (got ", c.packing_window, ")");
  if (c.rows_per_batch % c.world != 0)
    HP_USER_ERROR(ErrorKind::kConfig, "rows_per_batch ", c.rows_per_batch,
                  " (rows of one global batch) is not divisible by the world size ", c.world,
                  ": every rank takes rows_per_batch/world rows; choose a multiple of ", c.world);
}

SyntheticParams synthetic_params(const DataConfig& c) {
  SyntheticParams p;
  p.vocab_size = c.vocab_size;
  p.eot_token = c.eot_token;
  p.content_vocab = c.synthetic_vocab != 0 ? c.synthetic_vocab : c.eot_token;
  p.zipf = c.synthetic_zipf;
  p.mean_doc_len = c.synthetic_mean_doc_len;
  p.doc_len_min = c.synthetic_doc_len.min;
  p.doc_len_max = c.synthetic_doc_len.max;
  p.seed = c.seed;
  return p;
}

}  // namespace

const char* packing_name(Packing p) { return p == Packing::kWhole ? "whole" : "stream"; }

DocLength parse_doc_length(const std::string& s) {
  DocLength d;
  if (s == "geometric") return d;
  long long a = 0, b = 0;
  char tail = 0;
  if (std::sscanf(s.c_str(), "uniform:%lld:%lld%c", &a, &b, &tail) != 2 || a < 2 || b <= a)
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'synthetic_doc_len': '", s,
                  "' is not 'geometric' or 'uniform:MIN:MAX' with 2 <= MIN < MAX (lengths count "
                  "the EOT), e.g. uniform:64:4096");
  d.min = a;
  d.max = b;
  return d;
}

std::string DocLength::str() const {
  return uniform() ? str_cat("uniform:", min, ":", max) : std::string("geometric");
}

std::vector<int64_t> LoaderState::to_vector() const {
  std::vector<int64_t> v = {kStateFormat, epoch,
                            next_doc,     doc_offset,
                            batches,      fingerprint,
                            packing == Packing::kWhole ? 1 : 0, static_cast<int64_t>(window.size())};
  v.insert(v.end(), window.begin(), window.end());
  return v;
}

LoaderState LoaderState::from_vector(const std::vector<int64_t>& v) {
  const bool v1 = v.size() == kStateFieldsV1 && v[0] == 1;
  const bool v2 = v.size() >= kStateFieldsV2 && v[0] == kStateFormat && (v[6] == 0 || v[6] == 1) &&
                  v[7] >= 0 && v[7] <= kMaxPackingWindow &&
                  v.size() == kStateFieldsV2 + static_cast<size_t>(v[7]);
  if (!v1 && !v2)
    HP_USER_ERROR(ErrorKind::kData,
                  "saved data loader state is not in a known format (format 1: ", kStateFieldsV1,
                  " integers; format 2: ", kStateFieldsV2,
                  " integers and the packing window's document ids; got ", v.size(), " integers",
                  v.empty() ? "" : str_cat(" starting with ", v[0]), ")");
  LoaderState s;
  s.epoch = v[1];
  s.next_doc = v[2];
  s.doc_offset = v[3];
  s.batches = v[4];
  s.fingerprint = v[5];
  s.packing_recorded = v2;
  if (v2) {
    s.packing = v[6] == 1 ? Packing::kWhole : Packing::kStream;
    s.window.assign(v.begin() + kStateFieldsV2, v.end());
  }
  return s;
}

void validate_data_config(const DataConfig& config) {
  validate(config);
  if (config.source == "synthetic") {
    validate_synthetic_params(synthetic_params(config));
    return;
  }
  if (config.source.empty())
    HP_USER_ERROR(ErrorKind::kConfig,
                  "data source is empty: set it to 'synthetic', a .bin llm.c token shard (or a "
                  "comma-separated list or glob of them) or an .h5/.hdf5 token file");
  for (const std::string& path : expand_source_paths(config.source)) check_token_file(path);
}

bool LoaderState::operator==(const LoaderState& o) const {
  return epoch == o.epoch && next_doc == o.next_doc && doc_offset == o.doc_offset &&
         batches == o.batches && fingerprint == o.fingerprint && packing == o.packing &&
         window == o.window;
}

std::unique_ptr<DataLoader> DataLoader::open(const DataConfig& config) {
  validate_data_config(config);
  std::unique_ptr<DocumentSource> source;
  if (config.source == "synthetic") {
    source = std::make_unique<SyntheticSource>(synthetic_params(config));
  } else {
    source =
        open_token_files(expand_source_paths(config.source), config.vocab_size, config.eot_token);
  }
  return std::make_unique<DataLoader>(config, std::move(source));
}

DataLoader::DataLoader(const DataConfig& config, std::unique_ptr<DocumentSource> source)
    : config_(config), source_(std::move(source)) {
  validate(config_);
  HP_CHECK(source_ != nullptr, "no document source");
  num_docs_ = source_->num_documents();
  if (num_docs_ == 0) HP_USER_ERROR(ErrorKind::kData, "empty data: ", source_->describe());
  // Every document is its EOT alone: every target is the EOT, and a run would learn that.
  if (num_docs_ > 0 && source_->num_tokens() == num_docs_)
    HP_USER_ERROR(ErrorKind::kData, source_->describe(), ": every token is eot_token ",
                  config_.eot_token,
                  ", so there is nothing to learn (is eot_token right? is this the data meant?)");
  if (num_docs_ > static_cast<int64_t>(UINT32_MAX))
    HP_USER_ERROR(ErrorKind::kData, source_->describe(), " holds ", num_docs_,
                  " documents; at most 2^32-1 are supported (split the data set)");
  start_epoch(0);
}

DataLoader::~DataLoader() = default;

void DataLoader::start_epoch(int64_t epoch) {
  epoch_ = epoch;
  order_.clear();
  if (num_docs_ < 0 || !config_.shuffle) return;
  order_.resize(static_cast<size_t>(num_docs_));
  std::iota(order_.begin(), order_.end(), 0u);
  // Fisher-Yates driven by a counter-based stream, so every rank and every resumed run derives
  // the same order from (seed, epoch) alone.
  const Philox rng(config_.seed, hash64(std::to_string(epoch), hash64("data.shuffle")));
  for (int64_t i = num_docs_ - 1; i > 0; --i) {
    const auto j =
        static_cast<int64_t>(rng.below(static_cast<uint64_t>(i), static_cast<uint64_t>(i) + 1));
    std::swap(order_[i], order_[j]);
  }
}

int64_t DataLoader::document_at(int64_t k) const {
  return order_.empty() ? k : static_cast<int64_t>(order_[k]);
}

int64_t DataLoader::take_document() {
  const int64_t doc = document_at(next_doc_);
  if (++next_doc_ == num_docs_) {
    // A data set smaller than a batch would say it for every pass: its second pass within one
    // batch gives one warning instead, and no epoch line after it.
    if (!small_data_warned_ && epoch_logged_batch_ == batches_) {
      log_warn("data: ", source_->describe(), " holds ", source_->num_tokens(),
               " tokens, fewer than one global batch's ",
               config_.rows_per_batch * config_.seq_len,
               " positions: every batch passes over it more than once (no further epoch lines)");
      small_data_warned_ = true;
    } else if (!small_data_warned_) {
      log_info("data: epoch ", epoch_, " done (", num_docs_, " documents, ",
               source_->num_tokens(), " tokens) during global batch ", batches_,
               "; starting epoch ", epoch_ + 1);
    }
    epoch_logged_batch_ = batches_;
    start_epoch(epoch_ + 1);
    next_doc_ = 0;
  }
  return doc;
}

void DataLoader::pack_row(RowPlan& plan) {
  plan.pieces.clear();
  plan.pad = 0;
  if (config_.packing == Packing::kWhole)
    pack_whole_row(plan);
  else
    pack_stream_row(plan);
}

void DataLoader::pack_stream_row(RowPlan& plan) {
  const int64_t T = config_.seq_len;
  int64_t used = 0;
  while (used < T) {
    const int64_t doc = document_at(next_doc_);
    const int64_t left = source_->document_length(doc) - doc_offset_;
    const int64_t take = std::min(left, T - used);
    plan.pieces.push_back({doc, doc_offset_, static_cast<int32_t>(take)});
    used += take;
    if (take == left) {
      take_document();
      doc_offset_ = 0;
    } else {
      doc_offset_ += take;
    }
  }
  // Row position T is only a target: the stream's next token, which also starts the next row.
  const int64_t doc = document_at(next_doc_);
  Piece& last = plan.pieces.back();
  if (last.doc == doc && last.offset + last.count == doc_offset_)
    ++last.count;  // the same document goes on past the cut
  else
    plan.pieces.push_back({doc, doc_offset_, 1});  // the next document's first token
}

void DataLoader::pack_whole_row(RowPlan& plan) {
  // Whole documents fill the row's T+1 tokens: a document may end on row position T, where its
  // EOT is only the last target (an EOT's own prediction is never a target anyway).
  const int64_t cap = config_.seq_len + 1;
  const auto fill = [&] {
    while (static_cast<int64_t>(window_.size()) < config_.packing_window)
      window_.push_back(take_document());
  };
  fill();
  // The oldest document first, so none waits more than packing_window rows.
  const int64_t head = window_.front();
  const int64_t left = source_->document_length(head) - doc_offset_;
  if (left > cap) {
    // Longer than a row: cut as in stream mode, T inputs and the next token as the last target;
    // the next row goes on from that token.
    plan.pieces.push_back({head, doc_offset_, static_cast<int32_t>(cap)});
    doc_offset_ += config_.seq_len;
    return;
  }
  plan.pieces.push_back({head, doc_offset_, static_cast<int32_t>(left)});
  window_.pop_front();
  doc_offset_ = 0;
  int64_t used = left;
  // Best fit: the longest window document that fits the room left (the oldest among equals).
  for (;;) {
    fill();
    const int64_t room = cap - used;
    auto best = window_.end();
    int64_t best_len = 0;
    for (auto it = window_.begin(); it != window_.end(); ++it) {
      const int64_t len = source_->document_length(*it);
      if (len <= room && len > best_len) {
        best = it;
        best_len = len;
      }
    }
    if (best == window_.end()) break;
    plan.pieces.push_back({*best, 0, static_cast<int32_t>(best_len)});
    used += best_len;
    window_.erase(best);
  }
  plan.pad = static_cast<int32_t>(cap - used);
}

PackedRow DataLoader::materialize(const RowPlan& plan) {
  PackedRow row;
  row.tokens.resize(static_cast<size_t>(config_.seq_len + 1));
  row.segments.reserve(plan.pieces.size());
  const bool masked = source_->has_loss_mask();
  if (masked) row.loss_mask.assign(row.tokens.size(), 0);  // padding is never a target
  int64_t pos = 0;
  for (const Piece& p : plan.pieces) {
    source_->read(p.doc, p.offset, p.count, row.tokens.data() + pos);
    if (masked) source_->read_loss_mask(p.doc, p.offset, p.count, row.loss_mask.data() + pos);
    row.segments.push_back(p.count);
    pos += p.count;
  }
  std::fill(row.tokens.begin() + pos, row.tokens.end(), config_.eot_token);
  row.pad = plan.pad;
  return row;
}

PackedBatch DataLoader::next() {
  const int64_t per = rows_per_rank();
  const int64_t first = config_.rank * per;
  std::vector<PackedRow> rows;
  rows.reserve(static_cast<size_t>(per));
  RowPlan plan;
  for (int64_t j = 0; j < config_.rows_per_batch; ++j) {
    pack_row(plan);
    if (j >= first && j < first + per) rows.push_back(materialize(plan));
  }
  ++batches_;
  return PackedBatch::from_rows(rows, config_.seq_len);
}

double DataLoader::entropy_floor() const { return source_->entropy_floor(); }

uint64_t DataLoader::state_fingerprint() const {
  uint64_t h = hash64(std::to_string(source_->fingerprint()), hash64("loader"));
  h = hash64(std::to_string(config_.seed), h);
  if (num_docs_ >= 0) h = hash64(config_.shuffle ? "shuffle" : "in-order", h);
  return h;
}

LoaderState DataLoader::state() const {
  LoaderState s;
  s.epoch = epoch_;
  s.next_doc = next_doc_;
  s.doc_offset = doc_offset_;
  s.batches = batches_;
  s.fingerprint = static_cast<int64_t>(state_fingerprint());
  s.packing = config_.packing;
  s.window.assign(window_.begin(), window_.end());
  return s;
}

void DataLoader::restore(const LoaderState& s) {
  const auto mine = static_cast<int64_t>(state_fingerprint());
  if (s.fingerprint != mine)
    HP_USER_ERROR(ErrorKind::kData,
                  "cannot restore the data position: it was saved for other data or another "
                  "seed/shuffle setting (fingerprint ",
                  s.fingerprint, ", this loader ", mine, " reading ", source_->describe(),
                  " with seed ", config_.seed, ")");
  if (s.packing_recorded && s.packing != config_.packing)
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'packing': the saved data position is of packing=",
                  packing_name(s.packing), ", this run has packing=", packing_name(config_.packing),
                  "; resume with packing=", packing_name(s.packing),
                  " (the batches of one packing do not continue in the other)");
  const bool endless = num_docs_ < 0;
  const auto is_doc = [&](int64_t d) { return d >= 0 && (endless || d < num_docs_); };
  const bool ok = s.epoch >= 0 && (!endless || s.epoch == 0) && s.next_doc >= 0 &&
                  (endless || s.next_doc < num_docs_) && s.batches >= 0 && s.doc_offset >= 0 &&
                  std::all_of(s.window.begin(), s.window.end(), is_doc);
  if (!ok)
    HP_USER_ERROR(ErrorKind::kData, "saved data position is out of range for ", source_->describe(),
                  ": epoch ", s.epoch, ", document ", s.next_doc, ", batch ", s.batches,
                  s.window.empty() ? "" : str_cat(", a window of ", s.window.size(), " documents"));
  if (s.epoch != epoch_ || (order_.empty() && !endless && config_.shuffle)) start_epoch(s.epoch);
  // The offset is into the window's first document, or into the next document of the order.
  const int64_t cut_doc = s.window.empty() ? document_at(s.next_doc) : s.window.front();
  const int64_t length = source_->document_length(cut_doc);
  if (s.doc_offset >= length)
    HP_USER_ERROR(ErrorKind::kData, "saved data position is out of range for ", source_->describe(),
                  ": offset ", s.doc_offset, " into document ", cut_doc, ", which has ", length,
                  " tokens");
  next_doc_ = s.next_doc;
  doc_offset_ = s.doc_offset;
  batches_ = s.batches;
  window_.assign(s.window.begin(), s.window.end());
}

void DataLoader::seek(int64_t batch) {
  HP_CHECK(batch >= 0, "seek to batch ", batch);
  if (epoch_ != 0) start_epoch(0);
  next_doc_ = 0;
  doc_offset_ = 0;
  batches_ = 0;
  window_.clear();
  RowPlan plan;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < config_.rows_per_batch; ++j) pack_row(plan);
    ++batches_;
  }
}

std::string DataLoader::describe() const {
  std::string order;
  if (num_docs_ >= 0)
    order = config_.shuffle ? str_cat(", documents shuffled per epoch (seed ", config_.seed, ")")
                            : ", documents in file order";
  const std::string packing =
      config_.packing == Packing::kWhole
          ? str_cat("packing=whole (window ", config_.packing_window, " documents)")
          : std::string("packing=stream");
  return str_cat("data: ", source_->describe(), "; seq_len ", config_.seq_len, ", ",
                 config_.rows_per_batch, " rows per global batch (", rows_per_rank(), " on rank ",
                 config_.rank, " of ", config_.world, "), ", packing, order);
}

std::vector<std::vector<int32_t>> synthetic_documents(const DataConfig& config, int64_t n) {
  HP_CHECK(n >= 0, "document count ", n);
  const SyntheticSource source(synthetic_params(config));
  std::vector<std::vector<int32_t>> docs;
  docs.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) docs.push_back(source.document(i));
  return docs;
}

}  // namespace hp
