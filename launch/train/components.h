// The pieces a run is built from, made from its options: the backend (the data loader's and the
// model's configs are make_data_config and make_model_options, launch/options.h); and the FLOP
// count MFU is quoted from.
#pragma once

#include <memory>

#include "framework/backend/backend.h"
#include "framework/data/loader.h"
#include "framework/model/model.h"
#include "launch/options.h"

namespace hp {

// Picks the backend for options.device ("auto": CUDA when a GPU is present).
std::unique_ptr<Backend> make_backend(const TrainOptions& o, int local_rank);

// Total memory of the GPU this rank would use (0: CPU backend or no GPU visible).
int64_t visible_device_bytes(const TrainOptions& o, int local_rank);

// Training FLOPs of one step on this batch's documents: 6 * N_active * document tokens plus the
// attention score and value products of the document pieces, forward and backward (3x). The
// padding's work is not counted (docs/benchmarks.md, "What is counted").
double step_model_flops(const ModelConfig& c, const PackedBatch& batch);
// Dense bf16 peak of the H100/H200 that MFU is quoted against.
constexpr double kPeakBf16Flops = 989e12;

}  // namespace hp
