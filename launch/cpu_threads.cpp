#include "launch/cpu_threads.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>

#include "framework/core/error.h"
#include "framework/core/log.h"

namespace hp {
namespace {

// "K=V,K=V" of the variables apply_omp_defaults() set (empty when it set none).
std::string& applied() {
  static std::string s;
  return s;
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
  if (unset("OMP_NUM_THREADS") && d.local_ranks > 1) d.set.emplace_back("OMP_NUM_THREADS", "1");
  return d;
}

void apply_omp_defaults() {
  const OmpDefaults d = choose_omp_defaults([](const char* k) { return std::getenv(k); });
  std::string set;
  for (const auto& [k, v] : d.set) {
    ::setenv(k.c_str(), v.c_str(), 1);
    if (k == "OMP_NUM_THREADS") omp_set_num_threads(std::atoi(v.c_str()));
    set += (set.empty() ? "" : ",") + k + "=" + v;
  }
  applied() = set;
}

std::string describe_cpu_threads() {
  int local = 1;
  try {
    local = std::max(1, detect_launch().local_world);
  } catch (const UserError&) {
  }
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  return str_cat("cpu threads: ", omp_get_max_threads(), " per rank (",
                 who("OMP_NUM_THREADS", str_cat(" for ", local, " ranks on this node")),
                 "), idle threads ", policy != nullptr ? policy : "spin, then sleep", " (",
                 who("OMP_WAIT_POLICY"), ")");
}

}  // namespace hp
