#include "launch/hf/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "framework/core/error.h"
#include "launch/hf/json_strict.h"

namespace fs = std::filesystem;

namespace hp {

int64_t safetensors_dtype_size(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "BF16" || d == "F16" || d == "I16" || d == "U16") return 2;
  if (d == "U8" || d == "I8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2" || d == "E8M0")
    return 1;
  return 0;
}

float half_to_float(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  float v;
  if (exp == 0)
    v = std::ldexp(static_cast<float>(man), -24);
  else if (exp == 31)
    v = man == 0 ? INFINITY : NAN;
  else
    v = std::ldexp(static_cast<float>(man | 0x400u), static_cast<int>(exp) - 25);
  return sign ? -v : v;
}

namespace {
// The safetensors format's own limit on the header (100 MB): a larger length is damage.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
}  // namespace

SafetensorsHeader parse_safetensors_header(const uint8_t* bytes, uint64_t size,
                                           const std::string& path) {
  const std::string what = str_cat("safetensors file ", path, " (", size, " bytes)");
  if (size < 8) HP_USER_ERROR(ErrorKind::kData, what, ": too short for the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n < 2 || n > size - 8 || n > kMaxHeaderBytes)
    HP_USER_ERROR(ErrorKind::kData, what, ": header length ", n,
                  " does not fit the file (a safetensors file starts with the little-endian "
                  "length of its JSON header, at least 2 and at most ",
                  std::min<uint64_t>(size - 8, kMaxHeaderBytes), " bytes here)");
  SafetensorsHeader h;
  h.data_offset = 8 + n;
  const uint64_t data_bytes = size - 8 - n;
  const char* text = reinterpret_cast<const char*>(bytes + 8);
  const nlohmann::json header = parse_json_strict(text, text + n, what + ": header", 8);
  if (!header.is_object()) HP_USER_ERROR(ErrorKind::kData, what, ": header is not a JSON object");
  struct Range {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Range> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object())
        HP_USER_ERROR(ErrorKind::kData, what, ": __metadata__ is not a JSON object");
      continue;
    }
    const std::string where = str_cat(what, " tensor '", it.key(), "'");
    const nlohmann::json& t = it.value();
    const auto bad_entry = [&](const std::string& why) {
      HP_USER_ERROR(ErrorKind::kData, where, ": ", why,
                    " (an entry is {\"dtype\": str, \"shape\": [n, ...], \"data_offsets\": "
                    "[begin, end]})");
    };
    if (!t.is_object()) bad_entry("entry is not a JSON object");
    for (auto k = t.begin(); k != t.end(); ++k)
      if (k.key() != "dtype" && k.key() != "shape" && k.key() != "data_offsets")
        bad_entry(str_cat("unknown key '", k.key(), "'"));
    if (!t.contains("dtype") || !t["dtype"].is_string()) bad_entry("\"dtype\" is not a string");
    if (!t.contains("shape") || !t["shape"].is_array()) bad_entry("\"shape\" is not a list");
    if (!t.contains("data_offsets") || !t["data_offsets"].is_array() ||
        t["data_offsets"].size() != 2)
      bad_entry("\"data_offsets\" is not a list of two integers");
    SafetensorsEntry e;
    e.file = path;
    e.dtype = t["dtype"].get<std::string>();
    const int64_t es = safetensors_dtype_size(e.dtype);
    if (es == 0)
      HP_USER_ERROR(ErrorKind::kData, where, ": unknown dtype '", e.dtype,
                    "' (known: F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL F8_E4M3 "
                    "F8_E5M2 E8M0)");
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : t["shape"]) {
      // is_number_unsigned: an integer >= 0 that fits uint64 (negative ones are
      // number_integer, larger ones and fractions number_float).
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        HP_USER_ERROR(ErrorKind::kData, where, ": shape ", t["shape"].dump(),
                      " must be a list of integers >= 0");
      const uint64_t dim = d.get<uint64_t>();
      e.shape.push_back(static_cast<int64_t>(dim));
      overflow = overflow || __builtin_mul_overflow(numel, dim, &numel);
    }
    uint64_t nbytes = 0;
    overflow = overflow || __builtin_mul_overflow(numel, static_cast<uint64_t>(es), &nbytes);
    const auto& off = t["data_offsets"];
    for (int i = 0; i < 2; ++i)
      if (!off[i].is_number_unsigned() || off[i].get<uint64_t>() > data_bytes)
        HP_USER_ERROR(ErrorKind::kData, where, ": data_offsets ", off.dump(),
                      " are not inside the ", data_bytes,
                      " data bytes (two integers in [0, ", data_bytes,
                      "], offsets into the data section after the header)");
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end)
      HP_USER_ERROR(ErrorKind::kData, where, ": data_offsets [", begin, ", ", end,
                    "] end before they begin");
    if (overflow || end - begin != nbytes)
      HP_USER_ERROR(ErrorKind::kData, where, ": ", end - begin, " bytes for shape ",
                    shape_str(e.shape), " of ", e.dtype, " (expected ",
                    overflow ? std::string("more than 2^64") : std::to_string(nbytes), ")");
    e.begin = static_cast<int64_t>(begin);
    e.end = static_cast<int64_t>(end);
    ranges.push_back({begin, end, it.key()});
    h.entries[it.key()] = e;
  }
  // The byte ranges, in order, must tile the data section: no gap, no overlap, nothing after.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  for (const Range& r : ranges) {
    if (r.begin < at)
      HP_USER_ERROR(ErrorKind::kData, what, " tensor '", r.name, "': data_offsets [", r.begin, ", ",
                    r.end, "] overlap another tensor's bytes (which end at ", at, ")");
    if (r.begin > at)
      HP_USER_ERROR(ErrorKind::kData, what, " tensor '", r.name, "': data_offsets [", r.begin, ", ",
                    r.end, "] leave bytes [", at, ", ", r.begin, ") of the data section unused");
    at = r.end;
  }
  if (at != data_bytes)
    HP_USER_ERROR(ErrorKind::kData, what, ": the tensors cover ", at, " of the ", data_bytes,
                  " data bytes",
                  ranges.empty() ? std::string() : str_cat(" (the last is '", ranges.back().name, "')"),
                  "; the rest belongs to no tensor");
  return h;
}

