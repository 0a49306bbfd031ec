// Counts host synchronizations by cause: every stream/event synchronize and every blocking
// device->host read the runtime performs. Tests assert these counts; logs and benchmarks print
// them. Both backends count the same points, so a CPU test proves the CUDA path's sync budget.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace hp {

enum class SyncCause : uint8_t { kMetadata, kRouting, kOffload, kLoss, kOther };
constexpr int kNumSyncCauses = 5;

const char* sync_cause_name(SyncCause c);

class SyncCounter {
 public:
  void add(SyncCause c, int64_t n = 1) { counts_[static_cast<size_t>(c)] += n; }
  int64_t get(SyncCause c) const { return counts_[static_cast<size_t>(c)]; }
  int64_t total() const;
  void reset() { counts_.fill(0); }
  // {"metadata":0,"routing":4,...}
  std::string json() const;

 private:
  std::array<int64_t, kNumSyncCauses> counts_{};
};

}  // namespace hp
