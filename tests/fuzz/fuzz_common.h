// Shared pieces of the libFuzzer harnesses (tests/fuzz, built with HOTPATH_FUZZ).
//
// Every harness feeds its input to a public reader as a file and accepts one outcome for bad
// input: a hp::UserError (the message a user sees), or a hp::Error of the I/O kinds a damaged
// file may cause (kHdf5, kIo). Anything else escapes the harness and is a finding: a sanitizer
// report, a crash, an internal error (HP_CHECK), or a std exception the reader let through.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "framework/core/error.h"
#include "framework/core/log.h"

namespace hp::fuzz {

// Writes data[0:size] to `path` (created or truncated); aborts on any failure, which is then a
// finding of the harness rather than of the reader.
inline void write_file(const std::string& path, const uint8_t* data, size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) std::abort();
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) std::abort();
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

// The input as a file the readers open by path, like any file: one per process, rewritten for
// every input, in /dev/shm where it exists (no disk I/O per input), and removed afterwards.
// (Not a memfd behind /proc/self/fd: HDF5 resolves the link and cannot open the target.)
class ScratchFile {
 public:
  ScratchFile(const uint8_t* data, size_t size) {
    const char* dir = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    path_ = std::string(dir) + "/hotpath-fuzz-" + std::to_string(::getpid());
    write_file(path_, data, size);
  }
  ~ScratchFile() { ::unlink(path_.c_str()); }
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// True for an HDF5 file whose superblock is version 2 or later (signature at offset 0), the
// formats whose metadata carries checksums. HDF5 1.10's parser of the older, unchecksummed
// metadata (superblock 0/1, local heaps, version-1 object headers) is not robust to damage: it
// can crash inside the library on a damaged file (not in hotpath's code, and not fixable here),
// so the HDF5 harnesses fuzz hotpath's readers on checksummed files, which is what hotpath
// writes. (A damaged version-2 superblock fails its checksum; older versions are skipped.)
inline bool checksummed_hdf5(const uint8_t* data, size_t size) {
  static const uint8_t kSignature[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
  return size > 8 && std::memcmp(data, kSignature, 8) == 0 && data[8] >= 2;
}

// Quiet logs: warnings about damaged inputs would flood the fuzzer's output.
inline void quiet_logs() {
  static const bool once = [] {
    LogOptions o;
    o.level = LogLevel::kError;
    configure_logging(o);
    return true;
  }();
  (void)once;
}

// HP_FUZZ_VERBOSE=1 prints the error each input ends with (for replaying one input).
inline void note(const char* what) {
  static const bool verbose = std::getenv("HP_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "fuzz: rejected: %s\n", what);
}

// The outcomes a bad input may have; returns normally for them and aborts on anything else.
template <typename Fn>
void expect_clean(Fn&& fn) {
  try {
    fn();
  } catch (const UserError& e) {
    note(e.what());
  } catch (const Error& e) {
    note(e.what());
    if (e.kind() != ErrorKind::kHdf5 && e.kind() != ErrorKind::kIo) {
      std::fprintf(stderr, "fuzz: unexpected %s error: %s\n", error_kind_name(e.kind()), e.what());
      std::abort();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: unexpected exception: %s\n", e.what());
    std::abort();
  }
}

// A violated invariant of a reader's result.
#define HP_FUZZ_REQUIRE(cond)                                                             \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "fuzz: %s:%d: %s does not hold\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)

}  // namespace hp::fuzz
