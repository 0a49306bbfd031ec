// Writes the fuzzers' seed corpora: valid files of each kind and damaged copies of them
// (truncated, bytes flipped, fields out of range). Run by hand after a format change, from the
// asan build: build/asan/bin/make_fuzz_seeds tests/fuzz/corpus; the files are checked in.
// (The config corpus is edited by hand: small INI files.)
#include <hdf5.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "framework/checkpoint/checkpoint.h"
#include "framework/data/token_files.h"

namespace fs = std::filesystem;

namespace {

constexpr int32_t kEot = 50256;

std::vector<char> slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void spit(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Damaged copies of `path`: cut to `cuts` sizes (fractions of the file), one byte flipped at
// each of `flips` (fractions).
void damage(const std::string& path, const std::string& stem, const std::string& ext,
            const std::vector<double>& cuts, const std::vector<double>& flips) {
  const std::vector<char> bytes = slurp(path);
  const fs::path dir = fs::path(path).parent_path();
  for (double c : cuts) {
    const auto n = static_cast<size_t>(c * static_cast<double>(bytes.size()));
    spit(dir / (stem + "_cut" + std::to_string(n) + ext),
         std::vector<char>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n)));
  }
  for (double f : flips) {
    std::vector<char> b = bytes;
    const auto at = static_cast<size_t>(f * static_cast<double>(b.size()));
    b[at] = static_cast<char>(b[at] ^ 0x5a);
    spit(dir / (stem + "_flip" + std::to_string(at) + ext), b);
  }
}

std::vector<int32_t> documents(int n_docs, int len, bool last_eot) {
  std::vector<int32_t> t;
  for (int d = 0; d < n_docs; ++d) {
    for (int k = 0; k < len + d % 5; ++k) t.push_back((d * 131 + k * 7) % kEot);
    if (last_eot || d + 1 < n_docs) t.push_back(kEot);
  }
  return t;
}

void bin_seeds(const fs::path& dir) {
  fs::create_directories(dir);
  hp::write_bin_shard(dir / "valid.bin", documents(12, 6, true));
  hp::write_bin_shard(dir / "no_final_eot.bin", documents(3, 20, false));
  hp::write_bin_shard(dir / "empty.bin", {});
  hp::write_bin_shard(dir / "one_token.bin", {kEot});
  // Header fields: magic, version and count patched.
  std::vector<char> b = slurp(dir / "valid.bin");
  auto patch = [&](const char* name, int index, int32_t value) {
    std::vector<char> c = b;
    std::memcpy(c.data() + 4 * index, &value, 4);
    spit(dir / name, c);
  };
  patch("bad_magic.bin", 0, 20240521);
  patch("bad_version.bin", 1, 2);
  patch("count_negative.bin", 2, -5);
  patch("count_too_big.bin", 2, 1 << 30);
  patch("count_short.bin", 2, 3);  // trailing bytes after the announced tokens
  std::vector<char> big = b;
  const uint16_t bad = 60000;  // >= vocab_size
  std::memcpy(big.data() + 1024 + 10, &bad, 2);
  spit(dir / "token_beyond_vocab.bin", big);
  damage(dir / "valid.bin", "valid", ".bin", {0.5, 0.99}, {});
}

