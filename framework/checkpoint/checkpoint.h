// Checkpoint files and directories (docs/architecture.md, "Checkpoints"; the layout a user reads
// with h5py is in docs/checkpoints.md).
//
// One HDF5 file per checkpoint. Every tensor is stored in its global, unsharded shape (experts
// stacked on the leading axis), chunked along the leading axis, with a CRC-32C of every chunk
// in the dataset's attribute "crc32c", so a flipped byte fails the read of that chunk. (HDF5's
// Fletcher-32 filter did this in format version 1; it runs single-threaded inside HDF5 and
// capped writes near 450 MiB/s, where checksums computed by hotpath's threads cost little.) The
// file uses the HDF5 1.10 format, whose superblock, object headers and B-trees carry their own
// checksums: damaged metadata (attributes included) fails too. This header knows nothing about
// models, optimizers or ranks: the caller says which rows of which dataset this process writes or
// reads.
//
// Writing: CheckpointWriter is collective over a CheckpointGroup (checkpoint_group.h: parallel
// HDF5 over MPI-IO, every dataset created by all ranks and written with one collective transfer
// in which each rank selects its own rows, possibly none), or serial when given no group (this
// process alone writes everything: single-process runs and launches without MPI, whose caller
// gathers the shards first). Every rank must make the same calls in the same order with the same
// names, shapes, chunking and attribute values.
//
// Reading: CheckpointReader is serial; every process opens the file on its own and reads the
// rows it needs (only the chunks those rows touch are read and checked). No collective is
// involved, so a rank that finds damage cannot leave the others waiting inside HDF5; the caller
// agrees on the outcome afterwards.
//
// Committing: a checkpoint is written as step_<N>.h5.tmp and becomes step_<N>.h5 by rename (the
// commit point); `latest` is a text file naming the newest committed checkpoint, replaced by
// temp + rename. The helpers below do the file-system part; the caller orders them around its
// barriers (write, close + fsync on every rank, barrier, commit on one rank).
//
// Errors: every failed HDF5 call throws hp::Error(kHdf5) naming the file, the dataset or
// attribute, the call and HDF5's own message. File-system failures throw kIo.
// Thread safety: none; one thread uses an object at a time. HDF5's automatic error printing is
// switched off while these classes call it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "framework/checkpoint/checkpoint_group.h"
#include "framework/core/dtype.h"
#include "framework/core/tensor.h"

namespace hp {

constexpr const char* kCheckpointFormat = "hotpath-checkpoint";
// Version 2 checksums each chunk with CRC-32C in an attribute; version 1 (still read) used
// HDF5's Fletcher-32 filter.
constexpr int64_t kCheckpointVersion = 2;

// "major.minor.release" of the HDF5 library the build links, without calling into it (safe on any
// thread, also while another thread of the process writes a file).
std::string hdf5_version_string();

// Leading-axis rows per chunk for a dataset of this global shape: about 16 MiB per chunk, at
// least one row. Deterministic, so every rank chunks a dataset the same way.
int64_t checkpoint_chunk_rows(const Shape& global_shape, DType dtype);

// Rows [begin, begin + count) of the leading axis.
struct RowRange {
  int64_t begin = 0;
  int64_t count = 0;
};

// Splits `rows` rows held identically by `parts` ranks into per-part ranges whose boundaries
// fall on chunk boundaries (so each chunk has exactly one writer); part i's range, possibly empty.
RowRange split_rows_by_chunk(int64_t rows, int64_t chunk_rows, int parts, int part);

struct DatasetInfo {
  std::string name;  // absolute path, e.g. "/params/layers.0.attn.wqkv"
  Shape shape;
  DType dtype = DType::kF32;
  int64_t chunk_rows = 0;   // 0: not chunked
  bool fletcher32 = false;  // HDF5's Fletcher-32 filter on every chunk (format version 1)
  bool crc32c = false;      // attribute "crc32c": one CRC-32C per chunk (format version 2)
  int64_t bytes() const { return shape_numel(shape) * static_cast<int64_t>(dtype_size(dtype)); }
};

class CheckpointWriter {
 public:
  // Creates (truncates) `path`. Collective over `group` unless it is null; the group must
  // outlive the writer.
  CheckpointWriter(const std::string& path, const CheckpointGroup* group);
  // Closes the file if close() was not called (errors are swallowed: a writer destroyed during
  // unwinding leaves an uncommitted .tmp file behind, which is never loaded).
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  bool parallel() const { return group_ != nullptr; }
  const std::string& path() const { return path_; }

  // Attributes of the root group (collective metadata: same values on every rank).
  void set_attr(const std::string& name, const std::string& value);
  void set_attr(const std::string& name, int64_t value);
  void set_attr(const std::string& name, const std::vector<int64_t>& value);

