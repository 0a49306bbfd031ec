#include "framework/backend/profile.h"

#include <chrono>

#include "framework/backend/backend.h"

namespace hp {

namespace {
double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

const char* step_phase_name(StepPhase p) {
  switch (p) {
    case StepPhase::kForward:
      return "forward";
    case StepPhase::kLoss:
      return "loss";
    case StepPhase::kBackward:
      return "backward";
    case StepPhase::kGradSync:
      return "grad_sync";
    case StepPhase::kOptimizer:
      return "optimizer";
    case StepPhase::kOther:
      return "other";
  }
  return "?";
}

const char* op_family_name(OpFamily f) {
  switch (f) {
    case OpFamily::kAttention:
      return "attention";
    case OpFamily::kDenseGemm:
      return "dense_gemm";
    case OpFamily::kExpertGemm:
      return "expert_gemm";
    case OpFamily::kRouting:
      return "routing";
    case OpFamily::kElementwise:
      return "norms_elementwise";
    case OpFamily::kEmbedding:
      return "embedding";
    case OpFamily::kCrossEntropy:
      return "cross_entropy";
    case OpFamily::kOptimizer:
      return "optimizer";
    case OpFamily::kCopies:
      return "copies";
    case OpFamily::kComm:
      return "comm";
    case OpFamily::kOther:
      return "other";
  }
  return "?";
}

PhaseScope::PhaseScope(Backend& be, StepPhase p)
    : be_(be), prev_phase_(be.phase()), prev_family_(be.op_family()) {
  be_.mark(p, OpFamily::kOther);
}
PhaseScope::~PhaseScope() { be_.mark(prev_phase_, prev_family_); }

FamilyScope::FamilyScope(Backend& be, OpFamily f) : be_(be), prev_(be.op_family()) {
  be_.mark(be.phase(), f);
}
FamilyScope::~FamilyScope() { be_.mark(be_.phase(), prev_); }

void Backend::profile_begin() {
  synchronize(SyncCause::kOther);
  host_profile_ = StepProfile();
  host_t0_ = host_last_ = now_ms();
  profiling_ = true;
}

void Backend::on_mark(StepPhase phase, OpFamily family) {
  const double t = now_ms();
  host_profile_.by_phase[static_cast<int>(phase)] += t - host_last_;
  host_profile_.by_family[static_cast<int>(family)] += t - host_last_;
  host_last_ = t;
}

StepProfile Backend::profile_end() {
  synchronize(SyncCause::kOther);
  on_mark(phase_, family_);
  profiling_ = false;
  StepProfile p = host_profile_;
  p.wall_ms = host_last_ - host_t0_;
  p.busy_ms = p.wall_ms;
  p.idle_ms = 0;
  return p;
}

}  // namespace hp
