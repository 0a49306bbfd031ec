// RoPE cos/sin tables (half-split convention) with optional YaRN context extension.
#pragma once

#include <cstdint>
#include <vector>

#include "framework/backend/backend.h"

namespace hp {

// YaRN scaling of the rotary frequencies; factor <= 1 turns it off.
struct YarnParams {
  double factor = 1.0;
  double original_max_positions = 4096;  // context length the frequencies were trained for
  double beta_fast = 32;                 // rotations over that context above which: extrapolate
  double beta_slow = 1;                  // rotations below which: interpolate
  // Round the ramp's ends outward to whole dimensions (the common "yarn" default); GPT-OSS keeps
  // them fractional.
  bool truncate = false;
};

// Inverse frequencies of the head_dim/2 rotation pairs, YaRN applied.
std::vector<double> rope_inv_freq(int head_dim, double theta, const YarnParams& yarn);
// YaRN's attention factor (1 without YaRN), folded into both cos and sin.
double rope_attention_factor(const YarnParams& yarn);

// cos/sin [max_positions, head_dim/2] in be.master_dtype(), built on the host and uploaded.
RopeTable make_rope_table(Backend& be, int head_dim, int64_t max_positions, double theta,
                          const YarnParams& yarn = {});

}  // namespace hp