// An HDF5 token file written through the HDF5 API with a chosen layout and type: the reader's
// path through HDF5 (chunked, filtered, big-endian) next to its direct reads.
void h5_custom(const std::string& path, const std::vector<int32_t>& tokens,
               const std::vector<int64_t>& offsets, hid_t file_type, bool chunked) {
  const hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
  H5Pset_libver_bounds(fapl, H5F_LIBVER_V110, H5F_LIBVER_V110);
  const hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
  H5Pclose(fapl);
  const hsize_t n[1] = {tokens.size()}, m[1] = {offsets.size()}, chunk[1] = {16};
  const hid_t s1 = H5Screate_simple(1, n, nullptr), s2 = H5Screate_simple(1, m, nullptr);
  const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
  if (chunked) {
    H5Pset_chunk(dcpl, 1, chunk);
    H5Pset_deflate(dcpl, 1);
  }
  const hid_t d1 = H5Dcreate2(f, "/tokens", file_type, s1, H5P_DEFAULT, dcpl, H5P_DEFAULT);
  H5Dwrite(d1, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, tokens.data());
  const hid_t d2 =
      H5Dcreate2(f, "/doc_offsets", H5T_STD_I64LE, s2, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5Dwrite(d2, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, offsets.data());
  H5Dclose(d1);
  H5Dclose(d2);
  H5Pclose(dcpl);
  H5Sclose(s1);
  H5Sclose(s2);
  H5Fclose(f);
}

void h5_seeds(const fs::path& dir) {
  fs::create_directories(dir);
  std::vector<std::vector<int32_t>> docs;
  for (int d = 0; d < 8; ++d) {
    std::vector<int32_t> doc;
    for (int k = 0; k < 4 + d; ++k) doc.push_back((d * 31 + k) % kEot);
    if (d % 3 != 0) doc.push_back(kEot);  // some documents lack their EOT
    docs.push_back(doc);
  }
  hp::write_h5_tokens(dir / "valid.h5", docs);
  std::vector<int32_t> flat;
  std::vector<int64_t> off{0};
  for (const auto& d : docs) {
    flat.insert(flat.end(), d.begin(), d.end());
    off.push_back(static_cast<int64_t>(flat.size()));
  }
  hp::write_h5_tokens(dir / "offsets_decrease.h5", flat,
                      {0, 5, 3, static_cast<int64_t>(flat.size())});
  hp::write_h5_tokens(dir / "offsets_short.h5", flat, {0, 4});
  hp::write_h5_tokens(dir / "empty_docs.h5", flat, {0, 0, 0, static_cast<int64_t>(flat.size())});
  hp::write_h5_tokens(dir / "no_tokens.h5", {}, {0, 0});
  h5_custom(dir / "chunked_deflate.h5", flat, off, H5T_STD_U32LE, true);
  h5_custom(dir / "i16_be.h5", flat, off, H5T_STD_I16BE, false);
  h5_custom(dir / "u16_le.h5", flat, off, H5T_STD_U16LE, false);
  damage(dir / "valid.h5", "valid", ".h5", {0.3, 0.9}, {0.05, 0.5, 0.95});
}

void checkpoint_seeds(const fs::path& dir) {
  fs::create_directories(dir);
  const std::string path = dir / "valid.h5";
  {
    hp::CheckpointWriter w(path, nullptr);
    std::vector<float> emb(16 * 8), wq(2 * 8 * 4);
    for (size_t k = 0; k < emb.size(); ++k) emb[k] = 0.01f * static_cast<float>(k);
    for (size_t k = 0; k < wq.size(); ++k) wq[k] = -0.02f * static_cast<float>(k);
    w.write_rows("/params/embed", {16, 8}, hp::DType::kF32, 4, hp::RowRange{0, 16}, emb.data());
    w.write_rows("/params/layers.0.experts", {2, 8, 4}, hp::DType::kF32, 1, hp::RowRange{0, 2},
                 wq.data());
    w.write_rows("/optim/m/embed", {16, 8}, hp::DType::kF32, 16, hp::RowRange{0, 16}, emb.data());
    const std::vector<double> lr{1e-3, 1e-4, 10, 0, 0, 100};
    w.write_rows("/state/lr_schedule", {6}, hp::DType::kF64, 6, hp::RowRange{0, 6}, lr.data());
    w.write_i64("/state/step", {12}, true);
    w.write_i64("/state/loader", {1, 0, 5, 0, 12, 99}, true);
    w.set_attr("format", std::string(hp::kCheckpointFormat));
    w.set_attr("format_version", hp::kCheckpointVersion);
    w.set_attr("hotpath_version", std::string("0.1.0"));
    w.set_attr("config", std::string("d_model = 8\nvocab_size = 16\n"));
    w.set_attr("step", int64_t{12});
    w.set_attr("world", int64_t{1});
    w.set_attr("dp", int64_t{1});
    w.set_attr("ep", int64_t{1});
    w.set_attr("shape", std::vector<int64_t>{16, 8});
    w.close();
  }
  {
    hp::CheckpointWriter w(dir / "not_a_checkpoint.h5", nullptr);
    w.set_attr("format", std::string("something-else"));
    w.close();
  }
  damage(path, "valid", ".h5", {0.5, 0.97}, {0.02, 0.3, 0.6, 0.8, 0.99});
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_fuzz_seeds CORPUS_DIR\n");
    return 2;
  }
  const fs::path out = argv[1];
  bin_seeds(out / "bin_tokens");
  h5_seeds(out / "h5_tokens");
  checkpoint_seeds(out / "checkpoint");
  return 0;
}
