// The boundary between backward and gradient reduction: backward says when a layer's gradients
// are complete, the implementation (parallel/grad_sync.h) decides what to reduce and when.
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

}  // namespace hp
