// Gradient synchronization: decides what is reduced over which group, and when.
//
// Dense parameters are replicated on every rank: their gradients are summed over the world.
// Expert parameters are split over ep: their gradients are summed over dp (the ranks holding the
// same experts). The loss gradient is already divided by the global count of valid targets, so
// sums (not means) give exactly the single-rank gradient. Reductions are launched per layer as
// backward completes it (Model::backward calls layer_ready: framework/model/grad_ready.h), in
// buckets of the layer's tensors.
//
// Streams: the device communicators of `groups` enqueue on one backend stream. On the compute
// stream (the default) stream order alone puts each reduction after the layer's backward and
// before the optimizer. On another stream (the comm stream, so that reductions overlap the
// backward of the layers below) events order the two: layer_ready records an event on compute
// and the comm stream waits for it before the layer's reductions; finish() makes compute wait
// for an event recorded on the comm stream after the last one. No host waits either way.
// Gradient tensors are persistent parameter buffers and no temporary memory is used on the comm
// stream, so the caching allocator (which reuses memory in compute-stream order) never hands
// out memory that a reduction still uses.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/model/grad_ready.h"
#include "framework/model/params.h"
#include "parallel/process_groups.h"

namespace hp {

class GradSync final : public GradReadyHook {
 public:
  // `stream`: the backend stream that the device communicators of `groups` enqueue on.
  GradSync(Backend& be, ParamRegistry& params, const ProcessGroups& groups,
           Backend::StreamKind stream = Backend::StreamKind::kCompute);
  // Orders compute after reductions still in flight (a step that ended in an exception), so
  // memory freed afterwards is not reused under them. Never throws.
  ~GradSync() override;
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // Reduces the gradients of layer `layer` (-1: embedding, final norm, unembedding). Call it
  // once the layer's gradients are complete in the compute stream's order.
  void layer_ready(int layer) override;
  // Reduces whatever has not been reduced yet this step and resets for the next step. Work
  // issued on the compute stream afterwards sees the reduced gradients.
  void finish();
  int64_t bytes_reduced() const { return bytes_; }
  Backend::StreamKind stream() const { return stream_; }

 private:
  // Reduces `ps` (gradients complete on compute): host round trips where the communicator is
  // not on the gradients' device, else device reductions on stream_, one launch per
  // communicator where that keeps the sums bitwise unchanged.
  void reduce(const std::vector<Param*>& ps);
  void reduce_via_host(Param& p, Communicator& comm);

  Backend& be_;
  ProcessGroups groups_;
  Backend::StreamKind stream_;
  std::map<int, std::vector<Param*>> by_layer_;
  std::vector<bool> done_;
  std::map<const Param*, size_t> index_;
  int64_t bytes_ = 0;
  bool in_flight_ = false;  // reductions on stream_ that compute has not been ordered after yet
};

}  // namespace hp
