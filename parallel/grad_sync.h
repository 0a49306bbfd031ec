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
//
// With a Zero1 (optimizer_sharding=zero1) a sharded parameter's gradient is reduce-scattered
// into its shard (Zero1::grad_shard) instead of all-reduced; the sums are the same bits.
//
// Wire dtype bf16 (grad_reduce_dtype=bf16): each rank's gradient is rounded to bf16, the bf16
// chunks are exchanged (all_to_all_v), and each rank sums the chunk it reduces in fp32, in rank
// order; an all-reduce then sends the fp32 sums back rounded to bf16 again, so every rank holds
// the same bits (the owner of a chunk too). The scratch buffers this needs are persistent and
// used only on the reduction stream, in its order.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/model/grad_ready.h"
#include "framework/model/params.h"
#include "parallel/process_groups.h"
#include "parallel/zero1.h"

namespace hp {

class GradSync final : public GradReadyHook {
 public:
  // `stream`: the backend stream that the device communicators of `groups` enqueue on.
  // `zero1`: the sharded optimizer state whose shards receive reduce-scattered gradients (null:
  // every gradient is all-reduced); it must outlive this object. `wire`: kF32 (the gradients'
  // own dtype) or kBF16.
  GradSync(Backend& be, ParamRegistry& params, const ProcessGroups& groups,
           Backend::StreamKind stream = Backend::StreamKind::kCompute, Zero1* zero1 = nullptr,
           DType wire = DType::kF32);
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
  Backend::StreamKind stream() const { return stream_; }

 private:
  // Reduces `ps` (gradients complete on compute): host round trips where the communicator is
  // not on the gradients' device, else device reductions on stream_, one launch per
  // communicator where that keeps the sums bitwise unchanged.
  void reduce(const std::vector<Param*>& ps);
  void reduce_via_host(Param& p, Communicator& comm, Tensor* shard);
  // One gradient: all-reduced in place, or reduce-scattered into `shard` when given.
  void reduce_one(Param& p, Communicator& comm, Tensor* shard);
  // bf16 on the wire, fp32 sums (see the top of this file); on the current backend stream.
  void wire_reduce_scatter(Communicator& comm, const Tensor& in, Tensor& out);
  void wire_all_reduce(Communicator& comm, Tensor& t);

  Backend& be_;
  ProcessGroups groups_;
  Backend::StreamKind stream_;
  std::map<int, std::vector<Param*>> by_layer_;
  std::vector<bool> done_;
  std::map<const Param*, size_t> index_;
  Zero1* zero1_ = nullptr;
  DType wire_ = DType::kF32;
  Tensor wire_send_, wire_recv_;  // bf16 scratch
  Tensor sum_, part_;             // gradient-dtype scratch of the bf16 wire
  bool in_flight_ = false;  // reductions on stream_ that compute has not been ordered after yet
};

}  // namespace hp
