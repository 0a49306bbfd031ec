// DataLoader: packs EOT-terminated documents into rows of T+1 tokens in a deterministic global
// order and hands each rank its share of every global batch (docs/architecture.md, "Data").
//
// A row holds T+1 tokens: inputs row[0:T], targets row[1:T+1]. Two packings (DataConfig::packing):
//
// - stream (the default): the documents are one stream, in order, cut at row boundaries. Row r
//   holds stream tokens [r*T, r*T + T + 1): its last token is only a target, and the next row
//   starts with it, so every token of the data is an input exactly once and rows carry no padding
//   (the stream never ends: the next epoch follows the last document). A piece of a document cut
//   by a row boundary is its own sequence: positions restart at 0, no attention across the cut.
// - whole: a document that fits in a row (T+1 tokens: it may end on row position T, its EOT then
//   only a target) is never cut. Each row starts with the oldest document of a look-ahead window
//   of `packing_window` documents (taken from the stream in order), then the longest window
//   document that fits the room left is added, again and again, until none fits; the rest of
//   the row is padding (EOT tokens that are no target). A longer document is cut as in stream
//   mode, a row at a time. Deterministic: the window depends only on the data, seed, shuffle, T
//   and the window size. For data whose documents must stay whole (conversations with loss
//   masks, evaluation on whole documents).
//
// Global order: the loader produces one stream of rows that depends only on the data, seed,
// shuffle, packing and T, never on the layout. Global batch b holds rows [b·R, (b+1)·R), R =
// rows_per_batch; rank r of W keeps rows [b·R + r·R/W, b·R + (r+1)·R/W). Every rank packs every
// row (packing needs document lengths only) and reads token contents only for the rows it keeps.
//
// Document order: a file source is visited per epoch in an order shuffled by a Philox stream
// keyed by (seed, "data.shuffle", epoch) (file order when shuffle is off); at the end of the data
// the next epoch starts, and a line is logged. The synthetic source is an endless stream.
//
// Not thread-safe; one loader per rank, used from the training thread.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "framework/data/document_source.h"
#include "framework/data/packed_batch.h"

namespace hp {

// packing=stream|whole (see the top of this file).
enum class Packing { kStream, kWhole };
const char* packing_name(Packing p);
constexpr int64_t kMaxPackingWindow = 4096;  // the largest packing_window accepted

// synthetic_doc_len: "geometric" (lengths drawn with mean synthetic_mean_doc_len) or
// "uniform:MIN:MAX" (lengths, EOT included, uniform in [MIN, MAX)).
struct DocLength {
  int64_t min = 0;
  int64_t max = 0;  // 0: geometric
  bool uniform() const { return max > 0; }
  std::string str() const;  // the spec that parses back to this
};
// Parses a synthetic_doc_len spec; throws UserError(kConfig) naming the key and what is valid.
DocLength parse_doc_length(const std::string& spec);

// The data keys' values (their defaults are the keys' defaults) and what the launch fills in
// (vocab_size, rank, world, seed, rows_per_batch, a resolved eot_token).
struct DataConfig {
  // "synthetic"; or token files: a .bin path, a comma-separated list of paths and glob patterns
  // (each pattern's matches sorted), or an .h5/.hdf5 path. The kind comes from each file's
  // extension; several files are read as one data set, in list order.
  std::string source = "synthetic";
  int64_t vocab_size = 0;  // required; every token id must be below it
  // Ends every document, pads rows; required by the loader (the key's -1 means vocab_size - 1,
  // resolved by the launch).
  int32_t eot_token = -1;
  int64_t seq_len = 256;        // T >= 2; a row holds T+1 tokens
  int64_t batch_tokens = 8192;  // key batch_tokens: global tokens per step, a multiple of seq_len
  // R: rows of one global batch (all ranks), a multiple of world (the launch sets it to
  // batch_tokens / seq_len).
  int64_t rows_per_batch = 0;
  int rank = 0;
  int world = 1;
  uint64_t seed = 0;
  bool shuffle = true;  // file sources: shuffle the documents of every epoch
  Packing packing = Packing::kStream;
  int64_t packing_window = 128;  // whole: documents of the look-ahead window, 1..kMaxPackingWindow
  // Synthetic source (see synthetic.h): content tokens 0..synthetic_vocab-1 (0: every id below
  // eot_token), Zipf exponent of the next-token law, mean number of content tokens per document.
  int64_t synthetic_vocab = 0;
  double synthetic_zipf = 1.0;
  double synthetic_mean_doc_len = 64;
  DocLength synthetic_doc_len;  // geometric
};

// Where the loader stands between two batches: enough to resume the exact row stream.
struct LoaderState {
  int64_t epoch = 0;        // passes over a file source completed (0 for synthetic)
  int64_t next_doc = 0;     // index into this epoch's document order of the next document
  // stream: tokens of that document already packed (a cut document), else 0. whole: tokens of
  // the window's first document already packed.
  int64_t doc_offset = 0;
  int64_t batches = 0;      // global batches produced so far
  int64_t fingerprint = 0;  // data, seed and shuffle it belongs to; restore() checks it
  Packing packing = Packing::kStream;
  // False for a state of format 1, saved before the packing was recorded: a position in the
  // document order that either packing continues from.
  bool packing_recorded = true;
  // whole: the look-ahead window, oldest first, as document ids of the source (each drawn from
  // the document order before next_doc).
  std::vector<int64_t> window;

