#include "framework/model/activation_store.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "framework/backend/link_arbiter.h"
#include "framework/core/log.h"

namespace hp {

OffloadMode parse_offload_mode(const std::string& s) {
  if (s == "none") return OffloadMode::kNone;
  if (s == "single") return OffloadMode::kSingle;
  if (s == "double") return OffloadMode::kDouble;
  HP_USER_ERROR(ErrorKind::kConfig, "config key 'offload': must be none, single or double, got '",
                s, "'");
}

const char* offload_mode_name(OffloadMode m) {
  switch (m) {
    case OffloadMode::kNone:
      return "none";
    case OffloadMode::kSingle:
      return "single";
    case OffloadMode::kDouble:
      return "double";
  }
  return "?";
}

void OffloadOptions::validate() const {
  if (buffers < 2)
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'offload_buffers': must be >= 2, got ", buffers);
  if (lookahead < 1 || lookahead > buffers - 1)
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'offload_lookahead': must be in [1, ",
                  "offload_buffers - 1 = ", buffers - 1, "], got ", lookahead);
  if (!(sim_link_gbps >= 0))
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'sim_link_gbps': must be >= 0, got ",
                  sim_link_gbps);
  if (pinned_pool_bytes < 0)
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'pinned_pool_mib': must be >= 0, got ",
                  pinned_pool_bytes, " bytes");
  if (staging_bytes < 0)
    HP_USER_ERROR(ErrorKind::kConfig, "offload staging_bytes must be >= 0, got ", staging_bytes);
}

namespace {

using SK = Backend::StreamKind;
constexpr size_t kHostAlign = 256;  // host pool slices start on this boundary

// "N bytes (M MiB)" for warnings.
std::string size_str(int64_t bytes) {
  return str_cat(bytes, " bytes (", static_cast<double>(bytes) / (1 << 20), " MiB)");
}

// offload=none: the device keeps every block input, as without a store.
class DeviceStore final : public ActivationStore {
 public:
  void begin_step(int n_blocks) override {
    blocks_.assign(static_cast<size_t>(n_blocks), Tensor());
    stats_.resident_bytes = 0;
  }
  void save(int i, const Tensor& x) override {
    blocks_.at(static_cast<size_t>(i)) = x;
    stats_.resident_bytes += static_cast<int64_t>(x.nbytes());
  }
  Tensor load(int i) override {
    Tensor x = std::move(blocks_.at(static_cast<size_t>(i)));
    HP_CHECK(x.defined(), "activation store: block ", i, " was not saved or loaded twice");
    return x;
  }
  void end_step() override { blocks_.clear(); }
  const OffloadStats& stats() const override { return stats_; }
  OffloadMode mode() const override { return OffloadMode::kNone; }

 private:
  std::vector<Tensor> blocks_;
  OffloadStats stats_;
};

// offload=single and offload=double: one implementation, a ring of K staging buffers with
// lookahead L; single is K = 1, L = 0 (the reload is issued when backward needs it).
class OffloadStore final : public ActivationStore {
 public:
  OffloadStore(Backend& be, const OffloadOptions& o)
      : be_(be),
        o_(o),
        ring_size_(o.mode == OffloadMode::kSingle ? 1 : o.buffers),
        lookahead_(o.mode == OffloadMode::kSingle ? 0 : o.lookahead) {}

  ~OffloadStore() override {
    // Copies may still read the host pool or staging buffers: let them finish before those go.
    try {
      if (pool_ || !ring_.empty()) be_.synchronize(SyncCause::kOffload);
    } catch (...) {
    }
  }

  void begin_step(int n_blocks) override {
    HP_CHECK(n_blocks >= 0, "activation store: ", n_blocks, " blocks");
    blocks_.assign(static_cast<size_t>(n_blocks), Block());
    next_save_ = 0;
    next_load_ = n_blocks - 1;
    pending_ = -1;
    current_ = -1;
    // The previous step's reloads precede this step's offloads on the copy stream, so the
    // pool's slices can be handed out again from the start.
    pool_used_ = 0;
    const int64_t pool = stats_.pinned_pool_bytes, staging = stats_.staging_bytes;
    stats_ = OffloadStats();
    stats_.pinned_pool_bytes = pool;
    stats_.staging_bytes = staging;
  }

  void save(int i, const Tensor& x) override {
    HP_CHECK(i == next_save_ && i < static_cast<int>(blocks_.size()), "activation store: save(", i,
             ") out of order (expected block ", next_save_, " of ", blocks_.size(), ")");
    ++next_save_;
    release_offloaded();
    Block& b = blocks_[static_cast<size_t>(i)];
    b.device = x;
    if (i + 1 == static_cast<int>(blocks_.size())) {
      b.resident = true;
      stats_.resident_bytes += static_cast<int64_t>(x.nbytes());
      return;
    }
    size_at_first_use(x);
    b.host = host_buffer(i, x);
    // The copy stream reads x only after the compute stream has written it.
    std::shared_ptr<Backend::Event> written = be_.record_event(SK::kCompute);
    be_.wait_event(SK::kCopy, *written);
    be_.set_stream(SK::kCopy);
    be_.copy_over_link(x, b.host, CopyDirection::kOffload);
    b.offloaded = be_.record_event(SK::kCopy);
    be_.set_stream(SK::kCompute);
    if (b.pageable) be_.event_synchronize(*b.offloaded, SyncCause::kOffload);
    stats_.d2h_bytes += static_cast<int64_t>(x.nbytes());
    ++stats_.offloaded_blocks;
    pending_ = i;
  }

