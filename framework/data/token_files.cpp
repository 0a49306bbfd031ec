#include "framework/data/token_files.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "framework/core/error.h"
#include "framework/core/log.h"
#include "framework/core/rng.h"

namespace hp {
namespace {

// The .bin format is little-endian on disk and is read into host integers as stored.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token files assume a little-endian host");

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// One llm.c shard, read with pread(2) from a descriptor held open: the page cache holds the
// tokens, not the process. (Not a memory mapping: a shard truncated while the job runs would
// kill it with SIGBUS at the first read past the new end; a short read is reported instead.)
class BinShard final : public DocumentSource {
 public:
  BinShard(const std::string& path, int64_t vocab_size, int32_t eot_token);

  int64_t num_documents() const override { return static_cast<int64_t>(starts_.size()); }
  int64_t num_tokens() const override { return n_tokens_ + (append_eot_ ? 1 : 0); }
  int64_t document_length(int64_t i) const override {
    return doc_end(i) - starts_[i] + (append_eot_ && i + 1 == num_documents() ? 1 : 0);
  }
  void read(int64_t i, int64_t offset, int64_t count, int32_t* out) override;
  std::string describe() const override {
    return str_cat(path_, " (llm.c token shard: ", num_documents(), " documents, ", n_tokens_,
                   " tokens)");
  }
  uint64_t fingerprint() const override { return fingerprint_; }

 private:
  int64_t doc_end(int64_t i) const {
    return i + 1 < num_documents() ? static_cast<int64_t>(starts_[i + 1]) : n_tokens_;
  }
  // Tokens [first, first + n) into out; throws naming the file when it no longer holds them.
  void read_tokens(int64_t first, int64_t n, uint16_t* out) const;

