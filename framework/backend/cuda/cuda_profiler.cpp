#include "framework/backend/cuda/cuda_profiler.h"

#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "framework/core/error.h"

#define CUPTI_CHECK(expr)                                                                 \
  do {                                                                                    \
    const CUptiResult hp_cupti_rc_ = (expr);                                              \
    if (hp_cupti_rc_ != CUPTI_SUCCESS) {                                                  \
      const char* hp_cupti_msg_ = nullptr;                                                \
      cuptiGetResultString(hp_cupti_rc_, &hp_cupti_msg_);                                 \
      HP_FAIL(ErrorKind::kCuda, #expr, " failed: ", hp_cupti_msg_ ? hp_cupti_msg_ : "?"); \
    }                                                                                     \
  } while (0)

namespace hp::cuda {
namespace {

constexpr CUpti_ExternalCorrelationKind kMarkKind = CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0;
constexpr size_t kBufferBytes = 8 << 20;
// Marks are pushed as phase * 256 + family + 1 (0 means "no mark").
uint64_t encode(StepPhase p, OpFamily f) {
  return static_cast<uint64_t>(p) * 256 + static_cast<uint64_t>(f) + 1;
}

// One piece of device work: [start, end) in CUPTI nanoseconds.
struct Work {
  uint64_t start, end;
  uint32_t correlation;
  int8_t family;  // >= 0: fixed by its kind or name (copies, collectives); -1: from its mark
  int32_t name;   // index into Collector::names
};

struct Collector {
  std::mutex mu;
  std::vector<Work> work;
  std::vector<std::string> names;  // kernel names, demangled and shortened
  std::unordered_map<std::string, int32_t> name_ids;
  int32_t intern(const char* raw) {
    const std::string key = raw ? raw : "?";
    auto it = name_ids.find(key);
    if (it != name_ids.end()) return it->second;
    names.push_back(short_kernel_name(key));
    return name_ids[key] = static_cast<int32_t>(names.size() - 1);
  }
  // "void hp::cuda::(anonymous namespace)::add_kernel<float>(float*, int)" -> "add_kernel<float>".
  static std::string short_kernel_name(const std::string& mangled) {
    if (mangled.empty() || mangled[0] == '(') return mangled;  // "(memset, ...)", "(memcpy)"
    int status = 0;
    char* d = abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status);
    std::string s = status == 0 && d ? d : mangled;
    std::free(d);
    int depth = 0;
    size_t cut = s.size(), begin = 0;
    for (size_t i = 0; i < s.size(); ++i) {  // the argument list: the first '(' outside <>
      if (s[i] == '<') ++depth;
      if (s[i] == '>') --depth;
      if (s[i] == '(' && depth == 0 && s.compare(i, 11, "(anonymous ") != 0) {
        cut = i;
        break;
      }
    }
    s.resize(cut);
    depth = 0;
    for (size_t i = 0; i < s.size(); ++i) {  // drop the return type and the namespaces
      if (s[i] == '<') ++depth;
      if (s[i] == '>') --depth;
      if (depth == 0 && (s[i] == ' ' || (s[i] == ':' && i + 1 < s.size() && s[i + 1] == ':')))
        begin = s[i] == ' ' ? i + 1 : i + 2;
    }
    s = s.substr(begin);
    return s.size() > 96 ? s.substr(0, 93) + "..." : s;
  }
  std::unordered_map<uint32_t, uint64_t> marks;  // correlation id -> mark
  bool registered = false;
};
Collector& collector() {
  static Collector* c = new Collector;  // CUPTI may call back at exit: never destroyed
  return *c;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

int8_t family_of_kernel(const char* name) {
  if (name && std::strstr(name, "nccl")) return static_cast<int8_t>(OpFamily::kComm);
  return -1;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  Collector& c = collector();
  std::lock_guard<std::mutex> lock(c.mu);
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        c.work.push_back(
            {k->start, k->end, k->correlationId, family_of_kernel(k->name), c.intern(k->name)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        c.work.push_back({m->start, m->end, m->correlationId,
                          static_cast<int8_t>(OpFamily::kCopies), c.intern("(memcpy)")});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        // By size: the small ones (counters, flags) cost their launch, the large ones bandwidth.
        const char* name = m->bytes < (64u << 10)   ? "(memset, under 64 KiB)"
                           : m->bytes < (16u << 20) ? "(memset, 64 KiB to 16 MiB)"
                                                    : "(memset, 16 MiB or more)";
        c.work.push_back({m->start, m->end, m->correlationId, -1, c.intern(name)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: {
        const auto* e = reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(rec);
        if (e->externalKind == kMarkKind) c.marks[e->correlationId] = e->externalId;
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
}

// External correlation records are emitted for API records, so the runtime and driver API kinds
// are on too (their own records are skipped).
const CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                     CUPTI_ACTIVITY_KIND_MEMCPY,
                                     CUPTI_ACTIVITY_KIND_MEMSET,
                                     CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
                                     CUPTI_ACTIVITY_KIND_RUNTIME,
                                     CUPTI_ACTIVITY_KIND_DRIVER};

uint64_t g_t0 = 0;
bool g_pushed = false;

}  // namespace

void profile_begin(StepPhase phase, OpFamily family) {
  Collector& c = collector();
  if (!c.registered) {
    CUPTI_CHECK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
    c.registered = true;
  }
  {
    std::lock_guard<std::mutex> lock(c.mu);
    c.work.clear();
    c.marks.clear();
  }
  for (CUpti_ActivityKind k : kKinds) CUPTI_CHECK(cuptiActivityEnable(k));
  CUPTI_CHECK(cuptiGetTimestamp(&g_t0));
  profile_mark(phase, family);
}

void profile_mark(StepPhase phase, OpFamily family) {
  uint64_t last = 0;
  if (g_pushed) CUPTI_CHECK(cuptiActivityPopExternalCorrelationId(kMarkKind, &last));
  CUPTI_CHECK(cuptiActivityPushExternalCorrelationId(kMarkKind, encode(phase, family)));
  g_pushed = true;
}

StepProfile profile_end() {
  uint64_t t1 = 0, last = 0;
  CUPTI_CHECK(cuptiGetTimestamp(&t1));
  if (g_pushed) CUPTI_CHECK(cuptiActivityPopExternalCorrelationId(kMarkKind, &last));
  g_pushed = false;
  CUPTI_CHECK(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
  for (CUpti_ActivityKind k : kKinds) CUPTI_CHECK(cuptiActivityDisable(k));

  Collector& c = collector();
  std::lock_guard<std::mutex> lock(c.mu);
  StepProfile p;
  // The window spans the recorded work: from the start of its first kernel, copy or fill to the
  // end of its last. Before the first, the device ran nothing of the window (the profiler's own
  // start-up, a few ms, falls there); after the last, the host was only waking from its wait.
  uint64_t first_start = std::numeric_limits<uint64_t>::max(), last_end = 0;
  for (const Work& w : c.work) {
    const uint64_t s = std::max(w.start, g_t0), e = std::min(w.end, t1);
    if (e <= s) continue;
    first_start = std::min(first_start, s);
    last_end = std::max(last_end, e);
  }
  const uint64_t t0 = first_start < last_end ? first_start : g_t0;
  if (first_start < last_end) t1 = last_end;
  p.wall_ms = (t1 - t0) * 1e-6;
  // Sweep over the start and end points: each elementary interval's length is split evenly
  // among the work active in it.
  struct Edge {
    uint64_t t;
    int item;
    bool open;
  };
  std::vector<Edge> edges;
  std::vector<std::pair<int, int>> attr;  // (phase, family) per item
  std::vector<int32_t> item_name;         // name id per item
  std::vector<StepProfile::KernelTime> by_name(c.names.size());
  for (const Work& w : c.work) {
    const uint64_t s = std::max(w.start, g_t0), e = std::min(w.end, t1);
    if (e <= s) continue;
    by_name[static_cast<size_t>(w.name)].ms += (e - s) * 1e-6;
    by_name[static_cast<size_t>(w.name)].count += 1;
    int phase = static_cast<int>(StepPhase::kOther);
    int family = static_cast<int>(OpFamily::kOther);
    auto it = c.marks.find(w.correlation);
    if (it != c.marks.end() && it->second > 0) {
      phase = static_cast<int>((it->second - 1) / 256);
      family = static_cast<int>((it->second - 1) % 256);
    }
    if (w.family >= 0) family = w.family;
    if (phase >= kNumStepPhases) phase = static_cast<int>(StepPhase::kOther);
    if (family >= kNumOpFamilies) family = static_cast<int>(OpFamily::kOther);
    const int item = static_cast<int>(attr.size());
    attr.emplace_back(phase, family);
    item_name.push_back(w.name);
    edges.push_back({s, item, true});
    edges.push_back({e, item, false});
  }
  p.kernels = static_cast<int64_t>(attr.size());
  for (size_t i = 0; i < by_name.size(); ++i) by_name[i].name = c.names[i];
  std::sort(by_name.begin(), by_name.end(),
            [](const auto& a, const auto& b) { return a.ms > b.ms; });
  while (!by_name.empty() && by_name.back().count == 0) by_name.pop_back();
  p.top_kernels = std::move(by_name);
  std::sort(edges.begin(), edges.end(), [](const Edge& a, const Edge& b) {
    return a.t != b.t ? a.t < b.t : (a.open < b.open);  // closes before opens at equal times
  });
  std::vector<int> active;
  uint64_t prev = t0;
  int last_closed = -1;
  std::unordered_map<uint64_t, size_t> gap_of_pair;  // (before name, after name) -> idle_gaps
  for (const Edge& e : edges) {
    if (active.empty() && e.open && e.t > prev) {  // a gap, ended by this item
      const double gap = (e.t - prev) * 1e-6;
      p.idle_by_phase[attr[e.item].first] += gap;
      p.idle_by_family[attr[e.item].second] += gap;
      const int32_t before = last_closed >= 0 ? item_name[static_cast<size_t>(last_closed)] : -1;
      const int32_t after = item_name[static_cast<size_t>(e.item)];
      const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(before)) << 32) |
                           static_cast<uint32_t>(after);
      auto [it, fresh] = gap_of_pair.try_emplace(key, p.idle_gaps.size());
      if (fresh) {
        StepProfile::IdleGap g;
        g.before = before >= 0 ? c.names[static_cast<size_t>(before)] : "(profile start)";
        g.after = c.names[static_cast<size_t>(after)];
        g.phase = static_cast<StepPhase>(attr[e.item].first);
        g.family = static_cast<OpFamily>(attr[e.item].second);
        p.idle_gaps.push_back(std::move(g));
      }
      p.idle_gaps[it->second].ms += gap;
      p.idle_gaps[it->second].count += 1;
    }
    if (!active.empty() && e.t > prev) {
      const double share = (e.t - prev) * 1e-6 / static_cast<double>(active.size());
      for (int i : active) {
        p.by_phase[attr[i].first] += share;
        p.by_family[attr[i].second] += share;
      }
      p.busy_ms += (e.t - prev) * 1e-6;
    }
    prev = e.t;
    if (e.open) {
      active.push_back(e.item);
    } else {
      active.erase(std::find(active.begin(), active.end(), e.item));
      last_closed = e.item;
    }
  }
  std::sort(p.idle_gaps.begin(), p.idle_gaps.end(),
            [](const auto& a, const auto& b) { return a.ms > b.ms; });
  if (t1 > prev) {
    p.idle_by_phase[static_cast<int>(StepPhase::kOther)] += (t1 - prev) * 1e-6;
    p.idle_by_family[static_cast<int>(OpFamily::kOther)] += (t1 - prev) * 1e-6;
  }
  p.idle_ms = std::max(0.0, p.wall_ms - p.busy_ms);
  c.work.clear();
  c.marks.clear();
  return p;
}

}  // namespace hp::cuda
