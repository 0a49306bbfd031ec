// Finite-difference gradient checks on the f64 CPU backend (whose tensors are host memory).
//
// numeric_gradient() perturbs one element of an f64 tensor at a time and takes central
// differences of a scalar loss; check() compares that with an analytic gradient. The main
// criterion is the norm-based relative error ||a - n|| / max(||a||, ||n||); the largest
// per-element relative error |a_i - n_i| / max(|a_i|, |n_i|, floor) is reported too, with a floor
// scaled to the gradient's magnitude so that elements that are zero up to round-off do not
// dominate. For big tensors (whole models), `indices` restricts the check to a sample.
//
// Typical use, with a random projection R turning an op's output into a scalar:
//   auto loss = [&] { be->some_op_fwd(x, out); return grad_check::weighted_sum(out, r); };
//   be->some_op_bwd(..., /*dout=*/r, dx);
//   EXPECT_TRUE(grad_check::passes(grad_check::check(x, dx, loss), "dx"));
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "framework/core/tensor.h"

namespace hp::grad_check {

struct Options {
  double step = 1e-5;               // central-difference step, times max(1, |x_i|)
  double tolerance = 1e-4;          // bound on the norm-based relative error
  double element_tolerance = 1e-3;  // bound on the largest per-element relative error
  double floor_scale = 1e-6;        // element floor = floor_scale * largest |gradient| (+1e-300)
  std::vector<int64_t> indices;     // empty: every element of x; else only these
};

struct Result {
  int64_t checked = 0;
  double analytic_norm = 0;
  double numeric_norm = 0;
  double norm_rel_err = 0;  // ||a - n|| / max(||a||, ||n||)
  double max_rel_err = 0;   // max_i |a_i - n_i| / max(|a_i|, |n_i|, floor)
  int64_t worst = -1;       // element index (into x) of max_rel_err
  double worst_analytic = 0;
  double worst_numeric = 0;
  Options options;

  std::string summary() const {
    std::ostringstream os;
    os << "checked " << checked << " elements: ||analytic|| = " << analytic_norm
       << ", ||numeric|| = " << numeric_norm << ", norm relative error = " << norm_rel_err
       << " (tolerance " << options.tolerance << "), worst element " << worst << ": analytic "
       << worst_analytic << " vs numeric " << worst_numeric << ", relative error " << max_rel_err
       << " (tolerance " << options.element_tolerance << ")";
    return os.str();
  }
};

// All of x's elements, or the chosen ones.
inline std::vector<int64_t> selected_indices(const Tensor& x, const Options& o) {
  if (!o.indices.empty()) return o.indices;
  std::vector<int64_t> all(static_cast<size_t>(x.numel()));
  for (int64_t i = 0; i < x.numel(); ++i) all[static_cast<size_t>(i)] = i;
  return all;
}

// d loss / d x_i by central differences for every selected i; x must be an f64 host tensor and
// loss() must recompute everything from x. x is restored exactly after each element.
inline std::vector<double> numeric_gradient(Tensor& x, const std::function<double()>& loss,
                                            const Options& o = {}) {
  HP_CHECK(x.defined() && x.dtype() == DType::kF64 && x.device() == Device::kCPU,
           "numeric_gradient needs an f64 cpu tensor, got ", x.desc());
  double* p = x.data<double>();
  std::vector<double> g;
  for (int64_t i : selected_indices(x, o)) {
    HP_CHECK(i >= 0 && i < x.numel(), "numeric_gradient: index ", i, " outside ", x.desc());
    const double x0 = p[i];
    const double h = o.step * std::max(1.0, std::fabs(x0));
    p[i] = x0 + h;
    const double up = loss();
    p[i] = x0 - h;
    const double down = loss();
    p[i] = x0;
    g.push_back((up - down) / (2.0 * h));
  }
  return g;
}

// Compares analytic and numeric values at the same positions; `index` names the positions (for
// the report) and may be empty.
inline Result compare(const std::vector<double>& analytic, const std::vector<double>& numeric,
                      const std::vector<int64_t>& index, const Options& o = {}) {
  HP_CHECK(analytic.size() == numeric.size(), "grad_check::compare: ", analytic.size(),
           " analytic vs ", numeric.size(), " numeric values");
  Result r;
  r.options = o;
  r.checked = static_cast<int64_t>(analytic.size());
  double diff2 = 0, a2 = 0, n2 = 0, largest = 0;
  for (size_t i = 0; i < analytic.size(); ++i) {
    const double d = analytic[i] - numeric[i];
    diff2 += d * d;
    a2 += analytic[i] * analytic[i];
    n2 += numeric[i] * numeric[i];
    largest = std::max({largest, std::fabs(analytic[i]), std::fabs(numeric[i])});
  }
  r.analytic_norm = std::sqrt(a2);
  r.numeric_norm = std::sqrt(n2);
  const double denom = std::max(r.analytic_norm, r.numeric_norm);
  r.norm_rel_err = denom > 0 ? std::sqrt(diff2) / denom : 0.0;
  const double floor = o.floor_scale * largest + 1e-300;
  for (size_t i = 0; i < analytic.size(); ++i) {
    const double e = std::fabs(analytic[i] - numeric[i]) /
                     std::max({std::fabs(analytic[i]), std::fabs(numeric[i]), floor});
    if (e > r.max_rel_err || r.worst < 0) {
      r.max_rel_err = e;
      r.worst = index.empty() ? static_cast<int64_t>(i) : index[i];
      r.worst_analytic = analytic[i];
      r.worst_numeric = numeric[i];
    }
  }
  return r;
}

// The analytic gradient tensor (host memory, any float dtype, numel of x) against central
// differences of loss() with respect to x.
inline Result check(Tensor& x, const Tensor& analytic_grad, const std::function<double()>& loss,
                    const Options& o = {}) {
  HP_CHECK(analytic_grad.numel() == x.numel(), "grad_check::check: gradient ", analytic_grad.desc(),
           " does not match ", x.desc());
  const std::vector<double> all = to_double_vector(analytic_grad);
  const std::vector<int64_t> idx = selected_indices(x, o);
  std::vector<double> analytic;
  analytic.reserve(idx.size());
  for (int64_t i : idx) analytic.push_back(all[static_cast<size_t>(i)]);
  const std::vector<double> numeric = numeric_gradient(x, loss, o);
  return compare(analytic, numeric, idx, o);
}

// Passes when both the norm-based and the per-element errors are within their tolerances and
// the gradient is not identically zero (which would make the check vacuous).
inline ::testing::AssertionResult passes(const Result& r, const std::string& what) {
  if (r.numeric_norm == 0 && r.analytic_norm == 0) {
    return ::testing::AssertionFailure() << what << ": the gradient is all zeros; the check is "
                                         << "vacuous (" << r.summary() << ")";
  }
  if (r.norm_rel_err > r.options.tolerance || r.max_rel_err > r.options.element_tolerance) {
    return ::testing::AssertionFailure() << what << ": " << r.summary();
  }
  return ::testing::AssertionSuccess() << what << ": " << r.summary();
}

// sum_i out_i * r_i over two host tensors of float dtypes: the scalar loss L = <out, R> whose
// gradient with respect to out is R.
inline double weighted_sum(const Tensor& out, const Tensor& r) {
  HP_CHECK(out.numel() == r.numel(), "weighted_sum: ", out.desc(), " vs ", r.desc());
  const std::vector<double> a = to_double_vector(out);
  const std::vector<double> b = to_double_vector(r);
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace hp::grad_check