  std::string path_;
  int32_t eot_;
  Fd fd_;
  int64_t n_tokens_ = 0;
  // Start of each document; a shard holds < 2^31 tokens (int32 header), so 32 bits suffice.
  std::vector<uint32_t> starts_;
  bool append_eot_ = false;  // the last document ends without EOT
  uint64_t fingerprint_ = 0;
  mutable std::vector<uint16_t> scratch_;
};

BinShard::BinShard(const std::string& path, int64_t vocab_size, int32_t eot_token)
    : path_(path), eot_(eot_token) {
  fd_ = Fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd_.get() < 0)
    HP_USER_ERROR(ErrorKind::kData, "cannot open data file ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0 || !S_ISREG(st.st_mode))
    HP_USER_ERROR(ErrorKind::kData, "data file ", path, " is not a regular file");
  const int64_t size = st.st_size;
  if (size < kBinHeaderBytes)
    HP_USER_ERROR(ErrorKind::kData, path, " is truncated: it has ", size, " bytes, fewer than the ",
                  kBinHeaderBytes, "-byte header of an llm.c token shard");
  int32_t header[kBinHeaderInts];
  if (::pread(fd_.get(), header, sizeof header, 0) != static_cast<ssize_t>(sizeof header))
    HP_USER_ERROR(ErrorKind::kData, "cannot read the header of ", path, ": ", std::strerror(errno));
  if (header[0] != kBinMagic)
    HP_USER_ERROR(ErrorKind::kData, "bad magic ", header[0], " in ", path, ", expected ", kBinMagic,
                  " (llm.c token shard)");
  if (header[1] != kBinVersion)
    HP_USER_ERROR(ErrorKind::kData, "unsupported version ", header[1], " in ", path, ", expected ",
                  kBinVersion, " (llm.c token shard, uint16 tokens)");
  n_tokens_ = header[2];
  if (n_tokens_ < 0)
    HP_USER_ERROR(ErrorKind::kData, path, ": header token count ", n_tokens_,
                  " is negative (header[2] must hold the number of tokens)");
  const int64_t holds = (size - kBinHeaderBytes) / 2;
  if (holds < n_tokens_)
    HP_USER_ERROR(ErrorKind::kData, path, " is truncated: header says ", n_tokens_,
                  " tokens, file holds ", holds);
  if (size != kBinHeaderBytes + 2 * n_tokens_)
    log_warn(path, " has ", size - kBinHeaderBytes - 2 * n_tokens_, " bytes after the ", n_tokens_,
             " tokens its header announces; ignoring them");
  uint64_t h = hash64("bin");
  h = hash64(std::to_string(n_tokens_), h);
  if (n_tokens_ == 0) {
    fingerprint_ = h;
    return;
  }

  // One pass in bounded memory validates every id, finds the document starts and sums a content
  // checksum for the fingerprint.
  ::posix_fadvise(fd_.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  constexpr int64_t kChunk = int64_t{1} << 20;
  std::vector<uint16_t> buf(static_cast<size_t>(std::min(kChunk, n_tokens_)));
  starts_.push_back(0);
  uint64_t sum = 0;
  uint16_t last = 0;
  for (int64_t first = 0; first < n_tokens_; first += kChunk) {
    const int64_t n = std::min(kChunk, n_tokens_ - first);
    read_tokens(first, n, buf.data());
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = first + j;
      const uint16_t t = buf[j];
      if (t >= vocab_size)
        HP_USER_ERROR(ErrorKind::kData, "token id ", t, " at token offset ", k, " (byte offset ",
                      kBinHeaderBytes + 2 * k, ") of ", path, " is not below vocab_size ",
                      vocab_size);
      sum = sum * 0x100000001B3ull + t;
      if (t == eot_ && k + 1 < n_tokens_) starts_.push_back(static_cast<uint32_t>(k + 1));
    }
    last = buf[n - 1];
  }
  ::posix_fadvise(fd_.get(), 0, 0, POSIX_FADV_NORMAL);
  append_eot_ = last != eot_;
  fingerprint_ = hash64(std::to_string(sum), hash64(std::to_string(starts_.size()), h));
}

void BinShard::read_tokens(int64_t first, int64_t n, uint16_t* out) const {
  char* dst = reinterpret_cast<char*>(out);
  const size_t want = static_cast<size_t>(n) * 2;
  const off_t at = static_cast<off_t>(kBinHeaderBytes + 2 * first);
  size_t got = 0;
  while (got < want) {
    const ssize_t r = ::pread(fd_.get(), dst + got, want - got, at + static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      HP_USER_ERROR(ErrorKind::kData, "cannot read tokens ", first, "..", first + n - 1, " of ",
                    path_, ": ", std::strerror(errno));
    if (r == 0)
      HP_USER_ERROR(ErrorKind::kData, path_, " was truncated while in use: tokens ", first, "..",
                    first + n - 1, " (bytes ", at, "..", at + static_cast<off_t>(want) - 1,
                    ") are no longer in the file, which its header says holds ", n_tokens_,
                    " tokens; do not change token files while a job reads them");
    got += static_cast<size_t>(r);
  }
}

void BinShard::read(int64_t i, int64_t offset, int64_t count, int32_t* out) {
  HP_CHECK(i >= 0 && i < num_documents() && offset >= 0 && count >= 0 &&
               offset + count <= document_length(i),
           path_, ": read(", i, ", ", offset, ", ", count, ")");
  const int64_t start = starts_[i];
  const int64_t stored = doc_end(i) - start;
  const int64_t n = std::max<int64_t>(0, std::min(count, stored - offset));
  if (n > 0) {
    scratch_.resize(static_cast<size_t>(n));
    read_tokens(start + offset, n, scratch_.data());
    for (int64_t k = 0; k < n; ++k) out[k] = static_cast<int32_t>(scratch_[k]);
  }
  for (int64_t k = n; k < count; ++k) out[k] = eot_;
}

// Several files read as one: global document index = the files' documents in list order.
class FileListSource final : public DocumentSource {
 public:
  explicit FileListSource(std::vector<std::unique_ptr<DocumentSource>> files)
      : files_(std::move(files)) {
    first_doc_.push_back(0);
    fingerprint_ = hash64("files");
    for (const auto& f : files_) {
      first_doc_.push_back(first_doc_.back() + f->num_documents());
      tokens_ += f->num_tokens();
      fingerprint_ = hash64(std::to_string(f->fingerprint()), fingerprint_);
      any_mask_ = any_mask_ || f->has_loss_mask();
    }
  }

  int64_t num_documents() const override { return first_doc_.back(); }
  int64_t num_tokens() const override { return tokens_; }
  int64_t document_length(int64_t i) const override {
    const auto [f, j] = locate(i);
    return files_[f]->document_length(j);
  }
  bool has_loss_mask() const override { return any_mask_; }
  void read_loss_mask(int64_t i, int64_t offset, int64_t count, uint8_t* out) override {
    const auto [f, j] = locate(i);
    files_[f]->read_loss_mask(j, offset, count, out);
  }
  void read(int64_t i, int64_t offset, int64_t count, int32_t* out) override {
    const auto [f, j] = locate(i);
    files_[f]->read(j, offset, count, out);
  }
  std::string describe() const override {
    if (files_.size() == 1) return files_[0]->describe();
    return str_cat(files_.size(), " token files (", files_.front()->describe(), " ... ",
                   files_.back()->describe(), "): ", num_documents(), " documents, ", tokens_,
                   " tokens");
  }
  uint64_t fingerprint() const override { return fingerprint_; }

 private:
  std::pair<size_t, int64_t> locate(int64_t i) const {
    HP_CHECK(i >= 0 && i < num_documents(), "document ", i, " of ", num_documents());
    // Reads are mostly sequential or within one file: try the last file first.
    if (!(first_doc_[last_] <= i && i < first_doc_[last_ + 1])) {
      last_ = static_cast<size_t>(std::upper_bound(first_doc_.begin(), first_doc_.end(), i) -
                                  first_doc_.begin() - 1);
    }
    return {last_, i - first_doc_[last_]};
  }

  std::vector<std::unique_ptr<DocumentSource>> files_;
  std::vector<int64_t> first_doc_;
  int64_t tokens_ = 0;
  uint64_t fingerprint_ = 0;
  bool any_mask_ = false;  // files without a mask count every target
  mutable size_t last_ = 0;
};

}  // namespace

std::vector<std::string> expand_source_paths(const std::string& spec) {
  std::vector<std::string> paths;
  size_t begin = 0;
  while (begin <= spec.size()) {
    size_t end = spec.find(',', begin);
    if (end == std::string::npos) end = spec.size();
    const std::string item = trim(spec.substr(begin, end - begin));
    begin = end + 1;
    if (item.empty())
      HP_USER_ERROR(ErrorKind::kData, "empty path in data source list '", spec,
                    "' (expected comma-separated paths or glob patterns)");
    if (item.find_first_of("*?[") == std::string::npos) {
      paths.push_back(item);
      continue;
    }
    glob_t g{};
    const int rc = ::glob(item.c_str(), 0, nullptr, &g);
    std::vector<std::string> matches;
    if (rc == 0) {
      for (size_t k = 0; k < g.gl_pathc; ++k) matches.emplace_back(g.gl_pathv[k]);
    }
    ::globfree(&g);
    if (rc == GLOB_NOMATCH || (rc == 0 && matches.empty()))
      HP_USER_ERROR(ErrorKind::kData, "no data file matches the pattern '", item, "'");
    if (rc != 0)
      HP_USER_ERROR(ErrorKind::kData, "cannot expand the pattern '", item, "' (glob error ", rc,
                    ")");
    std::sort(matches.begin(), matches.end());
    paths.insert(paths.end(), matches.begin(), matches.end());
  }
  return paths;
}

std::unique_ptr<DocumentSource> open_bin_shard(const std::string& path, int64_t vocab_size,
                                               int32_t eot_token) {
  return std::make_unique<BinShard>(path, vocab_size, eot_token);
}

namespace {
[[noreturn]] void unknown_kind(const std::string& path) {
  HP_USER_ERROR(ErrorKind::kData, "unknown data source '", path,
                "': expected 'synthetic', a .bin llm.c token shard (or a comma-separated list or "
                "glob of them) or an .h5/.hdf5 token file");
}
}  // namespace

std::unique_ptr<DocumentSource> open_token_file(const std::string& path, int64_t vocab_size,
                                                int32_t eot_token) {
  if (ends_with(path, ".bin")) return open_bin_shard(path, vocab_size, eot_token);
  if (ends_with(path, ".h5") || ends_with(path, ".hdf5"))
    return open_h5_tokens(path, vocab_size, eot_token);
  unknown_kind(path);
}

void check_token_file(const std::string& path) {
  if (!ends_with(path, ".bin") && !ends_with(path, ".h5") && !ends_with(path, ".hdf5"))
    unknown_kind(path);
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr)
    HP_USER_ERROR(ErrorKind::kData, "cannot open data file ", path, ": ", std::strerror(errno));
  std::fclose(f);
}

std::unique_ptr<DocumentSource> open_token_files(const std::vector<std::string>& paths,
                                                 int64_t vocab_size, int32_t eot_token) {
  HP_CHECK(!paths.empty(), "no data files");
  std::vector<std::unique_ptr<DocumentSource>> files;
  files.reserve(paths.size());
  for (const auto& p : paths) files.push_back(open_token_file(p, vocab_size, eot_token));
  auto source = std::make_unique<FileListSource>(std::move(files));
  if (source->num_documents() == 0) {
    const std::string what =
        paths.size() == 1 ? paths.front()
                          : str_cat(paths.size(), " files ", paths.front(), " ... ", paths.back());
    HP_USER_ERROR(ErrorKind::kData, "empty data: ", what, " holds no tokens");
  }
  return source;
}

void write_bin_shard(const std::string& path, const std::vector<int32_t>& tokens) {
  if (tokens.size() > static_cast<size_t>(INT32_MAX))
    HP_USER_ERROR(ErrorKind::kData, "cannot write ", path, ": ", tokens.size(),
                  " tokens exceed the 2^31-1 an llm.c shard header can count");
  for (size_t k = 0; k < tokens.size(); ++k) {
    if (tokens[k] < 0 || tokens[k] > 65535)
      HP_USER_ERROR(ErrorKind::kData, "cannot write ", path, ": token ", tokens[k], " at offset ",
                    k, " does not fit the uint16 tokens of an llm.c shard");
  }
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) HP_FAIL(ErrorKind::kIo, "cannot create ", tmp, ": ", std::strerror(errno));
  auto fail = [&](const char* what) {
    const std::string err = std::strerror(errno);
    if (f != nullptr) std::fclose(f);
    std::remove(tmp.c_str());
    HP_FAIL(ErrorKind::kIo, what, " ", tmp, " failed: ", err);
  };
  int32_t header[kBinHeaderInts] = {};
  header[0] = kBinMagic;
  header[1] = kBinVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  if (std::fwrite(header, sizeof header, 1, f) != 1) fail("writing");
  std::vector<uint16_t> buf;
  constexpr size_t kChunk = size_t{1} << 20;
  for (size_t k = 0; k < tokens.size(); k += kChunk) {
    const size_t n = std::min(kChunk, tokens.size() - k);
    buf.assign(tokens.begin() + k, tokens.begin() + k + n);
    if (std::fwrite(buf.data(), sizeof(uint16_t), n, f) != n) fail("writing");
  }
  if (std::fflush(f) != 0 || ::fsync(::fileno(f)) != 0) fail("flushing");
  const int rc = std::fclose(f);
  f = nullptr;
  if (rc != 0) fail("closing");
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("renaming to the final name");
}

}  // namespace hp
