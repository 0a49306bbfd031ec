// HDF5 token files: the reader (a DocumentSource) and the writer declared in token_files.h.
#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "framework/core/error.h"
#include "framework/core/hdf5_util.h"
#include "framework/core/log.h"
#include "framework/core/rng.h"
#include "framework/data/token_files.h"

namespace hp {
namespace {

constexpr const char* kTokens = "/tokens";
constexpr const char* kOffsets = "/doc_offsets";
constexpr const char* kLossMask = "/loss_mask";
constexpr const char* kLayout =
    "an HDF5 token file holds /tokens (uint32, 1-D) and /doc_offsets (int64, n_docs + 1 entries "
    "starting at 0, non-decreasing, last == len(/tokens))";

// A failed HDF5 call on a file we validated is a library or I/O failure, not the user's input.
[[noreturn]] void h5_fail(const char* call, const std::string& path, const char* dataset) {
  HP_FAIL(ErrorKind::kHdf5, call, " failed on ", dataset, " of ", path, ": ", h5_error_text());
}

class H5TokenFile final : public DocumentSource {
 public:
  H5TokenFile(const std::string& path, int64_t vocab_size, int32_t eot_token);
  ~H5TokenFile() override {
    if (fd_ >= 0) ::close(fd_);
    H5Lock lock;  // the library is called under its lock only (hdf5_util.h)
    tokens_.reset();
    file_.reset();
  }
  H5TokenFile(const H5TokenFile&) = delete;
  H5TokenFile& operator=(const H5TokenFile&) = delete;

  int64_t num_documents() const override { return static_cast<int64_t>(append_eot_.size()); }
  int64_t num_tokens() const override { return n_tokens_ + appended_; }
  int64_t document_length(int64_t i) const override {
    return offsets_[i + 1] - offsets_[i] + append_eot_[i];
  }
  void read(int64_t i, int64_t offset, int64_t count, int32_t* out) override;
  bool has_loss_mask() const override { return !mask_.empty(); }
  void read_loss_mask(int64_t i, int64_t offset, int64_t count, uint8_t* out) override;
  std::string describe() const override {
    return str_cat(
        path_, " (HDF5 tokens: ", num_documents(), " documents, ", n_tokens_, " tokens",
        mask_.empty() ? "" : str_cat(", loss mask counting ", mask_ones_, " of them"),
        fd_ >= 0 || n_tokens_ == 0
            ? ")"
            : "; read through HDF5, slower: /tokens is chunked, filtered or not 16/32-bit "
              "little-endian)");
  }
  uint64_t fingerprint() const override { return fingerprint_; }

 private:
  // Opens a 1-D integer dataset and returns it with its length.
  H5Handle open_dataset(const char* name, int64_t* length) const;
  void read_range(const char* name, const H5Handle& ds, int64_t start, int64_t count,
                  hid_t mem_type, void* out) const;
  // Reads /tokens directly from the file (pread) when HDF5 stores it as one contiguous,
  // unfiltered little-endian block of 16- or 32-bit integers (what write_h5_tokens produces);
  // false: read through HDF5.
  bool direct_tokens();
  // tokens[start, start + n) into out, directly or through HDF5.
  template <typename T>
  void fetch(int64_t start, int64_t n, T* out) const;

