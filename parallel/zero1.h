// Sharded optimizer state (optimizer_sharding=zero1, ZeRO stage 1).
//
// Every rank keeps the whole working copy and the whole gradient of the parameters it computes
// with, but the fp32 master and both AdamW moments only for its shard: dense parameters are
// sharded over the world, expert parameters over their dp group (the ranks holding the same
// experts). A shard is a block of leading-axis rows of the local tensor: rank g of a group of d
// holds rows [g*R/d, (g+1)*R/d). A tensor whose leading dimension R is not a multiple of d stays
// replicated (every rank of the group holds and updates all of it, identically); the layouts
// tested shard every tensor.
//
// One step:
//  - backward: GradSync reduce-scatters each sharded gradient into grad_shard() (rank g receives
//    the sum of rows g, folded in rank order), all-reduces the replicated ones.
//  - partitioned_grad_sum_squares: this rank's part of the global sums of squares (its shard
//    rows; a replicated tensor on group rank 0 only), summed over the world by the caller.
//  - step: AdamW on the shard (master, m, v, grad_shard), writing the updated rows of the working
//    copy, then all-gathers the working copies over the shard groups on the reduction stream.
//  - the next forward: as the model is about to read a layer's weights (layer_needed, the
//    model's ParamReadyHook), compute waits for an event recorded after that layer's
//    all-gathers, so the later layers' gathers overlap the forward of the earlier ones; the
//    gathers are issued in the order forward needs them (-1: embedding, final norm, unembedding;
//    then 0, 1, ...). No host sync.
//
// Streams: as GradSync's; device communicators enqueue on `stream`, events order it against
// compute. Host communicators (the cpu backend) block, in parameter order.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/model/grad_ready.h"
#include "framework/model/params.h"
#include "parallel/process_groups.h"

namespace hp {

// Bytes of fp32 masters and AdamW moments (master, m, v) this rank holds, by parameter group,
// counted from the tensors' allocations (a master that is a shard counts its rows only).
struct OptimizerStateBytes {
  int64_t dense = 0;
  int64_t expert = 0;
  int64_t total() const { return dense + expert; }
};
OptimizerStateBytes optimizer_state_bytes(const ParamRegistry& params);

class Zero1;

// The zero1 partition of p's leading axis over `comm` (p's group: world for dense parameters,
// dp for experts): the rows [begin, begin + rows) that comm->rank() owns. rows < 0 where p is
// not partitioned (no group, a group of one rank, or rows not a multiple of the group size).
struct ShardRows {
  int64_t begin = 0;
  int64_t rows = -1;
  bool partitioned() const { return rows >= 0; }
};
ShardRows shard_rows(const Param& p, const Communicator* comm);

// acc[2] = {dense, expert}: this rank's part of the global sums of squared gradients, taken over
// the zero1 partition whether or not the state is sharded: the owned rows of each partitioned
// gradient (zero1: its reduced shard; none: those rows of the all-reduced gradient), a
// non-partitioned one by its group's rank 0 only. The global sums are acc summed over the world
// (rank order), so both settings fold the same numbers in the same order. Master dtype, on the
// device, no sync. `zero1` may be null.
void partitioned_grad_sum_squares(Backend& be, ParamRegistry& params, const ProcessGroups& groups,
                                  Zero1* zero1, Tensor& acc);

class Zero1 final : public ParamReadyHook {
 public:
  // Shards `params` (call after init: the masters' rows are copied, the full masters released,
  // the moments reallocated as zeros of the shard's rows). `groups`: the communicators of the
  // gradient reductions (those GradSync uses), on `stream`.
  Zero1(Backend& be, ParamRegistry& params, const ProcessGroups& groups,
        Backend::StreamKind stream = Backend::StreamKind::kCompute);
  ~Zero1() override;
  Zero1(const Zero1&) = delete;
  Zero1& operator=(const Zero1&) = delete;

  // The communicator p's state is sharded over (null or size 1: not sharded).
  Communicator* group_of(const Param& p) const;
  // The reduced gradient rows of a sharded parameter (what GradSync's reduce-scatter fills).
  Tensor& grad_shard(const Param& p);
  // Null where p is not sharded.
  Tensor* find_grad_shard(const Param& p);
  // The optimizer's update of one parameter's rows: p.master, p.m and p.v with the reduced
  // gradient `grad` of the same rows; `working`, when defined, receives the updated master in
  // the working dtype.
  using Update = std::function<void(Param& p, const Tensor& grad, Tensor& working)>;
  // Updates every parameter (this rank's rows of the sharded ones), then issues the all-gathers
  // of the updated working copies.
  void step(const Update& update);
  // All-gathers every sharded parameter's working copy from the rows each rank holds (after
  // step(), or after a checkpoint load has refreshed this rank's rows).
  void gather_params();
  // Orders compute after the all-gathers of `layer`'s parameters (Model::forward calls it).
  void layer_needed(int layer) override;
  // Orders compute after every all-gather in flight.
  void wait_params();

  int sharded_count() const { return static_cast<int>(slots_.size()); }

 private:
  struct Slot {
    Param* p = nullptr;
    Communicator* comm = nullptr;
    Tensor grad;  // the reduced rows of the gradient
    Tensor work;  // updated rows in the working dtype: the all-gather's input
  };
  Slot* slot(const Param& p);
  void gather(Slot& s);

  Backend& be_;
  ParamRegistry& params_;
  ProcessGroups groups_;
  Backend::StreamKind stream_;
  std::vector<Slot> slots_;  // in gather order: by layer (-1 first), then parameter order
  std::map<const Param*, size_t> index_;
  // Layers whose all-gathers compute has not been ordered after yet, with the event recorded
  // on stream_ after them (comm stream only; host communicators have finished on return).
  std::map<int, std::shared_ptr<Backend::Event>> pending_;
};

}  // namespace hp