  Tensor load(int i) override {
    HP_CHECK(i == next_load_ && i >= 0 && next_save_ == static_cast<int>(blocks_.size()),
             "activation store: load(", i, ") out of order (expected block ", next_load_,
             " after all ", blocks_.size(), " saves)");
    --next_load_;
    release_offloaded();
    if (current_ >= 0) finish_use(current_);
    current_ = i;
    for (int j = i; j >= std::max(0, i - lookahead_); --j) issue_reload(j);
    Block& b = blocks_[static_cast<size_t>(i)];
    if (b.resident) return b.device;
    be_.wait_event(SK::kCompute, *b.ready);
    return b.reloaded;
  }

  void end_step() override {
    release_offloaded();
    if (current_ >= 0) finish_use(current_);
    current_ = -1;
    // Host copies of the pool stay; pageable ones and anything not reloaded go. Every reload
    // has been waited for by the compute stream, and a pageable source has been read by the
    // time its copy call returns.
    blocks_.clear();
  }

  const OffloadStats& stats() const override { return stats_; }
  OffloadMode mode() const override { return o_.mode; }

 private:
  struct Block {
    Tensor device;    // the forward tensor: held until its offload is ordered before reuse
    Tensor host;      // host copy
    Tensor reloaded;  // device copy made in backward (a staging view or a fresh tensor)
    bool resident = false;
    bool pageable = false;
    bool issued = false;
    int slot = -1;
    std::shared_ptr<Backend::Event> offloaded, ready;
  };
  struct Slot {
    Tensor buffer;
    std::shared_ptr<Backend::Event> free;  // the compute stream is done with the last contents
  };

  // The previous block's forward tensor may go once its offload is done: the compute stream
  // waits for the copy (long finished in the steady state: it ran during that block's forward),
  // so the caching allocator can hand its memory to later compute work.
  void release_offloaded() {
    if (pending_ < 0) return;
    Block& b = blocks_[static_cast<size_t>(pending_)];
    pending_ = -1;
    be_.wait_event(SK::kCompute, *b.offloaded);
    if (o_.poison_released) be_.fill(b.device, std::numeric_limits<double>::quiet_NaN());
    b.device = Tensor();
  }

  // Backward of block i is issued: its staging slot (or resident tensor) may be reused after the
  // compute work queued so far.
  void finish_use(int i) {
    Block& b = blocks_[static_cast<size_t>(i)];
    if (b.resident) {
      if (o_.poison_released) be_.fill(b.device, std::numeric_limits<double>::quiet_NaN());
      b.device = Tensor();
      return;
    }
    if (b.slot >= 0) {
      Slot& s = ring_[static_cast<size_t>(b.slot)];
      if (o_.poison_released) be_.fill(s.buffer, std::numeric_limits<double>::quiet_NaN());
      s.free = be_.record_event(SK::kCompute);
    }
    b.reloaded = Tensor();
  }

  void issue_reload(int j) {
    Block& b = blocks_[static_cast<size_t>(j)];
    if (b.resident || b.issued) return;
    b.issued = true;
    std::shared_ptr<Backend::Event> after;  // what the copy stream must wait for first
    if (static_cast<int64_t>(b.host.nbytes()) <= slot_bytes_) {
      b.slot = next_slot_;
      next_slot_ = (next_slot_ + 1) % ring_size_;
      Slot& s = ring_[static_cast<size_t>(b.slot)];
      after = s.free;
      b.reloaded = Tensor(s.buffer.storage(), 0, b.host.shape(), b.host.dtype());
    } else {
      warn_chunked(j, b.host);
      ++stats_.chunked_blocks;
      // A fresh tensor from the caching allocator may be memory that queued compute work still
      // uses: the copy stream starts after that work.
      b.reloaded = be_.empty(b.host.shape(), b.host.dtype());
      after = be_.record_event(SK::kCompute);
    }
    if (after) be_.wait_event(SK::kCopy, *after);
    be_.wait_event(SK::kCopy, *b.offloaded);
    be_.set_stream(SK::kCopy);
    const int64_t chunk =
        std::max<int64_t>(1, slot_bytes_ / static_cast<int64_t>(dtype_size(b.host.dtype())));
    const int64_t n = b.host.numel();
    if (b.slot >= 0 || n <= chunk) {
      be_.copy_over_link(b.host, b.reloaded, CopyDirection::kReload);
    } else {
      for (int64_t s = 0; s < n; s += chunk) {
        const int64_t c = std::min(chunk, n - s);
        Tensor dst = b.reloaded.flat_view(s, c);
        be_.copy_over_link(b.host.flat_view(s, c), dst, CopyDirection::kReload);
      }
    }
    b.ready = be_.record_event(SK::kCopy);
    be_.set_stream(SK::kCompute);
    stats_.h2d_bytes += static_cast<int64_t>(b.host.nbytes());
  }

