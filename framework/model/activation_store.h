// The activation store: where each checkpointed block's input lives between forward and backward
// (docs/architecture.md, "Rule 2: the host link is shared fairly").
//
// Modes (config key `offload`):
//  - none:   block inputs stay on the device (recompute only).
//  - single: block inputs are offloaded to host memory in forward; one device staging buffer; the
//            reload of block i is issued when backward reaches it and the compute stream waits for
//            it (reload serialized with compute: the baseline).
//  - double: a ring of `buffers` >= 2 device staging buffers; while backward computes block i the
//            copy stream reloads blocks i-1 ... i-lookahead (lookahead <= buffers - 1).
// The last block's input stays on the device in every mode: its backward follows its forward
// directly, so there is nothing to overlap its reload with.
//
// Protocol, for one micro-batch with backward, on the thread that drives the backend:
//   begin_step(n); save(0, x0) ... save(n-1, x_{n-1}); load(n-1) ... load(0); end_step().
//  - save(i, x): x is block i's input, just written on the compute stream. The store keeps a
//    reference (and starts its device->host copy on the copy stream at once); the caller must
//    not write x afterwards and may drop its own reference.
//  - load(i): block i's input on the device, readable by compute-stream work issued after the
//    call until the next load() or end_step(); after that the store may overwrite it, so the
//    caller must issue no further work reading it.
//
// Streams: the store orders the copy stream against the compute stream with events only. It
// never synchronizes the device; a host wait happens only in the pageable fallback (a
// device->host copy into pageable memory blocks the host on the GPU) and counts one sync of cause
// offload. Device memory the copy stream touches is either held by the store or ordered after the
// compute stream with an event, so the caching allocator's stream-ordered reuse stays safe.
//
// Host link: offloads go over it as CopyDirection::kOffload copies, reloads as kReload
// (Backend::copy_over_link), so a link arbiter attached to the backend (Backend::set_link_arbiter,
// the node link arbiter of parallel/link_arbiter.h) grants them chunk by chunk, reloads first,
// without the store or its host thread waiting for grants.
//
// Memory: host copies go to one host pool (pinned on the GPU) allocated at the first step, sized
// (n - 1) x the block input unless `pinned_pool_bytes` fixes it; the staging ring is allocated
// then too, each buffer the size of a block input unless `staging_bytes` fixes it. Fallbacks,
// each with a one-time warning stating the sizes: a block that does not fit the pool goes to
// pageable host memory; a block larger than a staging buffer is reloaded in staging-sized chunks
// into a fresh device tensor.
// Thread safety: none; one host thread drives a store and its backend.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "framework/backend/backend.h"

namespace hp {

enum class OffloadMode { kNone, kSingle, kDouble };

// "none" | "single" | "double"; throws a config error naming key `offload` otherwise.
OffloadMode parse_offload_mode(const std::string& s);
const char* offload_mode_name(OffloadMode m);

struct OffloadOptions {
  OffloadMode mode = OffloadMode::kNone;
  int buffers = 2;           // double: staging buffers in the ring (>= 2)
  int lookahead = 1;         // double: blocks reloaded ahead of the one computing (1..buffers-1)
  double sim_link_gbps = 0;  // simulated host link for backends that simulate one (0: off)
  int64_t pinned_pool_bytes = 0;  // 0: sized from the model and batch at the first step
  int64_t staging_bytes = 0;      // 0: one block input per staging buffer
  // Debug: fill every device copy the store lets go of (offloaded block inputs after their copy,
  // staging buffers after their block's backward) with NaN, so a reload ordered too early shows.
  bool poison_released = false;

  // Throws a config error naming the offending key.
  void validate() const;
};

// Per step (reset by begin_step), except the capacities.
struct OffloadStats {
  int64_t d2h_bytes = 0;
  int64_t h2d_bytes = 0;
  int64_t offloaded_blocks = 0;
  int64_t pageable_blocks = 0;    // host copies outside the pinned pool (fallback)
  int64_t chunked_blocks = 0;     // reloads larger than a staging buffer (fallback)
  int64_t resident_bytes = 0;     // block inputs kept on the device through the step
  int64_t pinned_pool_bytes = 0;  // capacity
  int64_t staging_bytes = 0;      // capacity of the whole ring on the device
};

class ActivationStore {
 public:
  virtual ~ActivationStore() = default;
  virtual void begin_step(int n_blocks) = 0;
  virtual void save(int block, const Tensor& x) = 0;
  virtual Tensor load(int block) = 0;
  virtual void end_step() = 0;
  virtual const OffloadStats& stats() const = 0;
  virtual OffloadMode mode() const = 0;
};

// The store of `opts.mode` on `be` (which must outlive it). A store that offloads applies
// opts.sim_link_gbps to `be`.
std::unique_ptr<ActivationStore> make_activation_store(Backend& be, const OffloadOptions& opts);

}  // namespace hp
