#include "framework/backend/cuda/candidate_timer.h"

#include "framework/backend/cuda/cuda_check.h"

namespace hp::cuda {

CandidateTimer::~CandidateTimer() {
  for (auto* events : {&start_, &end_})
    for (cudaEvent_t ev : *events) cudaEventDestroy(ev);
}

void CandidateTimer::begin(cudaStream_t stream) {
  cudaEvent_t ev = nullptr;
  CUDA_CHECK(cudaEventCreate(&ev));
  start_.push_back(ev);
  CUDA_CHECK(cudaEventRecord(ev, stream));
}

void CandidateTimer::end(cudaStream_t stream) {
  cudaEvent_t ev = nullptr;
  CUDA_CHECK(cudaEventCreate(&ev));
  end_.push_back(ev);
  CUDA_CHECK(cudaEventRecord(ev, stream));
}

int CandidateTimer::fastest() const {
  if (end_.empty()) return -1;
  const cudaError_t q = cudaEventQuery(end_.back());
  if (q == cudaErrorNotReady) return -1;
  CUDA_CHECK(q);
  int best = 0;
  float best_ms = 0;
  for (size_t i = 0; i < end_.size(); ++i) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start_[i], end_[i]));
    if (i == 0 || ms < best_ms) {
      best_ms = ms;
      best = static_cast<int>(i);
    }
  }
  return best;
}

}  // namespace hp::cuda
