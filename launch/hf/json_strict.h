// JSON of Hugging Face checkpoints (safetensors headers, config.json, the shard index), parsed
// strictly: nlohmann::json keeps only one of two equal keys in an object, silently, so a key
// given twice is found with the parser's callback and refused; so is nesting deeper than a
// limit (no such file nests more than a few levels). Errors are UserError(kData) naming `what`.
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "framework/core/error.h"

namespace hp {

template <typename Json = nlohmann::json>
Json parse_json_strict(const char* begin, const char* end, const std::string& what,
                       int max_depth = 64) {
  struct Stop {
    std::string why;
  };
  std::vector<std::set<std::string>> keys;  // one set per open object
  std::vector<std::string> path;            // the key of each open level, for messages
  std::string last_key;
  typename Json::parser_callback_t cb = [&](int depth, typename Json::parse_event_t event,
                                            Json& parsed) -> bool {
    using E = typename Json::parse_event_t;
    if (depth > max_depth) throw Stop{str_cat("nested deeper than ", max_depth, " levels")};
    if (event == E::object_start) {
      keys.emplace_back();
      path.push_back(last_key);
    } else if (event == E::object_end) {
      if (!keys.empty()) keys.pop_back();
      if (!path.empty()) path.pop_back();
    } else if (event == E::key) {
      last_key = parsed.template get<std::string>();
      if (!keys.empty() && !keys.back().insert(last_key).second) {
        std::string where;
        for (size_t i = 1; i < path.size(); ++i) where += (where.empty() ? "" : ".") + path[i];
        throw Stop{str_cat("key '", last_key, "' appears twice",
                           where.empty() ? std::string(" at the top level")
                                         : str_cat(" in '", where, "'"),
                           " (JSON readers keep one of them; which one is not defined)")};
      }
    } else if (event == E::array_start) {
      path.push_back(last_key);
    } else if (event == E::array_end) {
      if (!path.empty()) path.pop_back();
    }
    return true;
  };
  try {
    return Json::parse(begin, end, cb);
  } catch (const Stop& s) {
    HP_USER_ERROR(ErrorKind::kData, what, ": ", s.why);
  } catch (const typename Json::parse_error& e) {
    // nlohmann's message carries the byte position; keep that part, not the library's prefix.
    std::string m = e.what();
    const size_t p = m.find("parse error");
    HP_USER_ERROR(ErrorKind::kData, what, " is not valid JSON (",
                  p == std::string::npos ? m : m.substr(p), ")");
  } catch (const std::exception& e) {
    HP_USER_ERROR(ErrorKind::kData, what, " is not valid JSON (", e.what(), ")");
  }
}

}  // namespace hp