  // Creates dataset `name` (intermediate groups are created) of `global_shape` and `dtype`
  // (f32, f64 or i64), chunked by `chunk_rows` leading-axis rows, writes rows `rows` from
  // `data` (host memory, rows.count rows, contiguous) and stores each chunk's CRC-32C.
  // Collective: every rank calls it for every dataset; rows.count may be 0. The rows of
  // different ranks must not overlap and must start and end on chunk boundaries (or the end).
  void write_rows(const std::string& name, const Shape& global_shape, DType dtype,
                  int64_t chunk_rows, RowRange rows, const void* data);
  // A small 1-D i64 dataset whose contents come from the rank that passes write = true (one rank).
  void write_i64(const std::string& name, const std::vector<int64_t>& values, bool write);

  // Flushes and closes the file, then fsyncs it from this process. Collective.
  void close();
  // After a failed write (disk full, I/O error): releases every HDF5 object of the file without
  // throwing, so that nothing of it is left open in the library (whose exit would then fail).
  // The caller removes the partial file. The writer is unusable afterwards.
  void abandon() noexcept;

  // Datasets whose transfer did not run as collective I/O on this rank (parallel mode), with
  // HDF5's reason, for a log note.
  const std::vector<std::string>& independent_fallbacks() const { return fallbacks_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_;
  const CheckpointGroup* group_ = nullptr;
  std::vector<std::string> fallbacks_;
};

class CheckpointReader {
 public:
  // Opens `path` read-only and checks the root attribute "format" and "format_version". Throws
  // Error(kHdf5) for a file HDF5 cannot open (missing, truncated, damaged superblock) and
  // UserError(kData) for an HDF5 file that is not a hotpath checkpoint of a known version.
  explicit CheckpointReader(const std::string& path);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const std::string& path() const { return path_; }

  bool has_attr(const std::string& name) const;
  std::string string_attr(const std::string& name) const;
  int64_t int_attr(const std::string& name) const;
  std::vector<int64_t> ints_attr(const std::string& name) const;

  // False when no such dataset exists; throws UserError(kData) when the metadata on the way to
  // it cannot be read (checksum failure of a group or object header: the file is corrupt).
  bool has_dataset(const std::string& name) const;
  // Throws Error(kHdf5) naming the file and dataset when it is missing.
  DatasetInfo info(const std::string& name) const;
  // Every dataset in the file, depth first in name order.
  std::vector<DatasetInfo> datasets() const;

  // Reads rows `rows` of dataset `name` into `out` as `dtype` (HDF5 converts between float
  // types). Verifies the checksums of the chunks it touches (CRC-32C, or Fletcher-32 in
  // version 1 files) and throws UserError(kData) naming the chunk when one fails, and naming the
  // dataset when it has no checksum at all (the file is damaged or not a hotpath checkpoint).
  void read_rows(const std::string& name, RowRange rows, DType dtype, void* out) const;
  std::vector<int64_t> read_i64(const std::string& name) const;
  // Reads every chunk of the dataset (checksums verified) and returns a 64-bit FNV-1a digest of
  // its stored bytes, for comparisons between checkpoints. With `nonfinite`, also counts the
  // elements of a float dataset that are inf or NaN there.
  uint64_t verify(const std::string& name, int64_t* nonfinite = nullptr) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_;
};

// ---- directories and the commit protocol ----------------------------------------------------

// "step_<N>.h5" (N zero-padded to 8 digits so names sort by step).
std::string checkpoint_file_name(int64_t step);
// dir/step_<N>.h5 and dir/step_<N>.h5.tmp.
std::string checkpoint_path(const std::string& dir, int64_t step);
std::string checkpoint_tmp_path(const std::string& dir, int64_t step);
// Step of a committed checkpoint's file name ("step_00000012.h5" -> 12); -1 for anything else
// (including *.tmp).
int64_t checkpoint_step_of(const std::string& file_name);

// Creates `dir` and its parents if missing.
void make_checkpoint_dir(const std::string& dir);
// fsync of a file or a directory (opened read-only).
void fsync_path(const std::string& path);
// The commit: renames step_<N>.h5.tmp to step_<N>.h5 and fsyncs `dir`. One process calls it,
// after every writer has closed and fsynced the temporary file.
void commit_checkpoint(const std::string& dir, int64_t step);
// Points `latest` at step_<N>.h5: writes latest.tmp, fsyncs it, renames it to `latest`, fsyncs
// `dir`. Called after commit_checkpoint.
void update_latest(const std::string& dir, int64_t step);
// Steps of the committed checkpoints in `dir` (step_*.h5; *.tmp skipped), newest first.
std::vector<int64_t> committed_steps(const std::string& dir);
// The file `latest` names, as a path inside `dir`. Empty when there is no `latest`; throws
// UserError(kData) naming dir/latest when its contents are not a committed checkpoint's name.
std::string read_latest(const std::string& dir);
// Deletes committed checkpoints beyond the `keep_last` newest, never `newest_step` or anything
// newer, and leftover step_*.h5.tmp files of steps <= newest_step. keep_last <= 0 keeps all.
// Returns the deleted file names.
std::vector<std::string> apply_retention(const std::string& dir, int64_t keep_last,
                                         int64_t newest_step);

}  // namespace hp