  std::string path_;
  int32_t eot_;
  H5Handle file_;
  H5Handle tokens_;
  int64_t n_tokens_ = 0;
  std::vector<int64_t> offsets_;
  std::vector<uint8_t> append_eot_;  // 1 where a document does not end with EOT
  int64_t appended_ = 0;
  uint64_t fingerprint_ = 0;
  std::vector<uint8_t> mask_;  // /loss_mask, one 0/1 per stored token; empty: none
  int64_t mask_ones_ = 0;
  int fd_ = -1;          // open for direct reads, else -1
  uint64_t raw_at_ = 0;  // file offset of the first token
  size_t width_ = 0;     // bytes per stored token
  bool signed_ = false;
  mutable std::vector<char> scratch_;
};

H5TokenFile::H5TokenFile(const std::string& path, int64_t vocab_size, int32_t eot_token)
    : path_(path), eot_(eot_token) {
  H5Lock lock;  // before H5Quiet, released after every handle of the constructor is closed
  H5Quiet quiet;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    HP_USER_ERROR(ErrorKind::kData, "cannot open data file ", path, ": ", std::strerror(errno));
  if (H5Fis_hdf5(path.c_str()) <= 0)
    HP_USER_ERROR(ErrorKind::kData, path, " is not an HDF5 file; ", kLayout);
  file_ = H5Handle(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file_.valid())
    HP_USER_ERROR(ErrorKind::kData, "cannot open ", path, " as HDF5: ", h5_error_text());

  int64_t n_offsets = 0;
  H5Handle offsets_ds = open_dataset(kOffsets, &n_offsets);
  tokens_ = open_dataset(kTokens, &n_tokens_);
  const std::string rule = str_cat("(offsets start at 0, are non-decreasing and end at len(",
                                   kTokens, ") = ", n_tokens_, ")");
  if (n_offsets < 1)
    HP_USER_ERROR(ErrorKind::kData, kOffsets, " in ", path,
                  " is empty: expected n_docs + 1 entries ", rule);
  offsets_.resize(static_cast<size_t>(n_offsets));
  read_range(kOffsets, offsets_ds, 0, n_offsets, H5T_NATIVE_INT64, offsets_.data());
  if (offsets_[0] != 0)
    HP_USER_ERROR(ErrorKind::kData, kOffsets, "[0] = ", offsets_[0], " in ", path, ", expected 0 ",
                  rule);
  for (int64_t i = 1; i < n_offsets; ++i) {
    if (offsets_[i] < offsets_[i - 1])
      HP_USER_ERROR(ErrorKind::kData, kOffsets, "[", i, "] = ", offsets_[i], " in ", path,
                    " is less than ", kOffsets, "[", i - 1, "] = ", offsets_[i - 1], " ", rule);
  }
  if (offsets_.back() != n_tokens_)
    HP_USER_ERROR(ErrorKind::kData, kOffsets, "[", n_offsets - 1, "] = ", offsets_.back(), " in ",
                  path, " is not len(", kTokens, ") = ", n_tokens_, " ", rule);

  const int64_t n_docs = n_offsets - 1;
  if (n_tokens_ == 0) {
    // Nothing to read: the file contributes no documents, even if it lists empty ones.
    if (n_docs > 0)
      log_warn(path, " lists ", n_docs, " documents but holds no tokens; skipping it");
    offsets_.assign(1, 0);
    fingerprint_ = hash64("h5-empty");
    return;
  }

  direct_tokens();

  // One pass in bounded memory validates every id, records which documents lack their final
  // EOT and sums a content checksum for the fingerprint.
  append_eot_.assign(static_cast<size_t>(n_docs), 0);
  constexpr int64_t kChunk = int64_t{1} << 20;
  std::vector<int64_t> buf(static_cast<size_t>(std::min(kChunk, n_tokens_)));
  uint64_t sum = 0;
  int64_t d = 0;  // next document whose last token is still to be checked
  for (int64_t start = 0; start < n_tokens_; start += kChunk) {
    const int64_t n = std::min(kChunk, n_tokens_ - start);
    fetch(start, n, buf.data());
    for (int64_t k = 0; k < n; ++k) {
      const int64_t t = buf[k];
      if (t < 0 || t >= vocab_size)
        HP_USER_ERROR(ErrorKind::kData, "token id ", t, " at token offset ", start + k, " of ",
                      path, " (", kTokens, ") is not in 0..vocab_size-1 (vocab_size ", vocab_size,
                      ")");
      sum = sum * 0x100000001B3ull + static_cast<uint64_t>(t);
    }
    const int64_t end = start + n;
    for (; d < n_docs && offsets_[d + 1] <= end; ++d) {
      const int64_t last = offsets_[d + 1] - 1;
      append_eot_[d] = offsets_[d + 1] == offsets_[d] || buf[last - start] != eot_ ? 1 : 0;
    }
  }
  HP_CHECK(d == n_docs, "document scan stopped at ", d, " of ", n_docs);
  for (uint8_t a : append_eot_) appended_ += a;
  fingerprint_ =
      hash64(std::to_string(sum),
             hash64(std::to_string(n_docs), hash64(std::to_string(n_tokens_), hash64("h5"))));

  // The optional loss mask: as many integer entries as /tokens, each 0 or 1, at least one 1.
  // Read in 64 bits, as stored: a conversion to uint8 would clip -1 to 0 and 300 to 255.
  if (H5Lexists(file_.get(), kLossMask, H5P_DEFAULT) > 0) {
    int64_t n_mask = 0;
    H5Handle mask_ds = open_dataset(kLossMask, &n_mask);
    if (n_mask != n_tokens_)
      HP_USER_ERROR(ErrorKind::kData, kLossMask, " in ", path, " has ", n_mask,
                    " entries; it needs one per token of ", kTokens, " (", n_tokens_, ")");
    H5Handle mask_type(H5Dget_type(mask_ds.get()), H5Tclose);
    if (!mask_type.valid()) h5_fail("H5Dget_type", path, kLossMask);
    const bool is_unsigned = H5Tget_sign(mask_type.get()) == H5T_SGN_NONE;
    mask_.resize(static_cast<size_t>(n_mask));
    std::vector<int64_t> chunk(static_cast<size_t>(std::min(kChunk, n_mask)));
    uint64_t mask_sum = 0;
    for (int64_t start = 0; start < n_mask; start += kChunk) {
      const int64_t n = std::min(kChunk, n_mask - start);
      read_range(kLossMask, mask_ds, start, n, is_unsigned ? H5T_NATIVE_UINT64 : H5T_NATIVE_INT64,
                 chunk.data());
      for (int64_t k = 0; k < n; ++k) {
        const int64_t raw = chunk[static_cast<size_t>(k)];
        if (raw != 0 && raw != 1)
          HP_USER_ERROR(
              ErrorKind::kData, kLossMask, "[", start + k, "] = ",
              is_unsigned ? std::to_string(static_cast<uint64_t>(raw)) : std::to_string(raw),
              " in ", path, "; entries must be 0 (context only) or 1 (a target the loss counts)");
        mask_[static_cast<size_t>(start + k)] = static_cast<uint8_t>(raw);
        mask_ones_ += raw;
        mask_sum = mask_sum * 0x100000001B3ull + static_cast<uint64_t>(raw);
      }
    }
    if (mask_ones_ == 0)
      HP_USER_ERROR(ErrorKind::kData, "dataset ", kLossMask, " of ", path, " selects nothing: all ",
                    n_mask,
                    " entries are 0, so no token of the file is a target the loss counts; mark "
                    "the targets with 1 (or remove ",
                    kLossMask, " to count every token)");
    fingerprint_ = hash64(std::to_string(mask_sum), fingerprint_);
  }
}

void H5TokenFile::read_loss_mask(int64_t i, int64_t offset, int64_t count, uint8_t* out) {
  HP_CHECK(i >= 0 && i < num_documents() && offset >= 0 && count >= 0 &&
               offset + count <= document_length(i),
           path_, ": read_loss_mask(", i, ", ", offset, ", ", count, ")");
  const int64_t stored = offsets_[i + 1] - offsets_[i];
  const int64_t n = std::max<int64_t>(0, std::min(count, stored - offset));
  const uint8_t* m = mask_.data() + offsets_[i];
  for (int64_t k = 0; k < n; ++k) out[k] = m[offset + k];
  // An appended EOT counts as the document's last stored token does.
  const uint8_t tail = stored > 0 ? m[stored - 1] : 0;
  for (int64_t k = n; k < count; ++k) out[k] = tail;
}

H5Handle H5TokenFile::open_dataset(const char* name, int64_t* length) const {
  const htri_t exists = H5Lexists(file_.get(), name, H5P_DEFAULT);
  if (exists <= 0) HP_USER_ERROR(ErrorKind::kData, path_, " has no dataset ", name, "; ", kLayout);
  H5Handle ds(H5Dopen2(file_.get(), name, H5P_DEFAULT), H5Dclose);
  if (!ds.valid())
    HP_USER_ERROR(ErrorKind::kData, "cannot open dataset ", name, " of ", path_, " (", kLayout,
                  "): ", h5_error_text());
  H5Handle type(H5Dget_type(ds.get()), H5Tclose);
  if (!type.valid()) h5_fail("H5Dget_type", path_, name);
  if (H5Tget_class(type.get()) != H5T_INTEGER)
    HP_USER_ERROR(ErrorKind::kData, "dataset ", name, " of ", path_, " does not hold integers; ",
                  kLayout);
  H5Handle space(H5Dget_space(ds.get()), H5Sclose);
  if (!space.valid()) h5_fail("H5Dget_space", path_, name);
  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank != 1)
    HP_USER_ERROR(ErrorKind::kData, "dataset ", name, " of ", path_, " has ", rank,
                  " dimensions, expected 1; ", kLayout);
  hsize_t dims[1] = {0};
  if (H5Sget_simple_extent_dims(space.get(), dims, nullptr) < 0)
    h5_fail("H5Sget_simple_extent_dims", path_, name);
  // A damaged header may declare any length; the bytes the file stores for the dataset bound
  // what can be read (and allocated) for it. Unfiltered data is stored in full; filtered
  // (compressed) data is taken to shrink at most kMaxCompression-fold (deflate's limit is about
  // 1032:1).
  constexpr long double kMaxCompression = 1100;
  H5Handle dcpl(H5Dget_create_plist(ds.get()), H5Pclose);
  if (!dcpl.valid()) h5_fail("H5Dget_create_plist", path_, name);
  const int filters = H5Pget_nfilters(dcpl.get());
  const long double declared =
      static_cast<long double>(dims[0]) * static_cast<long double>(H5Tget_size(type.get()));
  const auto stored = static_cast<long double>(H5Dget_storage_size(ds.get()));
  if (dims[0] > static_cast<hsize_t>(INT64_MAX) ||
      stored < (filters > 0 ? declared / kMaxCompression : declared))
    HP_USER_ERROR(ErrorKind::kData, "dataset ", name, " of ", path_, " declares ", dims[0],
                  " values but the file stores only ", static_cast<uint64_t>(stored),
                  " bytes of them", filters > 0 ? " (compressed)" : "",
                  ": the file is damaged or was not completely written");
  *length = static_cast<int64_t>(dims[0]);
  return ds;
}

void H5TokenFile::read_range(const char* name, const H5Handle& ds, int64_t start, int64_t count,
                             hid_t mem_type, void* out) const {
  H5Lock lock;
  H5Handle file_space(H5Dget_space(ds.get()), H5Sclose);
  if (!file_space.valid()) h5_fail("H5Dget_space", path_, name);
  const hsize_t off[1] = {static_cast<hsize_t>(start)};
  const hsize_t cnt[1] = {static_cast<hsize_t>(count)};
  if (H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, off, nullptr, cnt, nullptr) < 0)
    h5_fail("H5Sselect_hyperslab", path_, name);
  H5Handle mem_space(H5Screate_simple(1, cnt, nullptr), H5Sclose);
  if (!mem_space.valid()) h5_fail("H5Screate_simple", path_, name);
  if (H5Dread(ds.get(), mem_type, mem_space.get(), file_space.get(), H5P_DEFAULT, out) < 0)
    h5_fail("H5Dread", path_, name);
}

