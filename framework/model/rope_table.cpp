#include "framework/model/rope_table.h"

#include <algorithm>
#include <cmath>

namespace hp {
namespace {

constexpr double kPi = 3.14159265358979323846;

// The (fractional) pair index i whose wavelength 2*pi/inv_freq_i completes `rotations` full turns
// over the original context L: L * theta^(-2i/D) = 2*pi*rotations, solved for i.
double correction_dim(double rotations, int head_dim, double theta, double original_len) {
  return head_dim * std::log(original_len / (rotations * 2.0 * kPi)) / (2.0 * std::log(theta));
}

void store(const Tensor& t, int64_t i, double v) {
  switch (t.dtype()) {
    case DType::kF32:
      t.data<float>()[i] = static_cast<float>(v);
      break;
    case DType::kF64:
      t.data<double>()[i] = v;
      break;
    default:
      HP_CHECK(false, "make_rope_table: master dtype of ", t.desc(), " is not f32/f64");
  }
}

}  // namespace

// YaRN ("yet another RoPE extension"): the base frequency of pair i is f_i = theta^(-2i/D).
// Pairs that turn many times over the original context (high frequency, small i) encode local
// order and keep f_i unchanged (extrapolation); pairs that turn less than about once encode
// absolute position and are slowed down to f_i / factor (interpolation), so positions up to
// factor * L map into angles the model saw during training. In between, the two are blended with
// a linear ramp over the pair index: ramp(i) = clamp((i - lo) / (hi - lo), 0, 1), where lo is the
// index whose wavelength fits beta_fast times into L and hi the one that fits beta_slow times;
// f'_i = f_i / factor * ramp(i) + f_i * (1 - ramp(i)). Stretching the context flattens the
// softmax; the attention factor mscale = 0.1 ln(factor) + 1 sharpens it back. It multiplies both
// cos and sin, so q.k of two rotated vectors carries mscale^2, as the reference implementations do.
std::vector<double> rope_inv_freq(int head_dim, double theta, const YarnParams& yarn) {
  HP_CHECK(head_dim > 0 && head_dim % 2 == 0 && theta > 1, "rope: head_dim ", head_dim,
           " must be even and positive and theta ", theta, " > 1");
  const int half = head_dim / 2;
  std::vector<double> inv(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) inv[i] = std::pow(theta, -2.0 * i / head_dim);
  if (yarn.factor <= 1.0) return inv;

  HP_CHECK(yarn.original_max_positions > 0 && yarn.beta_fast > 0 && yarn.beta_slow > 0,
           "rope: YaRN needs positive original_max_positions, beta_fast and beta_slow");
  double lo = correction_dim(yarn.beta_fast, head_dim, theta, yarn.original_max_positions);
  double hi = correction_dim(yarn.beta_slow, head_dim, theta, yarn.original_max_positions);
  if (yarn.truncate) {
    lo = std::floor(lo);
    hi = std::ceil(hi);
  }
  lo = std::max(lo, 0.0);
  hi = std::min(hi, static_cast<double>(head_dim - 1));
  if (hi == lo) hi += 1e-3;  // a step instead of a division by zero
  for (int i = 0; i < half; ++i) {
    const double ramp = std::clamp((i - lo) / (hi - lo), 0.0, 1.0);
    inv[i] = inv[i] / yarn.factor * ramp + inv[i] * (1.0 - ramp);
  }
  return inv;
}

double rope_attention_factor(const YarnParams& yarn) {
  return yarn.factor <= 1.0 ? 1.0 : 0.1 * std::log(yarn.factor) + 1.0;
}

RopeTable make_rope_table(Backend& be, int head_dim, int64_t max_positions, double theta,
                          const YarnParams& yarn) {
  HP_CHECK(max_positions > 0, "make_rope_table: max_positions ", max_positions,
           " must be positive");
  const std::vector<double> inv = rope_inv_freq(head_dim, theta, yarn);
  const double mscale = rope_attention_factor(yarn);
  const int64_t half = head_dim / 2;
  Tensor cos_host = Tensor::host({max_positions, half}, be.master_dtype());
  Tensor sin_host = Tensor::host({max_positions, half}, be.master_dtype());
  for (int64_t p = 0; p < max_positions; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(p) * inv[i];
      store(cos_host, p * half + i, std::cos(angle) * mscale);
      store(sin_host, p * half + i, std::sin(angle) * mscale);
    }
  }
  RopeTable table;
  table.cos = be.upload(cos_host);
  table.sin = be.upload(sin_host);
  return table;
}

}  // namespace hp
