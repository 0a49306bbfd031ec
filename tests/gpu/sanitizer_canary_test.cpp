// Sanitizer canaries: one defective kernel per compute-sanitizer tool (sanitizer_canary.cu).
// Disabled: they exist to be run under their tool by the gpu.sanitize.<tool>.canary cases
// (tests/gpu/sanitize.sh), which pass only when the tool reports the defect, proving that the
// tool and its kernel filter see hotpath's kernels.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>

namespace hp::cuda {
bool run_sanitizer_canary(const char* tool);
}

namespace hp {
namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

class SanitizerCanary : public ::testing::TestWithParam<const char*> {};

TEST_P(SanitizerCanary, DISABLED_Defect) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests run on the GPU machine";
  EXPECT_TRUE(cuda::run_sanitizer_canary(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Tool, SanitizerCanary,
                         ::testing::Values("memcheck", "racecheck", "initcheck", "synccheck"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace hp
