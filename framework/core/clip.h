// Global-norm gradient clipping, shared by the host (the trainer's decision and log line) and
// the device (Backend::update_gate), bit for bit: plain IEEE double arithmetic, no expression a
// compiler may contract into a fused multiply-add.
#pragma once

#include "framework/core/host_device.h"

namespace hp {

// The clipping coefficient min(1, clip / (norm + 1e-6)); 1 when clip <= 0 (no clipping).
HP_HD inline double clip_coefficient(double grad_norm, double clip) {
  if (clip <= 0) return 1.0;
  const double c = clip / (grad_norm + 1e-6);
  return c < 1.0 ? c : 1.0;
}

}  // namespace hp
