// Safetensors files: an 8-byte little-endian header length N, N bytes of JSON naming every tensor
// ({"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__":
// {...}}), then the tensors' raw little-endian bytes, offsets relative to the end of the header.
// A checkpoint of several files has `model.safetensors.index.json` whose "weight_map" names the
// file of every tensor.
//
// The reader maps each file read-only and validates the whole header when it opens it (JSON,
// dtypes, shapes against offsets, offsets inside the file); a problem throws UserError(kData)
// naming the file and the tensor. Tensors are converted to fp32 on request (BF16, F16, F32; U8 is
// read as bytes for MXFP4 blocks and scales).
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
