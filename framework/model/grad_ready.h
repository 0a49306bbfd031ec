// The boundaries between the model and the collectives around it: backward says when a layer's
// gradients are complete, the implementation (parallel/grad_sync.h) decides what to reduce and
// when; forward says when it is about to read a layer's weights (parallel/zero1.h).
#pragma once

namespace hp {

// Told by Model::backward() when a layer's parameter gradients are complete (in the compute
// stream's order), so that their reduction can start while backward continues with the layers
// below. Called on the thread that drives the compute stream; must not block on the device.
class GradReadyHook {
 public:
  virtual ~GradReadyHook() = default;
  // `layer`: n_layers-1 down to 0, then -1 for the embedding, final norm and unembedding.
  virtual void layer_ready(int layer) = 0;
};

// Told by Model::forward() before it reads a layer's working weights, so that weights still
// being gathered (sharded optimizer state, parallel/zero1.h) are waited for one layer at a time
// and the rest of the gathers overlap the forward of the layers before. Called on the thread
// that drives the compute stream; must not block on the host.
class ParamReadyHook {
 public:
  virtual ~ParamReadyHook() = default;
  // `layer`: -1 first (embedding, final norm, unembedding), then 0 .. n_layers-1.
  virtual void layer_needed(int layer) = 0;
};

}  // namespace hp