std::vector<float> safetensors_to_f32(const std::string& name, const SafetensorsEntry& e,
                                      const uint8_t* p) {
  const int64_t n = shape_numel(e.shape);
  std::vector<float> out(static_cast<size_t>(n));
  if (e.dtype == "F32") {
    std::memcpy(out.data(), p, static_cast<size_t>(n) * 4);
  } else if (e.dtype == "BF16" || e.dtype == "F16") {
    const bool bf = e.dtype == "BF16";
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8));
      if (bf) {
        const uint32_t u = static_cast<uint32_t>(h) << 16;
        std::memcpy(&out[static_cast<size_t>(i)], &u, 4);
      } else {
        out[static_cast<size_t>(i)] = half_to_float(h);
      }
    }
  } else {
    HP_USER_ERROR(ErrorKind::kData, "tensor '", name, "' in ", e.file, " is ", e.dtype,
                  "; floating-point tensors must be F32, BF16 or F16");
  }
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(out[static_cast<size_t>(i)]))
      HP_USER_ERROR(ErrorKind::kData, "tensor '", name, "' in ", e.file, " holds ",
                    out[static_cast<size_t>(i)], " at flat index ", i, " of shape ",
                    shape_str(e.shape),
                    " (weights must be finite; the checkpoint is damaged or from a diverged run)");
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0)
    HP_USER_ERROR(ErrorKind::kData, "cannot open safetensors file ", path, ": ",
                  std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    HP_USER_ERROR(ErrorKind::kData, "cannot stat ", path, ": ", std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    HP_USER_ERROR(ErrorKind::kData, "safetensors file ", path, " is not a regular file");
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    HP_USER_ERROR(ErrorKind::kData, "safetensors file ", path, " (", size,
                  " bytes): too short for the 8-byte header length");
  }
  map_bytes_ = static_cast<size_t>(size);
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    HP_USER_ERROR(ErrorKind::kData, "cannot map safetensors file ", path, ": ",
                  std::strerror(errno));
  }
  const auto* bytes = static_cast<const uint8_t*>(map_);
  try {
    SafetensorsHeader h = parse_safetensors_header(bytes, size, path);
    data_ = bytes + h.data_offset;
    entries_ = std::move(h.entries);
  } catch (...) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

SafetensorsSet::SafetensorsSet(const std::string& dir) : dir_(dir) {
  const fs::path d(dir);
  const fs::path index = d / "model.safetensors.index.json";
  std::vector<std::string> files;
  std::map<std::string, std::string> listed;
  std::error_code ec;
  if (fs::exists(index, ec)) {
    const std::string where = index.string();
    std::ifstream f(index, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (!f && !f.eof()) HP_USER_ERROR(ErrorKind::kData, "cannot read ", where);
    const nlohmann::json j = parse_json_strict(text.data(), text.data() + text.size(), where, 16);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      HP_USER_ERROR(ErrorKind::kData, where, " has no \"weight_map\" object");
    // Every shard must be a file of this directory: no absolute path, no "..", and no symbolic
    // link that leads outside it.
    const fs::path root = fs::weakly_canonical(fs::absolute(d, ec), ec);
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      const auto refuse = [&](const std::string& why) {
        HP_USER_ERROR(ErrorKind::kData, where, ": weight_map entry '", it.key(), "': ", why,
                      " (shards are files of the checkpoint directory, named relative to it)");
      };
      if (!it.value().is_string()) refuse(str_cat(it.value().dump(), " is not a file name"));
      const std::string name = it.value().get<std::string>();
      const fs::path rel(name);
      if (name.empty()) refuse("the file name is empty");
      if (name.find('\0') != std::string::npos) refuse("the file name holds a NUL byte");
      if (rel.is_absolute() || rel.has_root_name() || rel.has_root_directory())
        refuse(str_cat("'", name, "' is an absolute path"));
      for (const fs::path& part : rel)
        if (part == "..") refuse(str_cat("'", name, "' has a '..' component"));
      const fs::path target = fs::weakly_canonical(root / rel, ec);
      const std::string t = target.string(), r = root.string();
      if (ec || t.size() <= r.size() || t.compare(0, r.size(), r) != 0 ||
          (r.back() != '/' && t[r.size()] != '/'))
        refuse(str_cat("'", name, "' leads outside the directory (to ", t, ")"));
      const std::string file = (d / rel).string();
      listed[it.key()] = file;
      if (std::find(files.begin(), files.end(), file) == files.end()) files.push_back(file);
    }
  } else if (fs::exists(d / "model.safetensors", ec)) {
    files.push_back((d / "model.safetensors").string());
  } else {
    for (const auto& e : fs::directory_iterator(d, ec))
      if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
    if (files.empty())
      HP_USER_ERROR(ErrorKind::kData,
                    "no model.safetensors, model.safetensors.index.json or "
                    "*.safetensors file in ",
                    dir);
  }
  for (const std::string& file : files) {
    auto sf = std::make_unique<SafetensorsFile>(file);
    for (const auto& kv : sf->entries()) {
      if (where_.count(kv.first))
        HP_USER_ERROR(ErrorKind::kData, "tensor '", kv.first, "' is in both ", where_[kv.first],
                      " and ", file);
      where_[kv.first] = file;
    }
    files_[file] = std::move(sf);
  }
  for (const auto& kv : listed) {
    auto it = where_.find(kv.first);
    if (it == where_.end() || it->second != kv.second)
      HP_USER_ERROR(ErrorKind::kData, "model.safetensors.index.json in ", dir, " lists tensor '",
                    kv.first, "' in ", kv.second, ", which does not hold it");
  }
}