bool H5TokenFile::direct_tokens() {
  H5Handle dcpl(H5Dget_create_plist(tokens_.get()), H5Pclose);
  if (!dcpl.valid()) h5_fail("H5Dget_create_plist", path_, kTokens);
  if (H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS) return false;
  if (H5Pget_nfilters(dcpl.get()) != 0) return false;
  const haddr_t addr = H5Dget_offset(tokens_.get());
  if (addr == HADDR_UNDEF) return false;
  H5Handle type(H5Dget_type(tokens_.get()), H5Tclose);
  if (!type.valid()) h5_fail("H5Dget_type", path_, kTokens);
  const size_t width = H5Tget_size(type.get());
  if ((width != 2 && width != 4) || H5Tget_order(type.get()) != H5T_ORDER_LE) return false;

  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st {};
  // Overflow-safe form of addr + n_tokens * width <= size (both come from the file).
  const uint64_t size = ::fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
  if (addr > size || static_cast<uint64_t>(n_tokens_) > (size - addr) / width) {
    ::close(fd);
    return false;  // let HDF5 report whatever is wrong with the file
  }
  fd_ = fd;
  raw_at_ = addr;
  width_ = width;
  signed_ = H5Tget_sign(type.get()) == H5T_SGN_2;

  // Direct reads are trusted only if they agree with what HDF5 itself reads at both ends.
  const int64_t n = std::min<int64_t>(n_tokens_, 256);
  std::vector<int64_t> via_hdf5(static_cast<size_t>(n)), direct(static_cast<size_t>(n));
  bool agree = true;
  for (int64_t start : {int64_t{0}, n_tokens_ - n}) {
    read_range(kTokens, tokens_, start, n, H5T_NATIVE_INT64, via_hdf5.data());
    fetch(start, n, direct.data());
    agree = agree && via_hdf5 == direct;
  }
  if (!agree) {
    ::close(fd_);
    fd_ = -1;
  }
  return agree;
}