  // The pool and the ring are sized at the first offloaded block: from then on every step
  // reuses them.
  void size_at_first_use(const Tensor& x) {
    if (sized_) return;
    sized_ = true;
    const int64_t bytes = static_cast<int64_t>(x.nbytes());
    slot_bytes_ = o_.staging_bytes > 0 ? o_.staging_bytes : bytes;
    const int64_t elems =
        (slot_bytes_ + static_cast<int64_t>(dtype_size(x.dtype())) - 1) / dtype_size(x.dtype());
    ring_.resize(static_cast<size_t>(ring_size_));
    for (Slot& s : ring_) s.buffer = be_.empty({elems}, x.dtype());
    // Fresh allocator memory: the first reload into it waits for the compute work queued so far.
    std::shared_ptr<Backend::Event> now = be_.record_event(SK::kCompute);
    for (Slot& s : ring_) s.free = now;
    stats_.staging_bytes = static_cast<int64_t>(ring_size_) * elems * dtype_size(x.dtype());

    const int64_t aligned =
        static_cast<int64_t>((bytes + kHostAlign - 1) / kHostAlign * kHostAlign);
    const int64_t want =
        o_.pinned_pool_bytes > 0
            ? o_.pinned_pool_bytes
            : aligned * std::max<int64_t>(1, static_cast<int64_t>(blocks_.size()) - 1);
    pool_ = be_.pinned_host_storage(static_cast<size_t>(want));
    if (!pool_) {
      log_warn("offload: a pinned host pool of ", size_str(want), " could not be allocated; ",
               "block inputs of ", size_str(bytes), " go to pageable host memory (slower copies, ",
               "one host wait per offload)");
      warned_pageable_ = true;
    }
    pool_bytes_ = pool_ ? want : 0;
    stats_.pinned_pool_bytes = pool_bytes_;
  }

  Tensor host_buffer(int i, const Tensor& x) {
    const int64_t bytes = static_cast<int64_t>(x.nbytes());
    const int64_t aligned =
        static_cast<int64_t>((bytes + kHostAlign - 1) / kHostAlign * kHostAlign);
    if (pool_ && pool_used_ + aligned <= pool_bytes_) {
      Tensor t(pool_, pool_used_ / static_cast<int64_t>(dtype_size(x.dtype())), x.shape(),
               x.dtype());
      pool_used_ += aligned;
      return t;
    }
    if (!warned_pageable_) {
      warned_pageable_ = true;
      log_warn("offload: the pinned host pool of ", size_str(pool_bytes_), ", ", pool_used_,
               " bytes used, has no room for block ", i, "'s input of ", size_str(bytes),
               "; it and any further overflow go to pageable host memory (one host wait per such "
               "offload). Raise pinned_pool_mib (0 sizes it from the model and batch).");
    }
    ++stats_.pageable_blocks;
    blocks_[static_cast<size_t>(i)].pageable = true;
    return Tensor::host(x.shape(), x.dtype());
  }

  void warn_chunked(int j, const Tensor& host) {
    if (warned_chunked_) return;
    warned_chunked_ = true;
    log_warn("offload: block ", j, "'s input of ", size_str(static_cast<int64_t>(host.nbytes())),
             " exceeds a staging buffer of ", size_str(slot_bytes_), "; such blocks are reloaded",
             " in chunks of that size into a fresh device tensor, after the compute queued before");
  }

  Backend& be_;
  OffloadOptions o_;
  const int ring_size_;
  const int lookahead_;
  std::vector<Block> blocks_;
  std::vector<Slot> ring_;
  int next_slot_ = 0;
  int next_save_ = 0;
  int next_load_ = -1;
  int pending_ = -1;  // block whose forward tensor waits for release_offloaded
  int current_ = -1;  // block whose backward the compute stream was last given
  bool sized_ = false;
  int64_t slot_bytes_ = 0;
  std::shared_ptr<Storage> pool_;
  int64_t pool_bytes_ = 0;
  int64_t pool_used_ = 0;
  bool warned_pageable_ = false;
  bool warned_chunked_ = false;
  OffloadStats stats_;
};

}  // namespace

std::unique_ptr<ActivationStore> make_activation_store(Backend& be, const OffloadOptions& opts) {
  opts.validate();
  if (opts.mode == OffloadMode::kNone) return std::make_unique<DeviceStore>();
  be.set_simulated_link_gbps(opts.sim_link_gbps);
  return std::make_unique<OffloadStore>(be, opts);
}

}  // namespace hp
