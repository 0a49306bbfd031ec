#include "launch/option_errors.h"

#include <map>
#include <utility>

namespace hp {
namespace {

namespace po = boost::program_options;

// Reads the substitutions Boost keeps protected (a derived class may name them).
struct ErrorFields : po::error_with_option_name {
  using Subs = std::map<std::string, std::string>;
  using Defaults = std::map<std::string, std::pair<std::string, std::string>>;
  static const Subs& subs(const po::error_with_option_name& e) {
    return e.*(&ErrorFields::m_substitutions);
  }
  static const Defaults& defaults(const po::error_with_option_name& e) {
    return e.*(&ErrorFields::m_substitution_defaults);
  }
  static std::string prefix(const po::error_with_option_name& e) {
    return (e.*(&ErrorFields::get_canonical_option_prefix))();
  }
};

}  // namespace

std::string option_error_text(const po::error& e) {
  const auto* named = dynamic_cast<const po::error_with_option_name*>(&e);
  if (named == nullptr) return e.what();
  // What Boost's substitute_placeholders() substitutes, with its rule for missing values.
  std::map<std::string, std::string> tokens;
  for (const auto& [name, value] : ErrorFields::subs(*named)) tokens["%" + name + "%"] = value;
  tokens["%canonical_option%"] = named->get_option_name();
  tokens["%prefix%"] = ErrorFields::prefix(*named);
  // A parameter without a value: its default rewrites the template itself (Boost's own text).
  std::string tmpl = named->m_error_template;
  for (const auto& [name, from_to] : ErrorFields::defaults(*named)) {
    const auto it = tokens.find("%" + name + "%");
    if (it != tokens.end() && !it->second.empty()) continue;
    const auto& [from, to] = from_to;
    if (from.empty()) continue;
    std::string rewritten;
    size_t at = 0;
    for (size_t hit; (hit = tmpl.find(from, at)) != std::string::npos; at = hit + from.size())
      rewritten.append(tmpl, at, hit - at).append(to);
    tmpl = rewritten.append(tmpl, at, std::string::npos);
  }
  std::string out;
  size_t at = 0;
  while (at < tmpl.size()) {
    const size_t open = tmpl.find('%', at);
    const size_t close = open == std::string::npos ? open : tmpl.find('%', open + 1);
    if (close == std::string::npos) break;
    const auto it = tokens.find(tmpl.substr(open, close - open + 1));
    if (it == tokens.end()) {
      out.append(tmpl, at, close - at);  // not a placeholder: keep, and look on from the '%'
      at = close;
      continue;
    }
    out.append(tmpl, at, open - at);
    out += it->second;
    at = close + 1;
  }
  out.append(tmpl, at, std::string::npos);
  return out;
}

}  // namespace hp
