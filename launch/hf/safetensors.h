// Safetensors files: an 8-byte little-endian header length N, N bytes of JSON naming every tensor
// ({"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__":
// {...}}), then the tensors' raw little-endian bytes, offsets relative to the end of the header.
// A checkpoint of several files has `model.safetensors.index.json` whose "weight_map" names the
// file of every tensor.
//
// The reader maps each file read-only and validates the whole header when it opens it: the header
// length fits the file, the header is one JSON object without a key given twice, every tensor has
// a known dtype, a shape of integers >= 0 whose element count times the dtype size (no overflow)
// is its byte length, and data_offsets [begin, end] inside the data section; the tensors' byte
// ranges, in order, cover the data section exactly, without gaps or overlaps. A problem throws
// UserError(kData) naming the file and the tensor. Tensors are converted to fp32 on request (BF16,
// F16, F32; a NaN or infinity is refused naming the tensor and its first such element; U8 is read
// as bytes for MXFP4 blocks and scales).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "framework/core/tensor.h"

namespace hp {

struct SafetensorsEntry {
  std::string dtype;  // as written: "F32", "BF16", "F16", "U8", ...
  Shape shape;
  int64_t begin = 0, end = 0;  // byte offsets into the data section
  std::string file;            // the file holding it
};

// The header of a safetensors image of `size` bytes at `bytes` (`path` names it in messages):
// the tensors, and where the data section starts. Validates everything listed above.
struct SafetensorsHeader {
  uint64_t data_offset = 0;  // 8 + header length
  std::map<std::string, SafetensorsEntry> entries;
};
SafetensorsHeader parse_safetensors_header(const uint8_t* bytes, uint64_t size,
                                           const std::string& path);
// The tensor `name` (entry `e`, whose bytes start at `data`) as fp32: F32, BF16 or F16 stored;
// a NaN or infinity is refused naming the tensor, its file and the first such flat index.
std::vector<float> safetensors_to_f32(const std::string& name, const SafetensorsEntry& e,
                                      const uint8_t* data);
// One safetensors file, memory-mapped.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  const uint8_t* data(const SafetensorsEntry& e) const { return data_ + e.begin; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint8_t* data_ = nullptr;
  std::map<std::string, SafetensorsEntry> entries_;
};

// The tensors of a checkpoint directory: model.safetensors, or the shards listed by
// model.safetensors.index.json (every listed file must exist and hold the tensors it is listed
// for), or, without either, every *.safetensors file in the directory.
class SafetensorsSet {
 public:
  explicit SafetensorsSet(const std::string& dir);
  ~SafetensorsSet();

  bool has(const std::string& name) const { return where_.count(name) != 0; }
  const SafetensorsEntry& entry(const std::string& name) const;  // throws naming the tensor
  std::vector<std::string> names() const;
  // The tensor as fp32 (BF16, F16 or F32 stored), checked against `shape` when given.
  std::vector<float> read_f32(const std::string& name, const Shape& shape = {}) const;
  // A U8 tensor's bytes, checked against `shape`.
  std::vector<uint8_t> read_u8(const std::string& name, const Shape& shape) const;
  const std::string& dir() const { return dir_; }

 private:
  const SafetensorsFile& file_of(const std::string& name) const;
  std::string dir_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::string> where_;  // tensor -> file path
};

// Writing: tensors of one shard, in the order given, as `dtype` ("F32" or "BF16") from fp32.
struct SafetensorsTensor {
  std::string name;
  Shape shape;
  const float* data = nullptr;
};
// Writes `path` (through path + ".tmp" and a rename). Returns the bytes written.
int64_t write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                          const std::string& dtype,
                          const std::map<std::string, std::string>& metadata = {});
// Bytes per element of a safetensors dtype name ("F32" 4, "BF16" 2, ...); 0 if unknown.
int64_t safetensors_dtype_size(const std::string& dtype);

float half_to_float(uint16_t h);

}  // namespace hp
