#include "launch/cpu_threads.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "framework/core/error.h"
#include "framework/core/log.h"

namespace hp {
namespace {

constexpr const char* kMarker = "HOTPATH_OMP_DEFAULTS";

// What apply_omp_defaults() found on the second start: the marker's value, "K=V,K=V" of the
// variables hotpath set (empty when it set none); and errno of a failed re-execution.
std::string& applied() {
  static std::string s;
  return s;
}
int& exec_errno() {
  static int e = 0;
  return e;
}

bool chosen(const std::string& var) {
  const std::string& a = applied();
  size_t at = 0;
  while ((at = a.find(var + "=", at)) != std::string::npos) {
    if (at == 0 || a[at - 1] == ',') return true;
    ++at;
  }
  return false;
}

std::string who(const char* var, const std::string& extra = "") {
  const char* v = std::getenv(var);
  if (v == nullptr) return str_cat(var, " unset: the OpenMP runtime's default");
  if (chosen(var)) return str_cat(var, "=", v, " chosen", extra);
  return str_cat(var, "=", v, " set by the user");
}

}  // namespace

OmpDefaults choose_omp_defaults(const EnvLookup& env) {
  OmpDefaults d;
  try {
    d.local_ranks = std::max(1, detect_launch(env).local_world);
  } catch (const UserError&) {
    d.local_ranks = 1;  // a malformed launcher environment is reported when the job starts
  }
  const auto unset = [&](const char* var) {
    const char* v = env(var);
    return v == nullptr || *v == '\0';
  };
  if (unset("OMP_WAIT_POLICY")) d.set.emplace_back("OMP_WAIT_POLICY", "passive");
  if (unset("OMP_NUM_THREADS") && d.local_ranks > 1) d.set.emplace_back("OMP_NUM_THREADS", "1");
  return d;
}

void apply_omp_defaults(char** argv) {
  if (const char* m = std::getenv(kMarker)) {
    applied() = m;
    ::unsetenv(kMarker);  // programs this one starts choose for themselves
    return;
  }
  const OmpDefaults d = choose_omp_defaults([](const char* k) { return std::getenv(k); });
  if (d.set.empty()) return;
  std::string marker;
  for (const auto& [k, v] : d.set) {
    ::setenv(k.c_str(), v.c_str(), 1);
    marker += (marker.empty() ? "" : ",") + k + "=" + v;
  }
  ::setenv(kMarker, marker.c_str(), 1);
  ::execv("/proc/self/exe", argv);
  // Still here: exec failed. Run with the runtime as loaded; the variables stay set for any
  // program this one starts.
  exec_errno() = errno != 0 ? errno : ENOEXEC;
  ::unsetenv(kMarker);
}

std::string describe_cpu_threads() {
  int local = 1;
  try {
    local = std::max(1, detect_launch().local_world);
  } catch (const UserError&) {
  }
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  std::string s = str_cat("cpu threads: ", omp_get_max_threads(), " per rank (",
                          who("OMP_NUM_THREADS", str_cat(" for ", local, " ranks on this node")),
                          "), idle threads ", policy != nullptr ? policy : "spin, then sleep", " (",
                          who("OMP_WAIT_POLICY"), ")");
  if (exec_errno() != 0)
    s += str_cat("; these could not take effect: re-executing /proc/self/exe failed: ",
                 std::strerror(exec_errno()));
  return s;
}

}  // namespace hp
