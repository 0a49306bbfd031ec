// The gradient sums of squares of grad_sum_squares (optim/adamw.h), taken layer by layer while
// backward runs: a GradReadyHook that squares each layer's gradients as soon as backward has
// completed them, on a stream of their own, so that the passes over the gradients overlap the
// backward of the layers below instead of following it. finish() adds the partial sums up once,
// in grad_sum_squares's order: the same bits (Backend::sum_squares_partials).
//
// One rank only: with several ranks the gradients are reduced after backward completes them, and
// the norm folds each rank's part of the reduced rows (parallel/zero1.h). No temporary memory is
// used on the side stream (the partial sums live in buffers of this object and the gradients are
// persistent), so the caching allocator never hands out memory that the squares still read.
#pragma once

#include <map>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/model/grad_ready.h"
#include "framework/model/params.h"

namespace hp {

class LayerGradSquares final : public GradReadyHook {
 public:
  // `stream`: where the squares run (kComm on one rank, where it carries nothing else; kCompute
  // gives the same bits without the overlap).
  LayerGradSquares(Backend& be, ParamRegistry& params, Backend::StreamKind stream);
  // Orders compute after squares still in flight (a step that ended in an exception). Never
  // throws.
  ~LayerGradSquares() override;
  LayerGradSquares(const LayerGradSquares&) = delete;
  LayerGradSquares& operator=(const LayerGradSquares&) = delete;

  // Squares the gradients of `layer` (-1: embedding, final norm, unembedding). Call it once the
  // layer's gradients are complete in the compute stream's order (Model::backward does).
  void layer_ready(int layer) override;
  // Squares what has not been squared yet this step, then writes acc[2] = {dense, expert} sums
  // (master dtype, on the device) on the compute stream, which waits for the squares first; the
  // bits of grad_sum_squares(be, params, acc). Resets for the next step.
  void finish(Tensor& acc);

 private:
  struct Entry {
    Param* param;
    int group;       // 0 dense, 1 expert
    int64_t offset;  // of its first partial sum in partials_[group]
    int64_t slots;
  };
  // Issues the squares of `entries` (each not done yet) on stream_, one call per run of
  // adjacent partial sums.
  void square(const std::vector<const Entry*>& entries);

  Backend& be_;
  Backend::StreamKind stream_;
  std::vector<Entry> entries_;  // in params.all() order
  std::map<int, std::vector<size_t>> by_layer_;
  std::vector<bool> done_;
  Tensor partials_[2];
  bool in_flight_ = false;
};

}  // namespace hp
