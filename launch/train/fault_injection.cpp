#include "launch/train/fault_injection.h"

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "framework/core/error.h"
#include "framework/core/log.h"
#include "parallel/launch_env.h"

namespace hp {
namespace {

constexpr const char* kSavePrefix = "kill-save-";
constexpr const char* kSavePoints[] = {"snapshot", "begin", "data", "close", "rename", "latest"};
constexpr const char* kFailPrefix = "fail-save-";
constexpr const char* kFailPoints[] = {"snapshot", "data", "close"};

[[noreturn]] void bad_spec(const std::string& text, const std::string& why) {
  HP_USER_ERROR(ErrorKind::kConfig, "HOTPATH_FAULT='", text, "': ", why,
                "; expected KIND:RANK:STEP with KIND throw, kill, hang, nan, sigterm, "
                "kill-save-POINT (POINT: snapshot, begin, data, close, rename, latest) or "
                "fail-save-POINT (POINT: snapshot, data, close; RANK -1: every rank), slow-save or "
                "no-host-memory (STEP 0)");
}

bool parse_integer(const std::string& s, long long* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  *out = std::strtoll(s.c_str(), &end, 10);
  return end == s.c_str() + s.size();
}

}  // namespace

FaultSpec parse_fault_spec(const std::string& text) {
  const size_t a = text.find(':');
  const size_t b = a == std::string::npos ? a : text.find(':', a + 1);
  if (b == std::string::npos) bad_spec(text, "not three fields");
  const std::string kind = text.substr(0, a);
  long long rank = 0, step = 0;
  if (!parse_integer(text.substr(a + 1, b - a - 1), &rank))
    bad_spec(text, "RANK is not an integer");
  if (!parse_integer(text.substr(b + 1), &step)) bad_spec(text, "STEP is not an integer");
  FaultSpec f;
  f.rank = static_cast<int>(rank);
  f.step = step;
  if (kind == "throw") {
    f.kind = FaultKind::kThrow;
  } else if (kind == "kill") {
    f.kind = FaultKind::kKill;
  } else if (kind == "hang") {
    f.kind = FaultKind::kHang;
  } else if (kind == "nan") {
    f.kind = FaultKind::kNan;
  } else if (kind == "sigterm") {
    f.kind = FaultKind::kSigterm;
  } else if (kind == "slow-save") {
    f.kind = FaultKind::kSlowSave;
  } else if (kind == "no-host-memory") {
    f.kind = FaultKind::kNoHostMemory;
    if (step != 0) bad_spec(text, "no-host-memory acts before step 1: STEP must be 0");
  } else if (kind.rfind(kSavePrefix, 0) == 0) {
    f.kind = FaultKind::kKillInSave;
    f.save_point = kind.substr(std::char_traits<char>::length(kSavePrefix));
    bool known = false;
    for (const char* p : kSavePoints) known = known || f.save_point == p;
    if (!known) bad_spec(text, "unknown save point '" + f.save_point + "'");
  } else if (kind.rfind(kFailPrefix, 0) == 0) {
    f.kind = FaultKind::kFailSave;
    f.save_point = kind.substr(std::char_traits<char>::length(kFailPrefix));
    bool known = false;
    for (const char* p : kFailPoints) known = known || f.save_point == p;
    if (!known) bad_spec(text, "unknown failure point '" + f.save_point + "'");
  } else {
    bad_spec(text, "unknown kind '" + kind + "'");
  }
  return f;
}

const std::optional<FaultSpec>& injected_fault() {
  static const std::optional<FaultSpec> fault = []() -> std::optional<FaultSpec> {
    const char* env = std::getenv("HOTPATH_FAULT");
    if (env == nullptr || *env == '\0') return std::nullopt;
    return parse_fault_spec(env);
  }();
  return fault;
}

void maybe_inject_step_fault(int rank, int64_t step, double collective_timeout_s) {
  const std::optional<FaultSpec>& f = injected_fault();
  if (!f || f->kind == FaultKind::kKillInSave || f->kind == FaultKind::kFailSave ||
      f->kind == FaultKind::kSlowSave || f->kind == FaultKind::kNoHostMemory ||
      f->kind == FaultKind::kNan || f->rank != rank || f->step != step)
    return;
  const char* name = f->kind == FaultKind::kThrow     ? "throw"
                     : f->kind == FaultKind::kKill    ? "kill"
                     : f->kind == FaultKind::kSigterm ? "sigterm"
                                                      : "hang";
  log_warn("injecting fault '", name, "' at step ", step, " (HOTPATH_FAULT)");
  if (f->kind == FaultKind::kSigterm) {
    std::raise(SIGTERM);  // a preemption request: the step goes on
    return;
  }
  if (f->kind == FaultKind::kThrow)
    HP_FAIL(ErrorKind::kInternal, "injected failure at step ", step);
  if (f->kind == FaultKind::kKill) std::raise(SIGKILL);
  // hang: the peers must time out; this rank gives up after three timeouts.
  std::this_thread::sleep_for(std::chrono::duration<double>(3 * collective_timeout_s));
  HP_FAIL(ErrorKind::kInternal, "injected hang at step ", step, " ended");
}

void maybe_inject_startup_signal() {
  const char* env = std::getenv("HOTPATH_FAULT");
  if (env == nullptr || std::strncmp(env, "sigterm:", 8) != 0) return;
  try {
    const FaultSpec f = parse_fault_spec(env);
    if (f.step != 0 || f.rank != detect_launch().rank) return;
  } catch (const std::exception&) {
    return;  // reported when the run parses HOTPATH_FAULT
  }
  std::raise(SIGTERM);
}

bool nan_gradients_injected(int rank, int64_t step) {
  const std::optional<FaultSpec>& f = injected_fault();
  if (!f || f->kind != FaultKind::kNan || f->rank != rank || f->step != step) return false;
  log_warn("injecting fault 'nan' (NaN gradients) at step ", step, " (HOTPATH_FAULT)");
  return true;
}

void maybe_inject_save_fault(const char* point, int rank, int64_t step) {
  const std::optional<FaultSpec>& f = injected_fault();
  if (!f || f->kind != FaultKind::kKillInSave || f->save_point != point || f->rank != rank ||
      f->step != step)
    return;
  log_warn("injecting fault 'kill-save-", point, "' in the save of step ", step,
           " (HOTPATH_FAULT)");
  std::raise(SIGKILL);
}

bool maybe_inject_save_failure(const char* point, int rank, int64_t step) {
  const std::optional<FaultSpec>& f = injected_fault();
  if (!f || f->kind != FaultKind::kFailSave || f->save_point != point ||
      (f->rank != rank && f->rank != -1) || f->step != step)
    return false;
  log_warn("injecting fault 'fail-save-", point, "' in the save of step ", step,
           " (HOTPATH_FAULT)");
  if (f->save_point == "snapshot") return true;
  HP_FAIL(ErrorKind::kIo, "writing the checkpoint of step ", step,
          ": No space left on device (ENOSPC, injected by HOTPATH_FAULT at '", point, "')");
}

void maybe_delay_background_save(int rank, int64_t step) {
  const std::optional<FaultSpec>& f = injected_fault();
  if (!f || f->kind != FaultKind::kSlowSave || (f->rank != rank && f->rank != -1) ||
      f->step != step)
    return;
  log_warn("injecting fault 'slow-save': the background write of step ", step,
           " starts 2 s late (HOTPATH_FAULT)");
  std::this_thread::sleep_for(std::chrono::seconds(2));
}

bool host_memory_fault_injected(int rank) {
  const std::optional<FaultSpec>& f = injected_fault();
  if (!f || f->kind != FaultKind::kNoHostMemory || (f->rank != rank && f->rank != -1)) return false;
  log_warn(
      "injecting fault 'no-host-memory': the host's available memory reads as 0 bytes "
      "(HOTPATH_FAULT)");
  return true;
}

}  // namespace hp
