#include "framework/core/log.h"

#include <cstdio>
#include <mutex>

namespace hp {
namespace {
LogOptions g_opts;
std::mutex g_mu;
}  // namespace

void configure_logging(const LogOptions& opts) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_opts = opts;
}

void log_line(LogLevel level, const std::string& msg) {
  LogOptions o;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    o = g_opts;
  }
  if (level < o.level) return;
  if (level <= LogLevel::kInfo && o.rank != 0 && !o.all_ranks) return;
  const char* tag = level == LogLevel::kWarn    ? "warning: "
                    : level == LogLevel::kError ? "error: "
                                                : "";
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(stderr, "[hotpath r%d] %s%s\n", o.rank, tag, msg.c_str());
  std::fflush(stderr);
}

}  // namespace hp