template <typename T>
void H5TokenFile::fetch(int64_t start, int64_t n, T* out) const {
  if (fd_ < 0) {
    H5Lock lock;
    H5Quiet quiet;
    const hid_t mem_type = sizeof(T) == 8 ? H5T_NATIVE_INT64 : H5T_NATIVE_INT32;
    read_range(kTokens, tokens_, start, n, mem_type, out);
    return;
  }
  const size_t want = static_cast<size_t>(n) * width_;
  const uint64_t at = raw_at_ + static_cast<uint64_t>(start) * width_;
  scratch_.resize(want);
  size_t got = 0;
  while (got < want) {
    const ssize_t r = ::pread(fd_, scratch_.data() + got, want - got, static_cast<off_t>(at + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      HP_USER_ERROR(ErrorKind::kData, "cannot read tokens ", start, "..", start + n - 1, " of ",
                    kTokens, " in ", path_, ": ", std::strerror(errno));
    if (r == 0)
      HP_USER_ERROR(ErrorKind::kData, path_, " was truncated while in use: tokens ", start, "..",
                    start + n - 1, " of ", kTokens, " (bytes ", at, "..", at + want - 1,
                    ") are no longer in the file; do not change token files while a job reads "
                    "them");
    got += static_cast<size_t>(r);
  }
  // memcpy per element: the dataset's address need not be aligned for its type.
  const char* p = scratch_.data();
  auto decode = [&](auto stored) {
    using S = decltype(stored);
    for (int64_t k = 0; k < n; ++k) {
      S v;
      std::memcpy(&v, p + k * sizeof(S), sizeof(S));
      out[k] = static_cast<T>(v);
    }
  };
  if (width_ == 2) {
    signed_ ? decode(int16_t{}) : decode(uint16_t{});
  } else {
    signed_ ? decode(int32_t{}) : decode(uint32_t{});
  }
}

void H5TokenFile::read(int64_t i, int64_t offset, int64_t count, int32_t* out) {
  HP_CHECK(i >= 0 && i < num_documents() && offset >= 0 && count >= 0 &&
               offset + count <= document_length(i),
           path_, ": read(", i, ", ", offset, ", ", count, ")");
  const int64_t stored = offsets_[i + 1] - offsets_[i];
  const int64_t n = std::max<int64_t>(0, std::min(count, stored - offset));
  if (n > 0) {
    // Ids were validated below vocab_size (< 2^31) at open, so the int32 conversion is exact.
    fetch(offsets_[i] + offset, n, out);
  }
  for (int64_t k = n; k < count; ++k) out[k] = eot_;
}

void write_h5_file(const std::string& path, const std::vector<int32_t>& tokens,
                   const std::vector<int64_t>& doc_offsets, const std::vector<uint8_t>* mask) {
  // The 1.10 format, as checkpoints: superblock, object headers and B-trees carry checksums, so
  // damaged metadata fails a check instead of being parsed.
  H5Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  if (!fapl.valid() || H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V110, H5F_LIBVER_V110) < 0)
    h5_fail("H5Pset_libver_bounds", path, "/");
  H5Handle file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose);
  if (!file.valid()) h5_fail("H5Fcreate", path, "/");
  std::vector<uint32_t> u32(tokens.begin(), tokens.end());
  auto write = [&](const char* name, hid_t file_type, hid_t mem_type, const void* data, size_t n) {
    const hsize_t dims[1] = {static_cast<hsize_t>(n)};
    H5Handle space(H5Screate_simple(1, dims, nullptr), H5Sclose);
    if (!space.valid()) h5_fail("H5Screate_simple", path, name);
    H5Handle ds(
        H5Dcreate2(file.get(), name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
        H5Dclose);
    if (!ds.valid()) h5_fail("H5Dcreate2", path, name);
    if (n > 0 && H5Dwrite(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
      h5_fail("H5Dwrite", path, name);
  };
  write(kTokens, H5T_STD_U32LE, H5T_NATIVE_UINT32, u32.data(), u32.size());
  write(kOffsets, H5T_STD_I64LE, H5T_NATIVE_INT64, doc_offsets.data(), doc_offsets.size());
  if (mask) write(kLossMask, H5T_STD_U8LE, H5T_NATIVE_UINT8, mask->data(), mask->size());
  file.reset();  // H5Fclose flushes HDF5's buffers to the file
}

}  // namespace

std::unique_ptr<DocumentSource> open_h5_tokens(const std::string& path, int64_t vocab_size,
                                               int32_t eot_token) {
  return std::make_unique<H5TokenFile>(path, vocab_size, eot_token);
}

void write_h5_tokens(const std::string& path, const std::vector<int32_t>& tokens,
                     const std::vector<int64_t>& doc_offsets) {
  write_h5_tokens(path, tokens, doc_offsets, nullptr);
}

void write_h5_tokens(const std::string& path, const std::vector<int32_t>& tokens,
                     const std::vector<int64_t>& doc_offsets,
                     const std::vector<uint8_t>* loss_mask) {
  for (size_t k = 0; k < tokens.size(); ++k) {
    if (tokens[k] < 0)
      HP_USER_ERROR(ErrorKind::kData, "cannot write ", path, ": token ", tokens[k], " at offset ",
                    k, " is negative");
  }
  const std::string tmp = path + ".tmp";
  try {
    H5Lock lock;
    H5Quiet quiet;
    write_h5_file(tmp, tokens, doc_offsets, loss_mask);
    const int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
    const bool synced = fd >= 0 && ::fsync(fd) == 0;
    if (fd >= 0) ::close(fd);
    if (!synced) HP_FAIL(ErrorKind::kIo, "flushing ", tmp, " failed: ", std::strerror(errno));
    if (std::rename(tmp.c_str(), path.c_str()) != 0)
      HP_FAIL(ErrorKind::kIo, "renaming ", tmp, " to ", path, " failed: ", std::strerror(errno));
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
}

void write_h5_tokens(const std::string& path, const std::vector<std::vector<int32_t>>& docs) {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets{0};
  for (const auto& d : docs) {
    tokens.insert(tokens.end(), d.begin(), d.end());
    offsets.push_back(static_cast<int64_t>(tokens.size()));
  }
  write_h5_tokens(path, tokens, offsets);
}

}  // namespace hp
