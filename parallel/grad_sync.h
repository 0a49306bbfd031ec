// Gradient synchronization: decides what is reduced over which group, and when.
//
// Dense parameters are replicated on every rank: their gradients are summed over the world.
// Expert parameters are split over ep: their gradients are summed over dp (the ranks holding the
// same experts). The loss gradient is already divided by the global count of valid targets, so
// sums (not means) give exactly the single-rank gradient. Reductions are launched per layer as
// backward completes it (Model's grad-ready hook), in buckets of the layer's tensors.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/model/params.h"
#include "parallel/process_groups.h"

namespace hp {

class GradSync {
 public:
  GradSync(Backend& be, ParamRegistry& params, const ProcessGroups& groups);
  // Reduces the gradients of layer `layer` (-1: embedding, final norm, unembedding).
  void layer_ready(int layer);
  // Reduces whatever has not been reduced yet this step and resets for the next step.
  void finish();
  int64_t bytes_reduced() const { return bytes_; }

 private:
  void reduce(Param& p);

  Backend& be_;
  ProcessGroups groups_;
  std::map<int, std::vector<Param*>> by_layer_;
  std::vector<bool> done_;
  std::map<const Param*, size_t> index_;
  int64_t bytes_ = 0;
};

}  // namespace hp