  // Serialization as a flat array (format version first), e.g. for the checkpoint's /state.
  std::vector<int64_t> to_vector() const;
  // Throws UserError(kData) if the array is not a LoaderState of this format.
  static LoaderState from_vector(const std::vector<int64_t>& v);
  bool operator==(const LoaderState& o) const;
};

// The checks DataLoader::open makes before it reads any token: the config's values, the
// synthetic source's parameters, and that every path or pattern of a file source names a file
// that can be opened (UserError naming the key or the file). The files' contents are checked as
// they are opened.
void validate_data_config(const DataConfig& config);

class DataLoader {
 public:
  // Validates the config (UserError naming the key) and opens and validates the source.
  static std::unique_ptr<DataLoader> open(const DataConfig& config);
  // A loader over a source built elsewhere (tests, tools); config.source is only reported.
  DataLoader(const DataConfig& config, std::unique_ptr<DocumentSource> source);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // This rank's rows of the next global batch: rows_per_rank() rows of T tokens.
  PackedBatch next();

  // Lower bound on the mean loss per valid target in nats, exact for the synthetic source (the
  // chain's conditional entropy); NaN for file sources.
  double entropy_floor() const;

  // The position before the next batch; restore() makes a loader (same data, seed and shuffle;
  // any world size) produce exactly the batches the saved one would have produced next.
  LoaderState state() const;
  void restore(const LoaderState& state);
  // Positions the loader before global batch `batch`, counted from the start of the data (packs
  // the skipped rows' lengths only; no token is read).
  void seek(int64_t batch);
  int64_t batches_produced() const { return batches_; }

  int64_t rows_per_rank() const { return config_.rows_per_batch / config_.world; }
  const DataConfig& config() const { return config_; }
  const DocumentSource& source() const { return *source_; }
  std::string describe() const;

 private:
  struct Piece {
    int64_t doc;
    int64_t offset;
    int32_t count;
  };
  struct RowPlan {
    std::vector<Piece> pieces;
    int32_t pad = 0;
  };

  void pack_row(RowPlan& plan);
  void pack_stream_row(RowPlan& plan);
  void pack_whole_row(RowPlan& plan);
  PackedRow materialize(const RowPlan& plan);
  int64_t document_at(int64_t k) const;
  // The document at the stream position, which then moves past it (into the next epoch at the
  // end of the data).
  int64_t take_document();
  void start_epoch(int64_t epoch);
  uint64_t state_fingerprint() const;

  DataConfig config_;
  std::unique_ptr<DocumentSource> source_;
  int64_t num_docs_ = -1;        // -1: endless
  std::vector<uint32_t> order_;  // this epoch's shuffled order; empty: identity
  int64_t epoch_ = 0;
  int64_t next_doc_ = 0;
  int64_t doc_offset_ = 0;
  int64_t batches_ = 0;
  std::deque<int64_t> window_;    // whole: the look-ahead window (document ids), oldest first
  int64_t epoch_logged_batch_ = -1;  // the batch of the last "epoch done" line
  bool small_data_warned_ = false;
};

// The first n documents of the synthetic source `config` describes (its synthetic_* keys, seed,
// vocab_size and eot_token), each ending with EOT: for round-trip tests and demo files.
std::vector<std::vector<int32_t>> synthetic_documents(const DataConfig& config, int64_t n);

}  // namespace hp
