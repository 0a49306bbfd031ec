// Token files: readers that present files as a DocumentSource, and writers for both formats.
//
// Formats:
//   .bin  llm.c token shard: a header of 256 little-endian int32 (header[0] = 20240520,
//         header[1] = 1, header[2] = token count N), then N uint16 tokens. Documents are split
//         after every EOT token; a trailing run without EOT becomes a document with EOT appended.
//   .h5 / .hdf5  dataset /tokens (unsigned 32-bit integers, 1-D) and /doc_offsets (int64, 1-D,
//         n_docs + 1 entries, starting at 0, non-decreasing, last == len(/tokens)); document i is
//         tokens[off[i]:off[i+1]], with EOT appended if it does not end with one. Optional
//         /loss_mask (uint8, 1-D, len(/tokens) entries of 0 or 1): 0 marks a token the loss
//         must not predict (SFT prompts); the loader turns such targets into ignored ones (-1),
//         like padding. An appended EOT takes the mask of its document's last token.
//
// Every file is validated when opened: header or datasets, offsets, and every token id against
// vocab_size (a scan in bounded memory, in chunks). A problem throws UserError(ErrorKind::kData)
// naming the file and the offending entry. Tokens are then read on demand with pread(2) (or
// through HDF5), so a file is never held in memory twice and a file truncated while a job reads
// it fails that read with a UserError(kData) naming the file, never with SIGBUS.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "framework/data/document_source.h"

namespace hp {

constexpr int32_t kBinMagic = 20240520;
constexpr int32_t kBinVersion = 1;
constexpr int64_t kBinHeaderInts = 256;
constexpr int64_t kBinHeaderBytes = kBinHeaderInts * 4;

// Expands a source string into file paths: a comma-separated list whose elements are paths or
// glob(3) patterns (each pattern's matches in sorted order). A pattern without matches throws.
std::vector<std::string> expand_source_paths(const std::string& spec);

// What open_token_file checks before it reads: a known extension, a file that can be opened.
// Throws its UserError otherwise.
void check_token_file(const std::string& path);

// Opens one file, the format picked by its extension (.bin, .h5, .hdf5; anything else throws).
std::unique_ptr<DocumentSource> open_token_file(const std::string& path, int64_t vocab_size,
                                                int32_t eot_token);
// The two formats directly.
std::unique_ptr<DocumentSource> open_bin_shard(const std::string& path, int64_t vocab_size,
                                               int32_t eot_token);
std::unique_ptr<DocumentSource> open_h5_tokens(const std::string& path, int64_t vocab_size,
                                               int32_t eot_token);
// Opens files as one source: their documents in list order. Throws if they hold no tokens.
std::unique_ptr<DocumentSource> open_token_files(const std::vector<std::string>& paths,
                                                 int64_t vocab_size, int32_t eot_token);

// Writers. Both write `<path>.tmp`, flush it to disk and rename it to `path`, so a file under the
// final name is always complete. Failures throw (ErrorKind::kIo / kHdf5) and remove the temp file.
// HDF5 files are written in the HDF5 1.10 format (checksummed metadata; readable by HDF5 >= 1.10).
//
// An llm.c shard; every token must be in 0..65535.
void write_bin_shard(const std::string& path, const std::vector<int32_t>& tokens);
// An HDF5 token file from documents (each usually ending with EOT; not enforced).
void write_h5_tokens(const std::string& path, const std::vector<std::vector<int32_t>>& docs);
// The same from flat arrays, written as given (no validation of doc_offsets: tests use this to
// produce malformed files). Tokens must be >= 0.
void write_h5_tokens(const std::string& path, const std::vector<int32_t>& tokens,
                     const std::vector<int64_t>& doc_offsets);
// The same with a /loss_mask dataset (one entry per token; null: none).
void write_h5_tokens(const std::string& path, const std::vector<int32_t>& tokens,
                     const std::vector<int64_t>& doc_offsets,
                     const std::vector<uint8_t>* loss_mask);

}  // namespace hp
