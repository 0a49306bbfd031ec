// Step profiling: where the time of a training step goes, by phase and by op family.
//
// Callers mark what they issue (PhaseScope in the trainer, FamilyScope in the model and
// optimizer); the backend attributes its device time to the marks that were current when each
// piece of work was issued. Marks cost a couple of stores when no profile is being collected,
// so they stay in the hot path permanently.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace hp {

class Backend;

enum class StepPhase : uint8_t { kForward, kLoss, kBackward, kGradSync, kOptimizer, kOther };
constexpr int kNumStepPhases = 6;

enum class OpFamily : uint8_t {
  kAttention,     // attention forward/backward kernels
  kDenseGemm,     // projections, dense FFN, unembedding
  kExpertGemm,    // per-expert FFN GEMMs and their bias/activation
  kRouting,       // router logits, top-k, histogram, sort, scan, permute, combine, exchange
  kElementwise,   // norms, RoPE, residual adds, fills, conversions
  kEmbedding,     // embedding lookup and its scatter-add backward
  kCrossEntropy,  // softmax cross-entropy over the vocabulary
  kOptimizer,     // AdamW, gradient norms, clipping
  kCopies,        // host<->device and device copies (offload, reloads, uploads)
  kComm,          // collectives (gradient reduction, token exchange)
  kOther,
};
constexpr int kNumOpFamilies = 11;

const char* step_phase_name(StepPhase p);
const char* op_family_name(OpFamily f);

// One profiled stretch (Backend::profile_begin .. profile_end). Times in milliseconds. Device
// backends measure device activity: wall runs from the start of the first recorded kernel, copy
// or fill to the end of the last, busy is the union of the intervals in which any of them ran, and
// each instant of busy time is split evenly among the work running then, so by_family and by_phase
// each sum to busy_ms, and busy_ms + idle_ms == wall_ms. The host backend (cpu) measures host time
// between marks: everything it issues runs on the calling thread, so busy == wall.
struct StepProfile {
  double wall_ms = 0;
  double busy_ms = 0;
  double idle_ms = 0;
  std::array<double, kNumStepPhases> by_phase{};
  std::array<double, kNumOpFamilies> by_family{};
  // Idle time split by what ended it: each gap goes to the phase and family of the work that
  // started next (the gap after the last piece of work to kOther). A gap before the expert GEMMs
  // is the host catching up after the routing sync, one before the optimizer the loss read.
  // Each sums to idle_ms; zero on the host backend.
  std::array<double, kNumStepPhases> idle_by_phase{};
  std::array<double, kNumOpFamilies> idle_by_family{};
  // Device time by kernel name (memsets by size class, copies as one), the largest first: the time
  // each ran (not split with concurrent work), and how many ran. Empty on the host backend.
  struct KernelTime {
    std::string name;
    double ms = 0;
    int64_t count = 0;
  };
  std::vector<KernelTime> top_kernels;
  // Idle time by the pair of device work around each gap (the last to finish before it, the
  // first to start after it), the largest first: where the device waits for the host. Phase
  // and family are those of the work after the gap. Empty on the host backend.
  struct IdleGap {
    std::string before, after;
    StepPhase phase = StepPhase::kOther;
    OpFamily family = OpFamily::kOther;
    double ms = 0;
    int64_t count = 0;
  };
  std::vector<IdleGap> idle_gaps;
  int64_t kernels = 0;         // device work items seen (0 on the host backend)
  int64_t device_mallocs = 0;  // device allocations that missed the backend's cache
  int64_t plans_built = 0;     // kernel plans built on the way (cuDNN graphs)
};

// Marks the phase of the step for everything issued until the scope ends (restores the previous
// phase then). The family resets to kOther at a phase change.
class PhaseScope {
 public:
  PhaseScope(Backend& be, StepPhase p);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  Backend& be_;
  StepPhase prev_phase_;
  OpFamily prev_family_;
};

// Marks the op family for everything issued until the scope ends.
class FamilyScope {
 public:
  FamilyScope(Backend& be, OpFamily f);
  ~FamilyScope();
  FamilyScope(const FamilyScope&) = delete;
  FamilyScope& operator=(const FamilyScope&) = delete;

 private:
  Backend& be_;
  OpFamily prev_;
};

}  // namespace hp
