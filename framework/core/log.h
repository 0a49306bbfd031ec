// Rank-aware logging. Lines go to stderr as "[hotpath r<rank>] message"; by default only rank 0
// prints info lines, every rank prints warnings and errors.
#pragma once

#include <string>

#include "framework/core/error.h"

namespace hp {

enum class LogLevel { kInfo, kWarn, kError };

struct LogOptions {
  int rank = 0;
  bool all_ranks = false;  // info lines from every rank, not just rank 0
  LogLevel level = LogLevel::kInfo;
};

void configure_logging(const LogOptions& opts);
void log_line(LogLevel level, const std::string& msg);

template <typename... Args>
void log_info(const Args&... args) {
  log_line(LogLevel::kInfo, str_cat(args...));
}
template <typename... Args>
void log_warn(const Args&... args) {
  log_line(LogLevel::kWarn, str_cat(args...));
}
template <typename... Args>
void log_error(const Args&... args) {
  log_line(LogLevel::kError, str_cat(args...));
}

}  // namespace hp
