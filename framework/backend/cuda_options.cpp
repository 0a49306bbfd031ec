#include "framework/backend/cuda_options.h"

#include "framework/core/error.h"

namespace hp {

AttentionImpl parse_attention_impl(const std::string& s) {
  if (s == "auto") return AttentionImpl::kAuto;
  if (s == "cudnn") return AttentionImpl::kCudnn;
  if (s == "tiled") return AttentionImpl::kTiled;
  HP_USER_ERROR(ErrorKind::kConfig, "config key 'attention': must be auto, cudnn or tiled, got '",
                s, "'");
}

const char* attention_impl_name(AttentionImpl a) {
  return a == AttentionImpl::kCudnn ? "cudnn" : a == AttentionImpl::kTiled ? "tiled" : "auto";
}

ExpertGemmImpl parse_expert_gemm_impl(const std::string& s) {
  if (s == "serial") return ExpertGemmImpl::kSerial;
  if (s == "streams") return ExpertGemmImpl::kStreams;
  if (s == "grouped") return ExpertGemmImpl::kGrouped;
  HP_USER_ERROR(ErrorKind::kConfig,
                "config key 'expert_gemm': must be serial, streams or grouped, got '", s, "'");
}

const char* expert_gemm_impl_name(ExpertGemmImpl e) {
  return e == ExpertGemmImpl::kSerial    ? "serial"
         : e == ExpertGemmImpl::kGrouped ? "grouped"
                                         : "streams";
}

}  // namespace hp