SafetensorsSet::~SafetensorsSet() = default;

std::vector<std::string> SafetensorsSet::names() const {
  std::vector<std::string> n;
  for (const auto& kv : where_) n.push_back(kv.first);
  return n;
}

const SafetensorsFile& SafetensorsSet::file_of(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end())
    HP_USER_ERROR(ErrorKind::kData, "tensor '", name, "' is missing from the checkpoint in ", dir_);
  return *files_.at(it->second);
}

const SafetensorsEntry& SafetensorsSet::entry(const std::string& name) const {
  return file_of(name).entries().at(name);
}

std::vector<float> SafetensorsSet::read_f32(const std::string& name, const Shape& shape) const {
  const SafetensorsFile& f = file_of(name);
  const SafetensorsEntry& e = f.entries().at(name);
  if (!shape.empty() && e.shape != shape)
    HP_USER_ERROR(ErrorKind::kData, "tensor '", name, "' in ", e.file, " has shape ",
                  shape_str(e.shape), "; config.json implies ", shape_str(shape));
  return safetensors_to_f32(name, e, f.data(e));
}

std::vector<uint8_t> SafetensorsSet::read_u8(const std::string& name, const Shape& shape) const {
  const SafetensorsFile& f = file_of(name);
  const SafetensorsEntry& e = f.entries().at(name);
  if (e.dtype != "U8")
    HP_USER_ERROR(ErrorKind::kData, "tensor '", name, "' in ", e.file, " is ", e.dtype,
                  ", expected U8");
  if (e.shape != shape)
    HP_USER_ERROR(ErrorKind::kData, "tensor '", name, "' in ", e.file, " has shape ",
                  shape_str(e.shape), "; config.json implies ", shape_str(shape));
  const uint8_t* p = f.data(e);
  return std::vector<uint8_t>(p, p + (e.end - e.begin));
}

int64_t write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                          const std::string& dtype,
                          const std::map<std::string, std::string>& metadata) {
  HP_CHECK(dtype == "F32" || dtype == "BF16", "write_safetensors: dtype ", dtype);
  const int64_t es = safetensors_dtype_size(dtype);
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& kv : metadata) m[kv.first] = kv.second;
    header["__metadata__"] = m;
  }
  int64_t offset = 0;
  for (const auto& t : tensors) {
    const int64_t bytes = shape_numel(t.shape) * es;
    header[t.name] = {
        {"dtype", dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) HP_FAIL(ErrorKind::kIo, "cannot create ", tmp, ": ", std::strerror(errno));
  bool ok = true;
  uint8_t len[8];
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  ok = ok && std::fwrite(len, 1, 8, f) == 8;
  ok = ok && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  std::vector<uint16_t> buf;
  for (const auto& t : tensors) {
    const auto count = static_cast<size_t>(shape_numel(t.shape));
    if (dtype == "F32") {
      ok = ok && std::fwrite(t.data, 4, count, f) == count;
    } else {
      buf.resize(count);
      for (size_t i = 0; i < count; ++i) buf[i] = bf16(t.data[i]).bits;
      ok = ok && std::fwrite(buf.data(), 2, count, f) == count;
    }
  }
  ok = std::fflush(f) == 0 && ok;
  ok = ::fsync(fileno(f)) == 0 && ok;
  ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    HP_FAIL(ErrorKind::kIo, "writing ", path, " failed: ", std::strerror(err));
  }
  return 8 + static_cast<int64_t>(text.size()) + offset;
}

}  // namespace hp
