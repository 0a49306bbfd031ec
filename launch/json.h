// The JSON hotpath writes (metrics, benchmark results), through one library (nlohmann-json).
// JSON has no NaN or infinity: json_number() writes them as null.
#pragma once

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "framework/core/error.h"

namespace hp {

// Objects keep their keys in insertion order, as the documented layouts list them.
using Json = nlohmann::ordered_json;

inline Json json_number(double v) { return std::isfinite(v) ? Json(v) : Json(nullptr); }

inline Json json_numbers(const std::vector<double>& v) {
  Json a = Json::array();
  for (double x : v) a.push_back(json_number(x));
  return a;
}

// Writes `text` and a newline to `path` through a temporary file renamed over it, so `path` is
// either the old file or the whole new one; `key` names the option that gave the path.
inline void write_text_file(const std::string& path, const std::string& text, const char* key) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (f) f << text << "\n";
    f.flush();
    if (!f) {
      std::remove(tmp.c_str());
      HP_USER_ERROR(ErrorKind::kConfig, "config key '", key, "': cannot write '", path, "'");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    HP_USER_ERROR(ErrorKind::kConfig, "config key '", key, "': cannot write '", path, "'");
  }
}

// write_text_file of `j`, on one line.
inline void write_json_file(const std::string& path, const Json& j, const char* key) {
  write_text_file(path, j.dump(), key);
}

}  // namespace hp
