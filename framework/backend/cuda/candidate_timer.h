// Candidates for one choice (cuBLASLt's algorithms for a GEMM bucket, cuDNN's plans for an
// attention graph) timed on a stream between events, without the host waiting: each candidate's
// runs are issued between its begin() and end(), and fastest() names the winner once the last
// end event has completed.
#pragma once

#include <cuda_runtime.h>

#include <vector>

namespace hp::cuda {

class CandidateTimer {
 public:
  CandidateTimer() = default;
  CandidateTimer(const CandidateTimer&) = delete;
  CandidateTimer& operator=(const CandidateTimer&) = delete;
  ~CandidateTimer();

  // Around the runs of the next candidate, on the stream they are issued to.
  void begin(cudaStream_t stream);
  void end(cudaStream_t stream);
  // Candidates begun and ended.
  size_t size() const { return end_.size(); }
  // The position (in begin order) of the candidate whose runs took least time, or -1 while the
  // last candidate's runs have not completed. Does not wait.
  int fastest() const;

 private:
  std::vector<cudaEvent_t> start_, end_;
};

}  // namespace hp::cuda
