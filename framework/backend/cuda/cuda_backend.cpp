// The CUDA backend: dtype, device and kernel-limit checks (the interface has checked the shapes,
// backend.h) and dispatch to the kernels of this directory, cuBLAS for GEMMs, the batch-metadata
// upload (one pinned staging buffer, one async copy) and the per-layer rebuild baseline.
#include "framework/backend/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "framework/backend/cuda/cuda_allocator.h"
#include "framework/backend/cuda/cuda_check.h"
#include "framework/backend/cuda/cuda_kernels.h"
#include "framework/backend/cuda/cuda_profiler.h"
#include "framework/backend/cuda/cudnn_attention.h"
#include "framework/backend/cuda/fp8_gemm.h"
#include "framework/backend/cuda/lt_gemm.h"
#include "framework/backend/cuda/mark_written.h"
#include "framework/backend/link_arbiter.h"

namespace hp {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for the caller
    return 0;
  }
  return n;
}

int64_t cuda_device_total_bytes(int ordinal) {
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal));
  return static_cast<int64_t>(prop.totalGlobalMem);
}

namespace {

using cuda::AttnTile;

constexpr uint64_t kBatchExtraMagic = 0x68705f6375646121ull;  // tags extras made by this backend

// Backend-private part of a BatchMeta: the device buffer behind its views and the tile map.
struct CudaBatchExtra {
  uint64_t magic = kBatchExtraMagic;
  int device = -1;
  Tensor buffer;  // owns the device memory of inputs/targets/positions/cu_seqlens/tiles
  const AttnTile* tiles = nullptr;
  int n_tiles = 0;
  // cuDNN's view of the batch, made by the first attention call of each head shape and reused
  // by every other layer of the step (rule 1).
  struct CudnnEntry {
    int hq, hkv, d;
    cuda::CudnnBatch batch;
  };
  mutable std::vector<CudnnEntry> cudnn;
};

// ---- argument checks
// ------------------------------------------------------------------------------

void check_dev(const char* op, const char* name, const Tensor& t) {
  HP_CHECK(t.defined(), op, ": tensor '", name, "' is undefined");
  HP_CHECK(t.device() == Device::kCUDA, op, ": tensor '", name, "' must live on the GPU, got ",
           t.desc());
}

// Shapes are checked by the interface (backend.h); dtypes and devices here.
void check_dtype(const char* op, const char* name, const Tensor& t, DType dtype) {
  check_dev(op, name, t);
  HP_CHECK(t.dtype() == dtype, op, ": tensor '", name, "' is ", t.desc(), ", expected ",
           dtype_name(dtype));
}

bool is_f32_or_bf16(DType t) { return t == DType::kF32 || t == DType::kBF16; }

// A float tensor (f32 or bf16).
void check_float(const char* op, const char* name, const Tensor& t) {
  check_dev(op, name, t);
  HP_CHECK(is_f32_or_bf16(t.dtype()), op, ": tensor '", name, "' is ", t.desc(),
           ", expected f32 or bf16");
}

void check_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  HP_CHECK(a.dtype() == b.dtype(), op, ": tensors ", a.desc(), " and ", b.desc(),
           " must share a dtype");
}

void check_i32(const char* op, const char* name, const Tensor& t) {
  check_dtype(op, name, t, DType::kI32);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- pinned staging for batch uploads
// ---------------------------------------------------------------

// A ring of pinned host buffers. A slot is reused only once the copy that last read it has
// finished (checked with cudaEventQuery, which never blocks); when none is free a new slot is
// added, so upload_batch never waits for the device.
class PinnedStaging {
 public:
  ~PinnedStaging() {
    for (Slot& s : slots_) {
      if (s.event) cudaEventDestroy(s.event);
      if (s.ptr) cudaFreeHost(s.ptr);
    }
  }

  // A free slot of at least `bytes`; the caller fills it, enqueues its copy, then calls
  // mark_in_flight(slot, stream).
  int acquire(size_t bytes) {
    int candidate = -1;
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (!is_free(slots_[i])) continue;
      if (slots_[i].capacity >= bytes) return static_cast<int>(i);
      if (candidate < 0) candidate = static_cast<int>(i);
    }
    if (candidate < 0) {
      slots_.push_back(Slot{});
      candidate = static_cast<int>(slots_.size()) - 1;
      CUDA_CHECK(cudaEventCreateWithFlags(&slots_[candidate].event, cudaEventDisableTiming));
    }
    Slot& s = slots_[candidate];
    if (s.ptr) CUDA_CHECK(cudaFreeHost(s.ptr));  // rare: a free slot that is too small
    s.ptr = nullptr;
    size_t cap = 1 << 16;
    while (cap < bytes) cap *= 2;
    CUDA_CHECK(cudaHostAlloc(&s.ptr, cap, cudaHostAllocDefault));
    s.capacity = cap;
    return candidate;
  }

  void* data(int slot) { return slots_[slot].ptr; }

  void mark_in_flight(int slot, cudaStream_t stream) {
    CUDA_CHECK(cudaEventRecord(slots_[slot].event, stream));
    slots_[slot].used = true;
  }

 private:
  struct Slot {
    void* ptr = nullptr;
    size_t capacity = 0;
    cudaEvent_t event = nullptr;
    bool used = false;
  };

  static bool is_free(const Slot& s) {
    if (!s.used) return true;
    const cudaError_t st = cudaEventQuery(s.event);
    if (st == cudaSuccess) return true;
    if (st == cudaErrorNotReady) {
      cudaGetLastError();  // "not ready" is a state, not an error
      return false;
    }
    CUDA_CHECK(st);
    return false;
  }

  std::vector<Slot> slots_;
};

// A product's output, declared written for initcheck (mark_written.h).
void mark_written(const Tensor& c, cudaStream_t stream) {
  cuda::mark_written(c.raw(), static_cast<size_t>(c.nbytes()), stream);
}

// ---- the backend
// ------------------------------------------------------------------------------------

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const CudaBackendOptions& options)
      : device_(device), options_(options), alloc_(&cuda_device_allocator(device)) {
    const int count = cuda_device_count();
    if (device < 0 || device >= count)
      HP_USER_ERROR(ErrorKind::kConfig, "CUDA device ", device, " requested but ", count,
                    " device(s) are visible");
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaDeviceGetAttribute(&cc_major_, cudaDevAttrComputeCapabilityMajor, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&cc_minor_, cudaDevAttrComputeCapabilityMinor, device));
    for (cudaStream_t& s : streams_)
      CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasCreate(&cublas_));
    CUBLAS_CHECK(cublasSetStream(cublas_, cur_stream()));
    // An explicit workspace keeps cuBLAS from allocating on its own and its results reproducible.
    cublas_workspace_ = new_cublas_workspace();
    CUBLAS_CHECK(cublasSetWorkspace(cublas_, cublas_workspace_.raw(), cublas_workspace_.nbytes()));
    lt_.set_autotune(options_.gemm_autotune && !options_.deterministic);
    CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&info_host_), 4 * sizeof(int32_t),
                             cudaHostAllocDefault));
    if (options_.attention != AttentionImpl::kTiled) {
      std::string why;
      cudnn_ = cuda::CudnnAttention::create(&why);
      if (cudnn_) cudnn_->set_autotune(options_.attention_autotune && !options_.deterministic);
      if (!cudnn_ && options_.attention == AttentionImpl::kCudnn)
        HP_USER_ERROR(ErrorKind::kConfig, "config key 'attention': cudnn requested but ", why,
                      "; use attention=auto or attention=tiled");
      attention_desc_ =
          cudnn_ ? str_cat("cudnn ", cudnn_->version(),
                           options_.deterministic ? " (deterministic backward)" : "",
                           options_.attention == AttentionImpl::kAuto ? ", tiled for windows" : "")
                 : str_cat("tiled (", why, ")");
    } else {
      attention_desc_ = "tiled";
    }
  }

  const std::string& attention_description() const { return attention_desc_; }

  ~CudaBackend() override {
    // Destructors must not throw: errors are ignored, the device is left as it is.
    stop_issuer();
    for (cudaStream_t s : streams_) cudaStreamSynchronize(s);
    cublasDestroy(cublas_);
    for (SideStream& ss : side_streams_) {
      if (ss.stream) cudaStreamSynchronize(ss.stream);
      if (ss.stream) cudaStreamDestroy(ss.stream);
      if (ss.done) cudaEventDestroy(ss.done);
    }
    if (fork_) cudaEventDestroy(fork_);
    for (cudaStream_t s : streams_) cudaStreamDestroy(s);
    cudaFreeHost(info_host_);
  }

  Device device() const override { return Device::kCUDA; }
  std::string name() const override { return str_cat("cuda:", device_); }
  std::string pci_bus_id() const override {
    char id[32] = {};
    CUDA_CHECK(cudaDeviceGetPCIBusId(id, static_cast<int>(sizeof(id)), device_));
    return id;
  }
  DType act_dtype() const override { return DType::kBF16; }
  DType master_dtype() const override { return DType::kF32; }
  Allocator& allocator() override { return *alloc_; }

  cudaStream_t compute_stream() const { return streams_[0]; }
  cudaStream_t comm_stream() const { return streams_[static_cast<int>(StreamKind::kComm)]; }
  int device_ordinal() const { return device_; }
  int gemm_tuned_buckets() const { return lt_.tuned_buckets(); }
  int gemm_warmed_algos() const { return lt_.warmed_algos(); }
  int attention_tuned_graphs() const {
    return cudnn_ ? static_cast<int>(cudnn_->graphs_tuned()) : 0;
  }

  // ---- memory
  // -------------------------------------------------------------------------------------

  void do_fill_normal(Tensor& t, uint64_t key, int64_t offset, double std) override {
    check_dev("fill_normal", "t", t);
    HP_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kF64, "fill_normal: ", t.desc(),
             " must be f32 or f64");
    cuda::launch_fill_normal(t.raw(), t.dtype(), t.numel(), key, offset, std, cur_stream());
  }

  void do_fill(Tensor& t, double value) override {
    check_dev("fill", "t", t);
    cuda::launch_fill(t.raw(), t.dtype(), t.numel(), value, cur_stream());
  }

  void do_copy(const Tensor& src, Tensor& dst) override {
    if (src.nbytes() == 0 || src.raw() == dst.raw()) return;
    if (stream_ == StreamKind::kCopy && arbiter_) {
      enqueue_issue(
          IssueOp::kCopy, src, dst,
          dst.device() == Device::kCUDA ? CopyDirection::kReload : CopyDirection::kOffload);
      return;
    }
    // Unified addressing tells host from device; pageable host memory is staged by the driver.
    CUDA_CHECK(
        cudaMemcpyAsync(dst.raw(), src.raw(), src.nbytes(), cudaMemcpyDefault, cur_stream()));
  }

  void do_convert(const Tensor& src, Tensor& dst) override {
    check_float("convert", "src", src);
    check_float("convert", "dst", dst);
    if (src.raw() == dst.raw() && src.dtype() == dst.dtype()) return;
    cuda::launch_convert(src.raw(), src.dtype(), dst.raw(), dst.dtype(), src.numel(), cur_stream());
  }

  void do_read_to_host(const Tensor& src, Tensor& host_dst, SyncCause cause) override {
    do_copy(src, host_dst);
    if (stream_ == StreamKind::kCopy && arbiter_) wait_issued(issue_enqueued());
    CUDA_CHECK(cudaStreamSynchronize(cur_stream()));
    syncs_.add(cause);
  }

  void synchronize(SyncCause cause) override {
    if (arbiter_) wait_issued(issue_enqueued());
    for (cudaStream_t s : streams_) CUDA_CHECK(cudaStreamSynchronize(s));
    syncs_.add(cause);
  }

  int64_t device_peak_bytes() const override {
    return static_cast<int64_t>(alloc_->stats().peak_in_use);
  }

  // Device-time profiles from CUPTI activity records (cuda_profiler.h).
  void profile_begin() override {
    synchronize(SyncCause::kOther);
    profile_mallocs_ = alloc_->stats().device_mallocs;
    profile_plans_ = cudnn_ ? cudnn_->graphs_built() : 0;
    cuda::profile_begin(phase_, family_);
    profiling_ = true;
  }
  StepProfile profile_end() override {
    synchronize(SyncCause::kOther);
    profiling_ = false;
    StepProfile p = cuda::profile_end();
    p.device_mallocs = alloc_->stats().device_mallocs - profile_mallocs_;
    p.plans_built = (cudnn_ ? cudnn_->graphs_built() : 0) - profile_plans_;
    return p;
  }
  void on_mark(StepPhase, OpFamily) override {}
  void after_mark() override { cuda::profile_mark(phase_, family_); }

  // Page-locked, so copy-stream copies to and from it run asynchronously. A failed allocation
  // is reported as null, not thrown: the caller has a pageable fallback.
  std::shared_ptr<Storage> pinned_host_storage(size_t bytes) override {
    void* p = nullptr;
    if (cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocDefault) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return std::make_shared<Storage>(p, bytes, Device::kCPU, [p] { cudaFreeHost(p); });
  }

  // ---- streams and events ---------------------------------------------------------------------

  void set_stream(StreamKind s) override {
    if (s == stream_) return;
    stream_ = s;
    CUBLAS_CHECK(cublasSetStream(cublas_, cur_stream()));
  }

  std::shared_ptr<Event> record_event(StreamKind s) override {
    auto e = std::make_shared<CudaEvent>();
    CUDA_CHECK(cudaEventCreateWithFlags(&e->event, cudaEventDisableTiming));
    e->stream = s;
    if (s == StreamKind::kCopy && arbiter_) {
      // Recorded by the copy issuer, after the copy-stream work queued before it.
      e->issue_seq =
          enqueue_issue(IssueOp::kRecord, Tensor(), Tensor(), CopyDirection::kOffload, e);
      return e;
    }
    CUDA_CHECK(cudaEventRecord(e->event, streams_[static_cast<int>(s)]));
    return e;
  }

  void wait_event(StreamKind waiter, const Event& e) override {
    const CudaEvent& ce = as_cuda_event_object(e);
    if (waiter == StreamKind::kCopy && arbiter_) {
      // In order with the copies queued before it; the issuer keeps the event alive.
      enqueue_issue(IssueOp::kWait, Tensor(), Tensor(), CopyDirection::kOffload,
                    std::const_pointer_cast<CudaEvent>(ce.shared_from_this()));
      return;
    }
    // Waiting on an event not recorded yet would be a no-op: wait until the issuer recorded it.
    if (ce.issue_seq > 0) wait_issued(ce.issue_seq);
    CUDA_CHECK(cudaStreamWaitEvent(streams_[static_cast<int>(waiter)], ce.event, 0));
  }

  void event_synchronize(const Event& e, SyncCause cause) override {
    const CudaEvent& ce = as_cuda_event_object(e);
    if (ce.issue_seq > 0) wait_issued(ce.issue_seq);
    CUDA_CHECK(cudaEventSynchronize(ce.event));
    syncs_.add(cause);
  }

  void do_copy_over_link(const Tensor& src, Tensor& dst, CopyDirection dir) override {
    if (stream_ != StreamKind::kCopy || !arbiter_) {
      do_copy(src, dst);
      return;
    }
    if (src.nbytes() == 0 || src.raw() == dst.raw()) return;
    enqueue_issue(IssueOp::kCopy, src, dst, dir);
  }

  void set_link_arbiter(LinkArbiter* arbiter) override {
    if (arbiter == arbiter_) return;
    // Every chunk of the old arbiter has been issued and (its release callback having run once
    // the copy stream is idle) released before the new one takes over.
    if (arbiter_) wait_issued(issue_enqueued());
    CUDA_CHECK(cudaStreamSynchronize(streams_[static_cast<int>(StreamKind::kCopy)]));
    {
      std::lock_guard<std::mutex> lock(issue_mu_);
      arbiter_ = arbiter;
    }
    if (arbiter_ && !issuer_.joinable()) issuer_ = std::thread([this] { issuer_loop(); });
  }

  // ---- packed batch metadata
  // ------------------------------------------------------------------------

  // One pinned staging buffer holds inputs | targets | positions | cu_seqlens | tile map; one
  // async copy moves it to one device buffer, which the BatchMeta's tensors view. No sync.
  BatchMeta do_upload_batch(const PackedBatch& batch) override {
    const int64_t n = static_cast<int64_t>(batch.inputs.size());
    HP_CHECK(n < std::numeric_limits<int32_t>::max(), "upload_batch: ", n, " tokens is too many");
    const int64_t n_seqs = batch.num_seqs();
    std::vector<AttnTile> tiles;
    tiles.reserve(static_cast<size_t>(n / cuda::kAttnTile + n_seqs + 1));
    for (int64_t s = 0; s < n_seqs; ++s) {
      const int32_t b = batch.cu_seqlens[s], e = batch.cu_seqlens[s + 1];
      for (int32_t t = b; t < e; t += cuda::kAttnTile)
        tiles.push_back(AttnTile{t, std::min(t + cuda::kAttnTile, e), b, e});
    }

    // Layout in 32-bit words; the tile map starts 16-byte aligned.
    const int64_t off_targets = n, off_positions = 2 * n, off_cu = 3 * n;
    const int64_t off_tiles = (off_cu + n_seqs + 1 + 3) / 4 * 4;
    const int64_t words = off_tiles + 4 * static_cast<int64_t>(tiles.size());

    auto extra = std::make_shared<CudaBatchExtra>();
    extra->device = device_;
    extra->buffer = Tensor::empty(*alloc_, {std::max<int64_t>(words, 1)}, DType::kI32);
    const int slot = staging_.acquire(static_cast<size_t>(words) * 4);
    int32_t* host = static_cast<int32_t*>(staging_.data(slot));
    std::memcpy(host, batch.inputs.data(), n * 4);
    std::memcpy(host + off_targets, batch.targets.data(), n * 4);
    std::memcpy(host + off_positions, batch.positions.data(), n * 4);
    std::memcpy(host + off_cu, batch.cu_seqlens.data(), (n_seqs + 1) * 4);
    std::memcpy(host + off_tiles, tiles.data(), tiles.size() * sizeof(AttnTile));
    CUDA_CHECK(cudaMemcpyAsync(extra->buffer.raw(), host, static_cast<size_t>(words) * 4,
                               cudaMemcpyHostToDevice, cur_stream()));
    staging_.mark_in_flight(slot, cur_stream());

    const std::shared_ptr<Storage>& st = extra->buffer.storage();
    BatchMeta meta;
    meta.inputs = Tensor(st, 0, {n}, DType::kI32);
    meta.targets = Tensor(st, off_targets, {n}, DType::kI32);
    meta.positions = Tensor(st, off_positions, {n}, DType::kI32);
    meta.cu_seqlens = Tensor(st, off_cu, {n_seqs + 1}, DType::kI32);
    meta.n_seqs = n_seqs;
    meta.max_seqlen = batch.max_seqlen;
    extra->tiles = reinterpret_cast<const AttnTile*>(extra->buffer.data<int32_t>() + off_tiles);
    extra->n_tiles = static_cast<int>(tiles.size());
    meta.backend_extra = extra;
    return meta;
  }

  // The per-layer baseline: cu_seqlens, max_seqlen and the tile map derived from positions on the
  // device, max_seqlen (with the sequence and tile counts) read back by one blocking copy.
  void do_rebuild_metadata(BatchMeta& meta) override {
    check_i32("rebuild_metadata", "positions", meta.positions);
    const int64_t n = meta.positions.numel();
    const int64_t off_tiles = (n + 1 + 3) / 4 * 4;
    const int64_t off_info = off_tiles + 4 * n;
    auto extra = std::make_shared<CudaBatchExtra>();
    extra->device = device_;
    extra->buffer = Tensor::empty(*alloc_, {off_info + 4}, DType::kI32);
    int32_t* base = extra->buffer.data<int32_t>();
    AttnTile* tiles = reinterpret_cast<AttnTile*>(base + off_tiles);
    cuda::launch_rebuild_metadata(meta.positions.data<int32_t>(), n, base, tiles, base + off_info,
                                  *alloc_, cur_stream());
    CUDA_CHECK(cudaMemcpyAsync(info_host_, base + off_info, 3 * sizeof(int32_t),
                               cudaMemcpyDeviceToHost, cur_stream()));
    CUDA_CHECK(cudaStreamSynchronize(cur_stream()));
    syncs_.add(SyncCause::kMetadata);
    const int64_t n_seqs = info_host_[0];
    meta.cu_seqlens = Tensor(extra->buffer.storage(), 0, {n_seqs + 1}, DType::kI32);
    meta.n_seqs = n_seqs;
    meta.max_seqlen = info_host_[1];
    extra->tiles = tiles;
    extra->n_tiles = info_host_[2];
    meta.backend_extra = extra;
  }

  // ---- dense math
  // -----------------------------------------------------------------------------------

  // Row-major C[m,n] = op(A) op(B) is column-major C^T[n,m] = op(B)^T op(A)^T: cuBLAS gets B
  // first, and a row-major matrix is its own transpose read column-major, so each operand keeps
  // its transpose flag.
  // The shape of c = op(a) op(b) (which the interface checked), with the dtypes checked.
  struct GemmDims {
    int m = 0, n = 0, k = 0;
  };
  static GemmDims gemm_dims(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                            const Tensor& c) {
    const char* op = "gemm";
    check_float(op, "a", a);
    check_float(op, "b", b);
    check_float(op, "c", c);
    check_same_dtype(op, a, b);
    HP_CHECK(a.dtype() == DType::kBF16 || c.dtype() == DType::kF32, op,
             ": f32 operands need an f32 c, got ", c.desc());
    const int64_t m = trans_a ? a.dim(1) : a.dim(0);
    const int64_t k = trans_a ? a.dim(0) : a.dim(1);
    const int64_t n = trans_b ? b.dim(0) : b.dim(1);
    constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
    HP_CHECK(m <= kMaxInt && n <= kMaxInt && k <= kMaxInt, "gemm: dimensions exceed int range");
    return {static_cast<int>(m), static_cast<int>(n), static_cast<int>(k)};
  }

  // c = alpha op(a) op(b) + beta c (+ bias) through cuBLASLt on `stream` with workspace `ws`;
  // false (nothing issued) where cuBLASLt has no algorithm for it. With a bias cuBLASLt cannot
  // fuse, the product goes through cuBLASLt and the bias is added after it on the same stream.
  // may_tune: LtGemm may time candidates for the product's bucket (gemm_autotune). c_in: C apart
  // from the output (gemm_add's residual). A group's products (an expert's rows follow the data)
  // have their shape's algorithms warmed (LtGemm::run).
  bool lt_gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
               const GemmDims& d, float alpha, float beta, const Tensor* bias, cudaStream_t stream,
               const Tensor& ws, bool may_tune, const Tensor* c_in = nullptr) {
    if (a.dtype() != DType::kBF16 || d.k == 0) return false;
    const cudaDataType c_type = c.dtype() == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
    // Row-major c = op(a) op(b) is column-major c^T = op(b)^T op(a)^T.
    auto run = [&](const void* bias_ptr, cudaDataType bias_type) {
      return lt_.run(trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, d.n,
                     d.m, d.k, alpha, b.raw(), static_cast<int>(b.dim(1)), a.raw(),
                     static_cast<int>(a.dim(1)), beta, c.raw(), c_type, d.n, ws.raw(), ws.nbytes(),
                     stream, bias_ptr, bias_type, may_tune, c_in ? c_in->raw() : nullptr,
                     in_group_);
    };
    if (!bias) {
      if (!run(nullptr, CUDA_R_16BF)) return false;
      mark_written(c, stream);
      return true;
    }
    if (aligned16(bias->raw()) &&
        run(bias->raw(), bias->dtype() == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F)) {
      mark_written(c, stream);
      return true;
    }
    if (c_in || !run(nullptr, CUDA_R_16BF)) return false;
    mark_written(c, stream);
    cuda::launch_add_bias(c.raw(), c.dtype(), bias->raw(), bias->dtype(), c.dim(0), c.dim(1),
                          stream);
    return true;
  }

  // Row-major C[m,n] = op(A) op(B) is column-major C^T[n,m] = op(B)^T op(A)^T: cuBLAS gets B
  // first, and a row-major matrix is its own transpose read column-major, so each operand keeps
  // its transpose flag.
  void do_gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
               double alpha, double beta) override {
    const GemmDims d = gemm_dims(a, trans_a, b, trans_b, c);
    if (d.m == 0 || d.n == 0) return;
    if (d.k == 0) {  // op(a) op(b) is all zeros: c = beta c
      if (beta == 0) {
        fill(c, 0.0);
      } else {
        cuda::launch_axpy(beta - 1.0, c.raw(), c.dtype(), c.raw(), c.dtype(), c.numel(),
                          cur_stream());
      }
      return;
    }
    const float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
    if (lt_gemm(a, trans_a, b, trans_b, c, d, alpha_f, beta_f, nullptr, cur_stream(),
                cublas_workspace_, !in_group_))
      return;
    const cudaDataType ab_type = a.dtype() == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
    const cudaDataType c_type = c.dtype() == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
    CUBLAS_CHECK(cublasGemmEx(cublas_, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                              trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, d.n, d.m, d.k, &alpha_f, b.raw(),
                              ab_type, static_cast<int>(b.dim(1)), a.raw(), ab_type,
                              static_cast<int>(a.dim(1)), &beta_f, c.raw(), c_type, d.n,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    mark_written(c, cur_stream());
  }

  // The bias goes into cuBLASLt's epilogue: added in f32 to the accumulator, rounded once.
  void do_gemm_bias(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                    const Tensor& bias) override {
    const GemmDims d = gemm_dims(a, trans_a, b, trans_b, c);
    check_float("gemm_bias", "bias", bias);
    if (d.m == 0 || d.n == 0) return;
    if (lt_gemm(a, trans_a, b, trans_b, c, d, 1.f, 0.f, &bias, cur_stream(), cublas_workspace_,
                !in_group_))
      return;
    Backend::do_gemm_bias(a, trans_a, b, trans_b, c, bias);
  }

  // The residual is cuBLASLt's C (beta 1, D apart from it), added in f32 in the epilogue with the
  // bias: one rounding, and no pass of its own over the activations.
  void do_gemm_add(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& r,
                   Tensor& c, const Tensor& bias) override {
    const GemmDims d = gemm_dims(a, trans_a, b, trans_b, c);
    check_float("gemm_add", "r", r);
    if (d.m == 0 || d.n == 0) return;
    if (bias.defined()) check_float("gemm_add", "bias", bias);
    if ((!bias.defined() || aligned16(bias.raw())) &&
        lt_gemm(a, trans_a, b, trans_b, c, d, 1.f, 1.f, bias.defined() ? &bias : nullptr,
                cur_stream(), cublas_workspace_, !in_group_, &r))
      return;
    Backend::do_gemm_add(a, trans_a, b, trans_b, r, c, bias);
  }

  void do_gemm_group(const std::vector<GemmProblem>& ps, bool trans_a, bool trans_b,
                     double beta) override {
    std::vector<GemmDims> dims;
    dims.reserve(ps.size());
    for (const GemmProblem& p : ps) {
      dims.push_back(gemm_dims(p.a, trans_a, p.b, trans_b, p.c));
      if (p.bias.defined()) check_float("gemm_group", "bias", p.bias);
    }
    // A group's products are not tuned (lt_gemm.h), whichever way they run.
    in_group_ = true;
    struct LeaveGroup {
      bool& in_group;
      ~LeaveGroup() { in_group = false; }
    } leave{in_group_};
    if (options_.expert_gemm == ExpertGemmImpl::kSerial || ps.size() < 2) {
      Backend::do_gemm_group(ps, trans_a, trans_b, beta);
      return;
    }
    if (options_.expert_gemm == ExpertGemmImpl::kGrouped &&
        cublas_grouped(ps, dims, trans_a, trans_b, beta))
      return;
    gemm_group_on_side_streams(ps, dims, trans_a, trans_b, beta);
  }

  // ---- FP8 GEMMs (fp8_gemm.h) ----------------------------------------------------------------

  // Block-scaled FP8 GEMMs exist on compute capability 9.x and 10.x (fp8_gemm.h).
  bool has_fp8_gemms() const override {
    fp8::Recipe r{};
    return cuda::fp8_device_recipe(cc_major_, &r);
  }

  void check_fp8(const char* op, const Tensor& a, const Tensor& b, const Tensor& c,
                 const Tensor& bias, const Tensor& r) {
    check_float(op, "a", a);
    check_float(op, "b", b);
    check_float(op, "c", c);
    if (bias.defined()) check_float(op, "bias", bias);
    if (r.defined()) check_dtype(op, "r", r, c.dtype());
  }

  cuda::Fp8Context fp8_context() {
    if (!fp8_lt_) fp8_lt_ = std::make_unique<cuda::Fp8Lt>();
    cuda::Fp8Context x;
    x.alloc = alloc_;
    x.stream = cur_stream();
    x.workspace = cublas_workspace_.raw();
    x.workspace_bytes = static_cast<size_t>(cublas_workspace_.nbytes());
    x.lt = fp8_lt_.get();
    x.held = &fp8_held_;
    x.device = device_;
    x.cc_major = cc_major_;
    x.cc_minor = cc_minor_;
    return x;
  }

  void do_gemm_fp8(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                   double beta, const Tensor& bias, const Tensor& r, const Fp8Gemm& spec) override {
    check_fp8("gemm_fp8", a, b, c, bias, r);
    cuda::fp8_gemm(fp8_context(), a, trans_a, b, trans_b, c, beta, bias, r, spec);
  }

  // One product after another on the current stream (each its own quantization and matmul), all
  // problems checked first. Where a problem's output is followed in memory by the next one's (the
  // expert chunks of one buffer) and beta is 0, the next product overwrites those rows in full
  // after this one: this product may write its padded rows into them (fp8_gemm's spill_rows).
  void do_gemm_fp8_group(const std::vector<GemmProblem>& ps, bool trans_a, bool trans_b,
                         double beta, const Fp8Gemm& spec) override {
    for (const GemmProblem& p : ps) check_fp8("gemm_fp8_group", p.a, p.b, p.c, p.bias, Tensor());
    const cuda::Fp8Context x = fp8_context();
    // The a operands all quantized first, in a few launches (the problems may run in any order,
    // so no a is another's output); where the group does not allow it, each product its own.
    const std::vector<std::unique_ptr<cuda::Fp8Operand>> quantized_a =
        cuda::fp8_quantize_group_data(x, ps, trans_a, trans_b, spec);
    if (!quantized_a.empty()) ++fp8_groups_batched_;
    auto overlaps = [](const Tensor& t, const Tensor& u) {
      if (!t.defined() || !u.defined()) return false;
      const char *t0 = static_cast<const char*>(t.raw()), *u0 = static_cast<const char*>(u.raw());
      return t0 < u0 + u.nbytes() && u0 < t0 + t.nbytes();
    };
    for (size_t i = 0; i < ps.size(); ++i) {
      const GemmProblem& p = ps[i];
      int64_t spill = 0;
      if (beta == 0 && i + 1 < ps.size()) {
        const GemmProblem& nx = ps[i + 1];
        const bool follows = nx.c.dtype() == p.c.dtype() && nx.c.dim(1) == p.c.dim(1) &&
                             static_cast<const char*>(nx.c.raw()) ==
                                 static_cast<const char*>(p.c.raw()) + p.c.nbytes();
        if (follows && !overlaps(nx.a, nx.c) && !overlaps(nx.b, nx.c) && !overlaps(nx.bias, nx.c))
          spill = nx.c.dim(0);
      }
      Tensor c = p.c;
      cuda::fp8_gemm(x, p.a, trans_a, p.b, trans_b, c, beta, p.bias, Tensor(), spec, spill,
                     quantized_a.empty() ? nullptr : quantized_a[i].get());
    }
  }

  // Both forms of each weight from one read (fp8_gemm.h, Fp8HeldOperands), under the device's
  // recipe, which is the only one its products take.
  void do_hold_fp8_weights(const std::vector<Tensor>& weights, const Fp8Gemm& spec) override {
    const char* op = "hold_fp8_weights";
    for (const Tensor& w : weights) check_float(op, "weight", w);
    fp8::Recipe native{};
    HP_CHECK(cuda::fp8_device_recipe(cc_major_, &native) && spec.recipe == native, op, ": recipe ",
             fp8::recipe_name(spec.recipe), " does not run on CUDA device ", device_,
             " (compute capability ", cc_major_, ".", cc_minor_, ")");
    fp8_held_.hold(*alloc_, weights, spec.recipe, cur_stream());
  }
  void do_release_fp8_weights() override { fp8_held_.release(); }
  int64_t fp8_held_uses() const { return fp8_held_.uses(); }
  int64_t fp8_handed_uses() const { return fp8_held_.data_uses(); }
  int64_t fp8_scratch_products() const { return fp8_lt_ ? fp8_lt_->scratch_products() : 0; }
  // gemm_fp8_group calls whose a operands were quantized together.
  int64_t fp8_groups_batched() const { return fp8_groups_batched_; }
  int64_t fp8_held_count() const { return fp8_held_.size(); }

  // gemm_fp8's quantization of one operand alone (cuda_backend.h); read back where `fetch`.
  fp8::Quantized fp8_quantize(const Tensor& x, bool trans, fp8::Recipe recipe, fp8::Role role,
                              bool fetch) {
    const char* op = "cuda_fp8_quantize";
    check_float(op, "x", x);
    HP_CHECK(x.ndim() == 2, op, ": x must be 2-D, got ", x.desc());
    const cuda::Fp8Operand q =
        cuda::fp8_quantize_operand(*alloc_, x, trans, recipe, role, 1, 16, cur_stream());
    if (!fetch) return {};
    // The layout's bytes only (the i32 storage may hold a few more, never written).
    std::vector<uint8_t> codes(static_cast<size_t>(q.layout.code_bytes()));
    std::vector<uint8_t> scales(
        static_cast<size_t>(q.layout.scale_count() * (q.layout.mx() ? 1 : 4)));
    CUDA_CHECK(cudaMemcpyAsync(codes.data(), q.codes.raw(), codes.size(), cudaMemcpyDeviceToHost,
                               cur_stream()));
    CUDA_CHECK(cudaMemcpyAsync(scales.data(), q.scales.raw(), scales.size(), cudaMemcpyDeviceToHost,
                               cur_stream()));
    CUDA_CHECK(cudaStreamSynchronize(cur_stream()));
    return cuda::fp8_reference_form(q.layout, codes, scales);
  }

  fp8::Recipe fp8_recipe() const override {
    fp8::Recipe r{};
    HP_CHECK(cuda::fp8_device_recipe(cc_major_, &r), "CUDA device ", device_,
             " (compute capability ", cc_major_, ".", cc_minor_,
             ") has no block-scaled FP8 GEMMs in this backend (9.x: block128, 10.x: mxfp8)");
    return r;
  }

  // The problems of a group spread round-robin over the compute stream and kGemmStreams - 1 side
  // streams forked from it and joined back, so the partial last wave of one product overlaps the
  // next. Each side stream has its own cuBLASLt workspace; a product cuBLASLt cannot take runs on
  // the compute stream after the join.
  void gemm_group_on_side_streams(const std::vector<GemmProblem>& ps,
                                  const std::vector<GemmDims>& dims, bool trans_a, bool trans_b,
                                  double beta) {
    if (!side_streams_[0].stream) {
      for (SideStream& ss : side_streams_) {
        CUDA_CHECK(cudaStreamCreateWithFlags(&ss.stream, cudaStreamNonBlocking));
        CUDA_CHECK(cudaEventCreateWithFlags(&ss.done, cudaEventDisableTiming));
        ss.workspace = new_cublas_workspace();
      }
      CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    }
    const cudaStream_t main = cur_stream();
    CUDA_CHECK(cudaEventRecord(fork_, main));
    for (SideStream& ss : side_streams_) CUDA_CHECK(cudaStreamWaitEvent(ss.stream, fork_, 0));
    std::vector<size_t> later;
    for (size_t i = 0; i < ps.size(); ++i) {
      const GemmProblem& p = ps[i];
      if (dims[i].m == 0 || dims[i].n == 0) continue;
      const size_t which = i % kGemmStreams;
      const cudaStream_t s = which == 0 ? main : side_streams_[which - 1].stream;
      const Tensor& ws = which == 0 ? cublas_workspace_ : side_streams_[which - 1].workspace;
      Tensor c = p.c;
      if (!lt_gemm(p.a, trans_a, p.b, trans_b, c, dims[i], 1.f, static_cast<float>(beta),
                   p.bias.defined() ? &p.bias : nullptr, s, ws, false))
        later.push_back(i);
    }
    for (SideStream& ss : side_streams_) {
      CUDA_CHECK(cudaEventRecord(ss.done, ss.stream));
      CUDA_CHECK(cudaStreamWaitEvent(main, ss.done, 0));
    }
    for (size_t i : later) {
      const GemmProblem& p = ps[i];
      Tensor c = p.c;
      if (p.bias.defined())
        Backend::do_gemm_bias(p.a, trans_a, p.b, trans_b, c, p.bias);
      else
        gemm(p.a, trans_a, p.b, trans_b, c, 1.0, beta);
    }
  }

  // The whole group in one cublasGemmGroupedBatchedEx call (each problem a group of one), the
  // biases added after it; false (nothing issued) where cuBLAS does not take the group.
  bool cublas_grouped(const std::vector<GemmProblem>& ps, const std::vector<GemmDims>& dims,
                      bool trans_a, bool trans_b, double beta) {
    const DType c_t = ps[0].c.dtype();
    std::vector<int> m, n, k, lda, ldb, ldc, ones;
    std::vector<const void*> ptrs;  // all A, then all B, then all C (cuBLAS's names)
    std::vector<size_t> used, zero_k;
    for (size_t i = 0; i < ps.size(); ++i) {
      const GemmProblem& p = ps[i];
      if (p.a.dtype() != DType::kBF16 || p.c.dtype() != c_t) return false;
      if (dims[i].m == 0 || dims[i].n == 0) continue;
      if (dims[i].k == 0) {  // c = beta c: gemm's own case, after the group
        zero_k.push_back(i);
        continue;
      }
      used.push_back(i);
      m.push_back(dims[i].n);
      n.push_back(dims[i].m);
      k.push_back(dims[i].k);
      lda.push_back(static_cast<int>(p.b.dim(1)));
      ldb.push_back(static_cast<int>(p.a.dim(1)));
      ldc.push_back(dims[i].n);
      ones.push_back(1);
    }
    const int g = static_cast<int>(used.size());
    if (g == 0 || g > cuda::kMaxStoredPointers / 3) return false;
    for (size_t i : used) ptrs.push_back(ps[i].b.raw());
    for (size_t i : used) ptrs.push_back(ps[i].a.raw());
    for (size_t i : used) ptrs.push_back(ps[i].c.raw());
    Tensor dev = Tensor::empty(*alloc_, {static_cast<int64_t>(ptrs.size())}, DType::kI64);
    cuda::launch_store_pointers(ptrs.data(), static_cast<int>(ptrs.size()),
                                reinterpret_cast<void**>(dev.raw()), cur_stream());
    void** d = reinterpret_cast<void**>(dev.raw());
    const std::vector<cublasOperation_t> ta(g, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N),
        tb(g, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
    const std::vector<float> alpha(g, 1.f), beta_v(g, static_cast<float>(beta));
    const cudaDataType c_type = c_t == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasStatus_t rc = cublasGemmGroupedBatchedEx(
        cublas_, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(), d, CUDA_R_16BF,
        lda.data(), d + g, CUDA_R_16BF, ldb.data(), beta_v.data(), d + 2 * g, c_type, ldc.data(), g,
        ones.data(), CUBLAS_COMPUTE_32F);
    if (rc == CUBLAS_STATUS_NOT_SUPPORTED || rc == CUBLAS_STATUS_INVALID_VALUE) return false;
    CUBLAS_CHECK(rc);
    for (size_t i : used) mark_written(ps[i].c, cur_stream());
    for (size_t i : zero_k) {
      Tensor c = ps[i].c;
      gemm(ps[i].a, trans_a, ps[i].b, trans_b, c, 1.0, beta);
    }
    for (const GemmProblem& p : ps) {
      if (!p.bias.defined()) continue;
      cuda::launch_add_bias(p.c.raw(), p.c.dtype(), p.bias.raw(), p.bias.dtype(), p.c.dim(0),
                            p.c.dim(1), cur_stream());
    }
    return true;
  }

  void do_add_bias(Tensor& y, const Tensor& bias) override {
    check_float("add_bias", "y", y);
    check_float("add_bias", "bias", bias);
    cuda::launch_add_bias(y.raw(), y.dtype(), bias.raw(), bias.dtype(), y.dim(0), y.dim(1),
                          cur_stream());
  }

  void do_bias_grad(const Tensor& dy, Tensor& db) override {
    check_float("bias_grad", "dy", dy);
    check_dtype("bias_grad", "db", db, DType::kF32);
    cuda::launch_bias_grad(dy.raw(), dy.dtype(), dy.dim(0), dy.dim(1), db.data<float>(), *alloc_,
                           cur_stream());
  }

  void do_bias_grad_segments(const Tensor& dy, const std::vector<RowSegment>& segments) override {
    check_float("bias_grad_segments", "dy", dy);
    std::vector<cuda::RowSegmentRef> refs;
    refs.reserve(segments.size());
    for (const RowSegment& g : segments) {
      check_dtype("bias_grad_segments", "db", g.db, DType::kF32);
      refs.push_back({g.begin, g.rows, g.db.data<float>()});
    }
    cuda::launch_bias_grad_segments(dy.raw(), dy.dtype(), dy.dim(1), refs, *alloc_, cur_stream());
  }

  void do_add(const Tensor& a, const Tensor& b, Tensor& out) override {
    check_float("add", "a", a);
    check_float("add", "b", b);
    check_float("add", "out", out);
    HP_CHECK(a.dtype() == b.dtype() && a.dtype() == out.dtype(), "add: a ", a.desc(), ", b ",
             b.desc(), " and out ", out.desc(), " must have one dtype");
    cuda::launch_add(a.raw(), b.raw(), out.raw(), a.dtype(), a.numel(), cur_stream());
  }

  void do_axpy(double alpha, const Tensor& x, Tensor& y) override {
    check_float("axpy", "x", x);
    check_float("axpy", "y", y);
    cuda::launch_axpy(alpha, x.raw(), x.dtype(), y.raw(), y.dtype(), x.numel(), cur_stream());
  }

  // ---- normalization and position
  // -----------------------------------------------------------------

  void do_rmsnorm_fwd(const Tensor& x, const Tensor& w, double eps, Tensor& y,
                      Tensor& rstd) override {
    const char* op = "rmsnorm_fwd";
    check_float(op, "x", x);
    const int64_t m = x.dim(0), d = x.dim(1);
    check_float(op, "w", w);
    check_dtype(op, "y", y, x.dtype());
    check_dtype(op, "rstd", rstd, DType::kF32);
    cuda::launch_rmsnorm_fwd(x.raw(), x.dtype(), w.raw(), w.dtype(), static_cast<float>(eps),
                             y.raw(), rstd.data<float>(), m, d, cur_stream());
  }

  void do_rmsnorm_bwd(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                      Tensor& dx, Tensor& dw, bool accumulate_dx) override {
    const char* op = "rmsnorm_bwd";
    check_float(op, "x", x);
    const int64_t m = x.dim(0), d = x.dim(1);
    check_float(op, "w", w);
    check_dtype(op, "rstd", rstd, DType::kF32);
    check_dtype(op, "dy", dy, x.dtype());
    check_dtype(op, "dx", dx, x.dtype());
    check_dtype(op, "dw", dw, DType::kF32);
    cuda::launch_rmsnorm_bwd(x.raw(), x.dtype(), w.raw(), w.dtype(), rstd.data<float>(), dy.raw(),
                             dx.raw(), dw.data<float>(), m, d, accumulate_dx, *alloc_,
                             cur_stream());
  }

  void do_rope(Tensor& x, int n_rot_heads, const Tensor& positions, const RopeTable& table,
               bool inverse) override {
    const char* op = "rope";
    check_float(op, "x", x);
    const int64_t n = x.dim(0), h = x.dim(1), d = x.dim(2);
    check_i32(op, "positions", positions);
    const int64_t n_pos = table.cos.dim(0);
    check_dtype(op, "table.cos", table.cos, DType::kF32);
    check_dtype(op, "table.sin", table.sin, DType::kF32);
    cuda::launch_rope(x.raw(), x.dtype(), n, static_cast<int>(h), n_rot_heads, static_cast<int>(d),
                      positions.data<int32_t>(), table.cos.data<float>(), table.sin.data<float>(),
                      n_pos, inverse, cur_stream());
  }

  void do_qk_norm_fwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw, int64_t n_heads,
                      int64_t n_kv_heads, double eps, Tensor& out, Tensor& rstd) override {
    const char* op = "qk_norm_fwd";
    check_qk_norm(op, qkv, qw, kw);
    const int64_t n = qkv.dim(0);
    check_dtype(op, "out", out, qkv.dtype());
    check_dtype(op, "rstd", rstd, DType::kF32);
    cuda::launch_qk_norm_fwd(qkv.raw(), qkv.dtype(), qw.raw(), kw.raw(), qw.dtype(), n,
                             static_cast<int>(qkv.dim(1)), static_cast<int>(n_heads),
                             static_cast<int>(n_kv_heads), static_cast<int>(qkv.dim(2)),
                             static_cast<float>(eps), out.raw(), rstd.data<float>(), cur_stream());
  }

  void do_qk_norm_bwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw, int64_t n_heads,
                      int64_t n_kv_heads, const Tensor& rstd, const Tensor& dout, Tensor& din,
                      Tensor& dqw, Tensor& dkw) override {
    const char* op = "qk_norm_bwd";
    check_qk_norm(op, qkv, qw, kw);
    const int64_t n = qkv.dim(0), d = qkv.dim(2);
    check_dtype(op, "rstd", rstd, DType::kF32);
    check_dtype(op, "dout", dout, qkv.dtype());
    check_dtype(op, "din", din, qkv.dtype());
    check_dtype(op, "dqw", dqw, DType::kF32);
    check_dtype(op, "dkw", dkw, DType::kF32);
    cuda::launch_qk_norm_bwd(qkv.raw(), qkv.dtype(), qw.raw(), kw.raw(), qw.dtype(), n,
                             static_cast<int>(qkv.dim(1)), static_cast<int>(n_heads),
                             static_cast<int>(n_kv_heads), static_cast<int>(d), rstd.data<float>(),
                             dout.raw(), din.raw(), dqw.data<float>(), dkw.data<float>(), *alloc_,
                             cur_stream());
  }

  // One pass where the heads are 16-byte rows the fused kernels take (Qwen3's 128 bf16 among
  // them), else the two ops.
  void do_qk_norm_rope_fwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw, int64_t n_heads,
                           int64_t n_kv_heads, double eps, const Tensor& positions,
                           const RopeTable& table, Tensor& out, Tensor& rstd) override {
    const char* op = "qk_norm_rope_fwd";
    check_qk_norm(op, qkv, qw, kw);
    check_dtype(op, "out", out, qkv.dtype());
    check_dtype(op, "rstd", rstd, DType::kF32);
    check_rope_table(op, positions, table);
    if (cuda::launch_qk_norm_rope_fwd(
            qkv.raw(), qkv.dtype(), qw.raw(), kw.raw(), qw.dtype(), qkv.dim(0),
            static_cast<int>(qkv.dim(1)), static_cast<int>(n_heads), static_cast<int>(n_kv_heads),
            static_cast<int>(qkv.dim(2)), static_cast<float>(eps), positions.data<int32_t>(),
            table.cos.data<float>(), table.sin.data<float>(), table.cos.dim(0), out.raw(),
            rstd.data<float>(), cur_stream()))
      return;
    Backend::do_qk_norm_rope_fwd(qkv, qw, kw, n_heads, n_kv_heads, eps, positions, table, out,
                                 rstd);
  }

  // ---- attention
  // ------------------------------------------------------------------------------------

  void do_attention_fwd(const Tensor& qkv, const Tensor& sinks, const BatchMeta& meta,
                        const AttentionShape& shape, Tensor& out, Tensor& lse) override {
    const char* op = "attention_fwd";
    cuda::AttnArgs args = attention_args(op, qkv, sinks, meta, shape);
    check_dtype(op, "out", out, DType::kBF16);
    check_dtype(op, "lse", lse, DType::kF32);
    if (const cuda::CudnnBatch* cb = cudnn_batch(args, meta, {out.raw()})) {
      cudnn_->forward(args, *cb, out.raw(), lse.data<float>(), *alloc_, cur_stream());
    } else if (tensor_core_ok(args, {out.raw()})) {
      cuda::launch_attention_fwd(args, out.raw(), lse.data<float>(), cur_stream());
    } else if (args.n_tiles > 0) {
      cuda::launch_attention_simple_fwd(args, out.raw(), lse.data<float>(), cur_stream());
    }
  }

  void do_attention_bwd(const Tensor& qkv, const Tensor& sinks, const BatchMeta& meta,
                        const AttentionShape& shape, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dqkv, Tensor& dsinks) override {
    const char* op = "attention_bwd";
    cuda::AttnArgs args = attention_args(op, qkv, sinks, meta, shape);
    check_dtype(op, "out", out, DType::kBF16);
    check_dtype(op, "lse", lse, DType::kF32);
    check_dtype(op, "dout", dout, DType::kBF16);
    check_dtype(op, "dqkv", dqkv, DType::kBF16);
    float* dsinks_p = nullptr;
    if (sinks.defined()) {
      check_dtype(op, "dsinks", dsinks, DType::kF32);
      dsinks_p = dsinks.data<float>();
    }
    const cuda::CudnnBatch* cb = cudnn_batch(args, meta, {out.raw(), dout.raw(), dqkv.raw()});
    // Deterministic results need cuDNN's atomic-free backward, whose workspace grows with the
    // square of the sequence length; past kCudnnDeterministicBytes the tiled backward (also
    // deterministic, same lse contract) takes over from cuDNN's forward.
    if (cb && options_.deterministic &&
        cuda::CudnnAttention::deterministic_workspace_bytes(*cb, args) > kCudnnDeterministicBytes)
      cb = nullptr;
    if (cb) {
      cudnn_->backward(args, *cb, out.raw(), lse.data<float>(), dout.raw(), dqkv.raw(), dsinks_p,
                       options_.deterministic, *alloc_, cur_stream());
      return;
    }
    if (!tensor_core_ok(args, {out.raw(), dout.raw(), dqkv.raw()})) args.force_simple = true;
    cuda::launch_attention_bwd(args, out.raw(), lse.data<float>(), dout.raw(), dqkv.raw(), dsinks_p,
                               *alloc_, cur_stream());
  }

  // ---- feed-forward activations -----------------------------------------------------------------

  void do_glu_fwd(const Tensor& h, const GluParams& p, Tensor& a) override {
    const char* op = "glu_fwd";
    check_float(op, "h", h);
    check_dtype(op, "a", a, h.dtype());
    const int64_t m = h.dim(0), f = h.dim(1) / 2;
    cuda::launch_glu_fwd(h.raw(), a.raw(), h.dtype(), m, f, p.kind == GluKind::kGptOss ? 1 : 0,
                         static_cast<float>(p.alpha), static_cast<float>(p.limit), cur_stream());
  }

  // The GLU or the loss with its output quantized for the next FP8 product (fp8_gemm.h): where
  // the fused kernels take the shape (bf16, a width that is a multiple of 128) and the spec is
  // the device's block128 with a data operand a; otherwise the plain op, and the product
  // quantizes a itself.
  bool fused_fp8_spec(const Fp8Gemm& spec) const {
    fp8::Recipe native{};
    return cuda::fp8_device_recipe(cc_major_, &native) && spec.recipe == native &&
           spec.recipe == fp8::Recipe::kBlock128 && spec.a == fp8::Role::kData;
  }
  void do_glu_fwd_fp8(const Tensor& h, const GluParams& p, Tensor& a,
                      const Fp8Gemm& spec) override {
    check_float("glu_fwd_fp8", "h", h);
    check_dtype("glu_fwd_fp8", "a", a, h.dtype());
    const int64_t m = h.dim(0), f = h.dim(1) / 2;
    if (fused_fp8_spec(spec) && h.dtype() == DType::kBF16 && a.dtype() == DType::kBF16 &&
        f % 128 == 0) {
      cuda::Fp8Operand q = cuda::fp8_empty_operand(
          *alloc_, cuda::fp8_layout(m, f, spec.recipe, fp8::Role::kData, 4));
      if (cuda::launch_glu_fwd_fp8(h.raw(), a.raw(), h.dtype(), m, f,
                                   p.kind == GluKind::kGptOss ? 1 : 0, static_cast<float>(p.alpha),
                                   static_cast<float>(p.limit), q.layout, q.codes.raw(),
                                   q.scales.raw(), cur_stream())) {
        fp8_held_.set_next_data(a, std::move(q), spec.recipe);
        return;
      }
    }
    do_glu_fwd(h, p, a);
  }
  void do_glu_bwd_fp8(const Tensor& h, const Tensor& da, const GluParams& p, Tensor& dh,
                      const Fp8Gemm& spec) override {
    check_float("glu_bwd_fp8", "h", h);
    check_dtype("glu_bwd_fp8", "da", da, h.dtype());
    check_dtype("glu_bwd_fp8", "dh", dh, h.dtype());
    const int64_t m = h.dim(0), f = h.dim(1) / 2;
    if (fused_fp8_spec(spec) && h.dtype() == DType::kBF16 && da.dtype() == DType::kBF16 &&
        dh.dtype() == DType::kBF16 && f % 128 == 0) {
      cuda::Fp8Operand q = cuda::fp8_empty_operand(
          *alloc_, cuda::fp8_layout(m, 2 * f, spec.recipe, fp8::Role::kData, 4));
      if (cuda::launch_glu_bwd_fp8(h.raw(), da.raw(), dh.raw(), h.dtype(), m, f,
                                   p.kind == GluKind::kGptOss ? 1 : 0, static_cast<float>(p.alpha),
                                   static_cast<float>(p.limit), q.layout, q.codes.raw(),
                                   q.scales.raw(), cur_stream())) {
        fp8_held_.set_next_data(dh, std::move(q), spec.recipe);
        return;
      }
    }
    do_glu_bwd(h, da, p, dh);
  }

  void do_glu_bwd(const Tensor& h, const Tensor& da, const GluParams& p, Tensor& dh) override {
    const char* op = "glu_bwd";
    check_float(op, "h", h);
    check_dtype(op, "da", da, h.dtype());
    check_dtype(op, "dh", dh, h.dtype());
    const int64_t m = h.dim(0), f = h.dim(1) / 2;
    cuda::launch_glu_bwd(h.raw(), da.raw(), dh.raw(), h.dtype(), m, f,
                         p.kind == GluKind::kGptOss ? 1 : 0, static_cast<float>(p.alpha),
                         static_cast<float>(p.limit), cur_stream());
  }

  // ---- mixture-of-experts routing
  // -----------------------------------------------------------------

  void do_router_topk(const Tensor& logits, int k, Tensor& idx, Tensor& w) override {
    const char* op = "router_topk";
    check_float(op, "logits", logits);
    const int64_t n = logits.dim(0), e = logits.dim(1);
    HP_CHECK(k <= 32 && e <= 256, op, ": k = ", k, ", E = ", e,
             " (the kernel takes k <= 32, E <= 256)");
    check_i32(op, "idx", idx);
    check_float(op, "w", w);
    cuda::launch_router_topk(logits.raw(), logits.dtype(), n, static_cast<int>(e), k,
                             idx.data<int32_t>(), w.raw(), w.dtype(), cur_stream());
  }

  void do_router_topk_bwd(const Tensor& idx, const Tensor& w, const Tensor& dw,
                          Tensor& dlogits) override {
    const char* op = "router_topk_bwd";
    check_i32(op, "idx", idx);
    const int64_t n = idx.dim(0), k = idx.dim(1);
    check_float(op, "w", w);
    check_dtype(op, "dw", dw, w.dtype());
    check_float(op, "dlogits", dlogits);
    cuda::launch_router_topk_bwd(idx.data<int32_t>(), w.raw(), dw.raw(), w.dtype(), n,
                                 static_cast<int>(dlogits.dim(1)), static_cast<int>(k),
                                 dlogits.raw(), dlogits.dtype(), cur_stream());
  }

  void do_router_aux_loss(const Tensor& logits, const Tensor& counts, int k, double coef,
                          Tensor& loss, Tensor& dlogits) override {
    const char* op = "router_aux_loss";
    check_float(op, "logits", logits);
    const int64_t n = logits.dim(0), e = logits.dim(1);
    check_i32(op, "counts", counts);
    check_dtype(op, "loss", loss, DType::kF32);
    check_dtype(op, "dlogits", dlogits, logits.dtype());
    cuda::launch_router_aux_loss(logits.raw(), logits.dtype(), counts.data<int32_t>(), n,
                                 static_cast<int>(e), k, static_cast<float>(coef),
                                 loss.data<float>(), dlogits.raw(), *alloc_, cur_stream());
  }

  void do_histogram(const Tensor& ids, int n_bins, Tensor& counts) override {
    const char* op = "histogram";
    check_i32(op, "ids", ids);
    HP_CHECK(n_bins >= 1, op, ": n_bins = ", n_bins, " must be positive (the kernel's limit)");
    check_i32(op, "counts", counts);
    cuda::launch_histogram(ids.data<int32_t>(), ids.numel(), n_bins, counts.data<int32_t>(),
                           cur_stream());
  }

  void do_exclusive_scan(const Tensor& counts, Tensor& offsets) override {
    const char* op = "exclusive_scan";
    check_i32(op, "counts", counts);
    check_i32(op, "offsets", offsets);
    cuda::launch_exclusive_scan(counts.data<int32_t>(), counts.numel(), offsets.data<int32_t>(),
                                *alloc_, cur_stream());
  }

  void do_sort_by_id(const Tensor& ids, const Tensor& offsets, Tensor& sorted_to_assign,
                     Tensor& assign_to_sorted) override {
    const char* op = "sort_by_id";
    const int64_t m = ids.numel();
    check_i32(op, "ids", ids);
    check_i32(op, "offsets", offsets);
    HP_CHECK(offsets.numel() >= 2, op, ": offsets ", offsets.desc(),
             " needs n_bins >= 1 (the kernel's limit)");
    check_i32(op, "sorted_to_assign", sorted_to_assign);
    check_i32(op, "assign_to_sorted", assign_to_sorted);
    cuda::launch_sort_by_id(ids.data<int32_t>(), m, static_cast<int>(offsets.numel() - 1),
                            sorted_to_assign.data<int32_t>(), assign_to_sorted.data<int32_t>(),
                            *alloc_, cur_stream());
  }

  void do_permute_rows(const Tensor& x, const Tensor& sorted_to_assign, int k,
                       Tensor& out) override {
    const char* op = "permute_rows";
    check_float(op, "x", x);
    const int64_t m = sorted_to_assign.numel(), d = x.dim(1);
    check_i32(op, "sorted_to_assign", sorted_to_assign);
    check_dtype(op, "out", out, x.dtype());
    cuda::launch_permute_rows(x.raw(), x.dtype(), d, sorted_to_assign.data<int32_t>(), m, k,
                              out.raw(), cur_stream());
  }

  void do_permute_rows_bwd(const Tensor& dout, const Tensor& sorted_to_assign, int k,
                           Tensor& dx) override {
    const char* op = "permute_rows_bwd";
    check_float(op, "dx", dx);
    const int64_t n = dx.dim(0), d = dx.dim(1), m = sorted_to_assign.numel();
    check_i32(op, "sorted_to_assign", sorted_to_assign);
    check_dtype(op, "dout", dout, dx.dtype());
    cuda::launch_permute_rows_bwd(dout.raw(), dout.dtype(), d, sorted_to_assign.data<int32_t>(), m,
                                  k, n, dx.raw(), *alloc_, cur_stream());
  }

  void do_unpermute_combine(const Tensor& y, const Tensor& assign_to_sorted, const Tensor& w,
                            Tensor& out) override {
    const char* op = "unpermute_combine";
    check_float(op, "y", y);
    check_float(op, "w", w);
    const int64_t m = y.dim(0), d = y.dim(1), n = w.dim(0), k = w.dim(1);
    check_i32(op, "assign_to_sorted", assign_to_sorted);
    check_dtype(op, "out", out, y.dtype());
    cuda::launch_unpermute_combine(y.raw(), y.dtype(), d, assign_to_sorted.data<int32_t>(), m,
                                   w.raw(), w.dtype(), n, static_cast<int>(k), out.raw(),
                                   cur_stream());
  }

  void do_unpermute_combine_bwd(const Tensor& dout, const Tensor& y, const Tensor& assign_to_sorted,
                                const Tensor& w, Tensor& dy, Tensor& dw) override {
    const char* op = "unpermute_combine_bwd";
    check_float(op, "y", y);
    check_float(op, "w", w);
    const int64_t m = y.dim(0), d = y.dim(1), n = w.dim(0), k = w.dim(1);
    check_i32(op, "assign_to_sorted", assign_to_sorted);
    check_dtype(op, "dout", dout, y.dtype());
    check_dtype(op, "dy", dy, y.dtype());
    check_dtype(op, "dw", dw, w.dtype());
    // Rows of y no assignment reads get a zero gradient. With as many rows as assignments, each
    // row is read once (assign_to_sorted names a row once at most), so the kernel writes all.
    if (m != n * k) fill(dy, 0.0);
    cuda::launch_unpermute_combine_bwd(dout.raw(), y.raw(), y.dtype(), d,
                                       assign_to_sorted.data<int32_t>(), m, w.raw(), w.dtype(), n,
                                       static_cast<int>(k), dy.raw(), dw.raw(), cur_stream());
  }

  // ---- embedding and loss
  // -------------------------------------------------------------------------

  void do_embedding_fwd(const Tensor& table, const Tensor& ids, Tensor& out) override {
    const char* op = "embedding_fwd";
    check_float(op, "table", table);
    const int64_t v = table.dim(0), d = table.dim(1), n = ids.numel();
    check_i32(op, "ids", ids);
    check_float(op, "out", out);
    cuda::launch_embedding_fwd(table.raw(), table.dtype(), v, ids.data<int32_t>(), n, d, out.raw(),
                               out.dtype(), cur_stream());
  }

  void do_embedding_bwd(const Tensor& dout, const Tensor& ids, Tensor& dtable) override {
    const char* op = "embedding_bwd";
    check_dtype(op, "dtable", dtable, DType::kF32);
    const int64_t v = dtable.dim(0), d = dtable.dim(1), n = ids.numel();
    check_i32(op, "ids", ids);
    check_float(op, "dout", dout);
    cuda::launch_embedding_bwd(dout.raw(), dout.dtype(), ids.data<int32_t>(), n, d, v,
                               dtable.data<float>(), *alloc_, cur_stream());
  }

  void do_cross_entropy(Tensor& logits, const Tensor& targets, double grad_scale,
                        Tensor& loss) override {
    const char* op = "cross_entropy";
    check_float(op, "logits", logits);
    const int64_t n = logits.dim(0), v = logits.dim(1);
    check_i32(op, "targets", targets);
    check_dtype(op, "loss", loss, DType::kF32);
    HP_CHECK(n <= std::numeric_limits<int32_t>::max(), op, ": too many rows");
    cuda::launch_cross_entropy(logits.raw(), logits.dtype(), targets.data<int32_t>(), n, v,
                               static_cast<float>(grad_scale), loss.data<float>(), *alloc_,
                               cur_stream());
  }
  void do_cross_entropy_fp8(Tensor& logits, const Tensor& targets, double grad_scale, Tensor& loss,
                            const Fp8Gemm& spec) override {
    const char* op = "cross_entropy_fp8";
    check_float(op, "logits", logits);
    check_i32(op, "targets", targets);
    check_dtype(op, "loss", loss, DType::kF32);
    const int64_t n = logits.dim(0), v = logits.dim(1);
    HP_CHECK(n <= std::numeric_limits<int32_t>::max(), op, ": too many rows");
    if (fused_fp8_spec(spec) && logits.dtype() == DType::kBF16 && v % 128 == 0) {
      cuda::Fp8Operand q = cuda::fp8_empty_operand(
          *alloc_, cuda::fp8_layout(n, v, spec.recipe, fp8::Role::kData, 4));
      if (cuda::launch_cross_entropy_fp8(logits.raw(), logits.dtype(), targets.data<int32_t>(), n,
                                         v, static_cast<float>(grad_scale), loss.data<float>(),
                                         q.layout, q.codes.raw(), q.scales.raw(), *alloc_,
                                         cur_stream())) {
        fp8_held_.set_next_data(logits, std::move(q), spec.recipe);
        return;
      }
    }
    do_cross_entropy(logits, targets, grad_scale, loss);
  }

  // ---- optimizer
  // ----------------------------------------------------------------------------------

  void do_sum_squares(const Tensor& x, Tensor& acc) override {
    check_float("sum_squares", "x", x);
    check_dtype("sum_squares", "acc", acc, DType::kF32);
    cuda::launch_sum_squares(x.raw(), x.dtype(), x.numel(), acc.data<float>(), *alloc_,
                             cur_stream());
  }

  void do_update_gate(const Tensor& checked, const Tensor& sumsq, double max_norm,
                      Tensor& gate) override {
    const char* op = "update_gate";
    check_dtype(op, "checked", checked, DType::kF32);
    check_dtype(op, "sumsq", sumsq, DType::kF32);
    check_dtype(op, "gate", gate, DType::kF64);
    cuda::launch_update_gate(checked.data<float>(), checked.numel(), sumsq.data<float>(),
                             sumsq.numel(), max_norm, gate.data<double>(), cur_stream());
  }

  void do_adamw(Tensor& master, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p,
                Tensor& working) override {
    const char* op = "adamw";
    const int64_t n = master.numel();
    check_dtype(op, "master", master, DType::kF32);
    check_dtype(op, "grad", grad, DType::kF32);
    check_dtype(op, "m", m, DType::kF32);
    check_dtype(op, "v", v, DType::kF32);
    if (p.gate != nullptr) check_dtype(op, "gate", *p.gate, DType::kF64);
    if (p.check_flag != nullptr) {
      // Check only: the same arithmetic, nothing written but the flag.
      Tensor& flag = *p.check_flag;
      check_dtype(op, "check_flag", flag, DType::kF32);
      const DType wt = working.defined() ? working.dtype() : DType::kF32;
      HP_CHECK(wt == DType::kF32 || wt == DType::kBF16, op, ": working ", working.desc(),
               " must be f32 or bf16");
      cuda::launch_adamw_check(master.data<float>(), grad.data<float>(), m.data<float>(),
                               v.data<float>(), n, adamw_scalars(p), wt, flag.data<float>(),
                               cur_stream());
      return;
    }
    void* work = nullptr;
    if (working.defined() && !(working.raw() == master.raw() && working.dtype() == DType::kF32)) {
      check_float(op, "working", working);
      work = working.raw();
    }
    cuda::launch_adamw(master.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(),
                       n, adamw_scalars(p), work, work ? working.dtype() : DType::kF32,
                       cur_stream());
  }

  void do_sum_squares_many(const std::vector<Tensor>& xs, Tensor& acc,
                           const std::vector<char>& unwritten) override {
    const char* op = "sum_squares_many";
    check_dtype(op, "acc", acc, DType::kF32);
    std::vector<cuda::SumSquaresRef> refs;
    refs.reserve(xs.size());
    for (size_t i = 0; i < xs.size(); ++i) {
      const std::string name = "xs[" + std::to_string(i) + "]";
      check_float(op, name.c_str(), xs[i]);
      const bool zero = !unwritten.empty() && unwritten[i];
      refs.push_back({zero ? nullptr : xs[i].raw(), xs[i].dtype(), xs[i].numel()});
    }
    cuda::launch_sum_squares_many(refs, acc.data<float>(), *alloc_, cur_stream());
  }

  void do_adamw_many(const std::vector<AdamWEntry>& entries, const AdamWParams& p) override {
    if (p.gate != nullptr) check_dtype("adamw_many", "gate", *p.gate, DType::kF64);
    std::vector<cuda::AdamWRef> refs;
    refs.reserve(entries.size());
    for (size_t i = 0; i < entries.size(); ++i) {
      const AdamWEntry& e = entries[i];
      // As do_adamw: a working copy that is the f32 master itself is none.
      const Tensor& w = e.working;
      const bool has_work =
          w.defined() && !(w.raw() == e.master.raw() && w.dtype() == DType::kF32);
      const auto on_gpu = [](const Tensor& t, DType a, DType b) {
        return t.defined() && t.device() == Device::kCUDA && (t.dtype() == a || t.dtype() == b);
      };
      const DType f32 = DType::kF32;
      if (!on_gpu(e.master, f32, f32) || !on_gpu(e.grad, f32, f32) || !on_gpu(e.m, f32, f32) ||
          !on_gpu(e.v, f32, f32) || (has_work && !on_gpu(w, f32, DType::kBF16))) {
        // The message names the entry (built only here: the list is long and comes every step).
        const std::string where = "adamw_many: entry " + std::to_string(i);
        const char* op = where.c_str();
        check_dtype(op, "master", e.master, DType::kF32);
        check_dtype(op, "grad", e.grad, DType::kF32);
        check_dtype(op, "m", e.m, DType::kF32);
        check_dtype(op, "v", e.v, DType::kF32);
        if (has_work) check_float(op, "working", w);
      }
      void* work = has_work ? w.raw() : nullptr;
      refs.push_back({e.master.data<float>(), e.grad_zero ? nullptr : e.grad.data<float>(),
                      e.m.data<float>(), e.v.data<float>(), work, work ? w.dtype() : DType::kF32,
                      e.master.numel(), e.weight_decay});
    }
    cuda::launch_adamw_many(refs, adamw_scalars(p), cur_stream());
  }

  static cuda::AdamWScalars adamw_scalars(const AdamWParams& p) {
    cuda::AdamWScalars s;
    s.lr = static_cast<float>(p.lr);
    s.beta1 = static_cast<float>(p.beta1);
    s.beta2 = static_cast<float>(p.beta2);
    s.eps = static_cast<float>(p.eps);
    s.weight_decay = static_cast<float>(p.weight_decay);
    s.grad_scale = static_cast<float>(p.grad_scale);
    s.gate = p.gate != nullptr ? p.gate->data<double>() : nullptr;
    s.bias_correction1 = static_cast<float>(1.0 - std::pow(p.beta1, static_cast<double>(p.step)));
    s.bias_correction2 = static_cast<float>(1.0 - std::pow(p.beta2, static_cast<double>(p.step)));
    return s;
  }

 private:
  struct CudaEvent final : Event, std::enable_shared_from_this<CudaEvent> {
    cudaEvent_t event = nullptr;
    StreamKind stream = StreamKind::kCompute;
    // Under a link arbiter, a copy-stream event is recorded by the copy issuer: the position of
    // that record among the issuer's operations (0: recorded when made).
    uint64_t issue_seq = 0;
    ~CudaEvent() override {
      if (event) cudaEventDestroy(event);
    }
  };

  static const CudaEvent& as_cuda_event_object(const Event& e) {
    const auto* c = dynamic_cast<const CudaEvent*>(&e);
    HP_CHECK(c != nullptr, "event was not recorded by a CUDA backend");
    return *c;
  }

  // ---- copy-stream issue under a link arbiter ----------------------------------------------
  // With an arbiter, the driving thread queues the copy stream's operations (copies, event
  // records, waits for other streams' events) to one issuer thread, which issues them in order.
  // Before a copy's first chunk it waits on the host for the events the copy stream was told to
  // wait for (so a grant is not held while the copy waits for compute), then per chunk: request
  // a grant, wait for it, cudaMemcpyAsync on the copy stream, and a host callback after it on
  // the same stream that releases the grant once the chunk has completed (no CUDA calls in it).
  struct IssueOp {
    enum Kind { kCopy, kRecord, kWait } kind = kCopy;
    Tensor src, dst;  // kCopy: held until issued
    CopyDirection dir = CopyDirection::kOffload;
    std::shared_ptr<CudaEvent> event;  // kRecord, kWait
    uint64_t seq = 0;
  };
  struct PendingRelease {
    LinkArbiter* arbiter;
    LinkTicket ticket;
  };

  static void CUDART_CB release_chunk(void* p) {
    std::unique_ptr<PendingRelease> r(static_cast<PendingRelease*>(p));
    try {
      r->arbiter->release(r->ticket);
    } catch (...) {
      // A host callback must not throw; release fails only for a ticket never granted.
    }
  }

  uint64_t enqueue_issue(IssueOp::Kind kind, const Tensor& src, const Tensor& dst,
                         CopyDirection dir, std::shared_ptr<CudaEvent> event = nullptr) {
    uint64_t seq;
    {
      std::lock_guard<std::mutex> lock(issue_mu_);
      if (issue_error_) std::rethrow_exception(issue_error_);
      seq = ++issue_enqueued_;
      IssueOp op;
      op.kind = kind;
      op.src = src;
      op.dst = dst;
      op.dir = dir;
      op.event = std::move(event);
      op.seq = seq;
      issue_q_.push_back(std::move(op));
    }
    issue_cv_.notify_one();
    return seq;
  }

  uint64_t issue_enqueued() {
    std::lock_guard<std::mutex> lock(issue_mu_);
    return issue_enqueued_;
  }

  // Blocks the calling thread until the issuer has issued operation `seq` (no device wait).
  void wait_issued(uint64_t seq) {
    std::unique_lock<std::mutex> lock(issue_mu_);
    issued_cv_.wait(lock, [&] { return issue_done_ >= seq; });
    if (issue_error_) std::rethrow_exception(issue_error_);
  }

  void issuer_loop() {
    std::vector<std::shared_ptr<CudaEvent>> gates;  // waited for before the next grant request
    std::exception_ptr error;
    if (cudaSetDevice(device_) != cudaSuccess) {
      cudaGetLastError();
      try {
        HP_FAIL(ErrorKind::kCuda, "copy issuer: cudaSetDevice(", device_, ") failed");
      } catch (...) {
        error = std::current_exception();
      }
    }
    std::unique_lock<std::mutex> lock(issue_mu_);
    if (error) issue_error_ = error;
    for (;;) {
      issue_cv_.wait(lock, [&] { return issue_stop_ || !issue_q_.empty(); });
      if (issue_q_.empty()) return;  // stopped with nothing left
      IssueOp op = std::move(issue_q_.front());
      issue_q_.pop_front();
      LinkArbiter* arbiter = arbiter_;
      const bool failed = issue_error_ != nullptr;
      lock.unlock();
      error = nullptr;
      if (!failed) {
        try {
          issue(op, arbiter, gates);
        } catch (...) {
          error = std::current_exception();
        }
      }
      const uint64_t seq = op.seq;
      op = IssueOp();  // drop the tensors and events before reporting the op issued
      lock.lock();
      if (error && !issue_error_) issue_error_ = error;
      issue_done_ = seq;
      issued_cv_.notify_all();
    }
  }

  void issue(IssueOp& op, LinkArbiter* arbiter, std::vector<std::shared_ptr<CudaEvent>>& gates) {
    cudaStream_t stream = streams_[static_cast<int>(StreamKind::kCopy)];
    switch (op.kind) {
      case IssueOp::kRecord:
        CUDA_CHECK(cudaEventRecord(op.event->event, stream));
        return;
      case IssueOp::kWait:
        CUDA_CHECK(cudaStreamWaitEvent(stream, op.event->event, 0));
        if (op.event->stream != StreamKind::kCopy) gates.push_back(op.event);
        return;
      case IssueOp::kCopy:
        break;
    }
    // The issuer's own host waits are not the driving thread's: they count no sync.
    for (const auto& g : gates) CUDA_CHECK(cudaEventSynchronize(g->event));
    gates.clear();
    const int64_t bytes = static_cast<int64_t>(op.src.nbytes());
    if (!arbiter) {
      CUDA_CHECK(cudaMemcpyAsync(op.dst.raw(), op.src.raw(), static_cast<size_t>(bytes),
                                 cudaMemcpyDefault, stream));
      return;
    }
    const int64_t step = arbiter->chunk_bytes();
    for (int64_t off = 0; off < bytes; off += step) {
      const int64_t n = std::min(step, bytes - off);
      auto release = std::make_unique<PendingRelease>(PendingRelease{arbiter, LinkTicket{}});
      release->ticket = arbiter->request(op.dir, n);
      arbiter->wait(release->ticket);  // throws after the arbiter's timeout
      cudaError_t st = cudaMemcpyAsync(static_cast<char*>(op.dst.raw()) + off,
                                       static_cast<const char*>(op.src.raw()) + off,
                                       static_cast<size_t>(n), cudaMemcpyDefault, stream);
      if (st == cudaSuccess) st = cudaLaunchHostFunc(stream, release_chunk, release.get());
      if (st != cudaSuccess) {
        arbiter->release(release->ticket);
        CUDA_CHECK(st);
      }
      release.release();  // owned by the callback now
    }
  }

  void stop_issuer() {
    {
      std::lock_guard<std::mutex> lock(issue_mu_);
      issue_stop_ = true;
    }
    issue_cv_.notify_all();
    if (issuer_.joinable()) issuer_.join();
  }

  static cudaEvent_t as_cuda_event(const Event& e) {
    const auto* c = dynamic_cast<const CudaEvent*>(&e);
    HP_CHECK(c != nullptr, "event was not recorded by a CUDA backend");
    return c->event;
  }

  // Ops run on the stream set_stream chose (the compute stream unless told otherwise).
  cudaStream_t cur_stream() const { return streams_[static_cast<int>(stream_)]; }

  static constexpr int64_t kCublasWorkspaceBytes = 32ll << 20;

  // Zeroed once: cuBLASLt's split-K kernels write partial sums there with stores
  // compute-sanitizer's initcheck does not see, and its reduction kernel reading them back would
  // be reported as reading uninitialized memory.
  Tensor new_cublas_workspace() {
    Tensor ws = Tensor::empty(*alloc_, {kCublasWorkspaceBytes / 4}, DType::kI32);
    CUDA_CHECK(cudaMemsetAsync(ws.raw(), 0, ws.nbytes(), compute_stream()));
    return ws;
  }

  static void check_qk_norm(const char* op, const Tensor& qkv, const Tensor& qw, const Tensor& kw) {
    check_float(op, "qkv", qkv);
    check_float(op, "qw", qw);
    check_dtype(op, "kw", kw, qw.dtype());
  }

  static void check_rope_table(const char* op, const Tensor& positions, const RopeTable& table) {
    check_i32(op, "positions", positions);
    check_dtype(op, "table.cos", table.cos, DType::kF32);
    check_dtype(op, "table.sin", table.sin, DType::kF32);
    HP_CHECK(positions.numel() == 0 || table.cos.dim(0) > 0, op,
             ": table.cos has no positions for ", positions.numel(), " tokens");
  }

  cuda::AttnArgs attention_args(const char* op, const Tensor& qkv, const Tensor& sinks,
                                const BatchMeta& meta, const AttentionShape& shape) const {
    HP_CHECK(shape.head_dim <= 256, op, ": head_dim ", shape.head_dim, " exceeds the kernels' 256");
    check_dtype(op, "qkv", qkv, DType::kBF16);
    const auto* extra = static_cast<const CudaBatchExtra*>(meta.backend_extra.get());
    HP_CHECK(extra != nullptr && extra->magic == kBatchExtraMagic && extra->device == device_, op,
             ": the BatchMeta was not made by this backend's upload_batch/rebuild_metadata");
    cuda::AttnArgs a;
    a.qkv = qkv.raw();
    if (sinks.defined()) {
      check_float(op, "sinks", sinks);
      a.sinks = sinks.raw();
      a.sinks_t = sinks.dtype();
    }
    a.tiles = extra->tiles;
    a.n_tiles = extra->n_tiles;
    a.n_tokens = qkv.dim(0);
    a.hq = shape.n_heads;
    a.hkv = shape.n_kv_heads;
    a.head_dim = shape.head_dim;
    a.window = shape.window;
    a.scale = static_cast<float>(shape.scale);
    return a;
  }

  // The batch as cuDNN reads it for this head shape, or null where the tiled kernels run.
  const cuda::CudnnBatch* cudnn_batch(const cuda::AttnArgs& a, const BatchMeta& meta,
                                      std::initializer_list<const void*> more) {
    if (!cudnn_ || !cudnn_->supports(a) || a.n_tiles == 0) return nullptr;
    // Sliding windows: the tiled kernels skip whole key tiles outside the window and beat
    // cuDNN's banded masks (measured on H200), so auto keeps them there.
    if (a.window > 0 && options_.attention == AttentionImpl::kAuto) return nullptr;
    for (const void* p : more)
      if (!aligned16(p)) return nullptr;
    const auto* extra = static_cast<const CudaBatchExtra*>(meta.backend_extra.get());
    for (const auto& e : extra->cudnn)
      if (e.hq == a.hq && e.hkv == a.hkv && e.d == a.head_dim) return &e.batch;
    extra->cudnn.push_back({a.hq, a.hkv, a.head_dim,
                            cudnn_->make_batch(a, meta.cu_seqlens.data<int32_t>(), meta.n_seqs,
                                               meta.max_seqlen, *alloc_, cur_stream())});
    return &extra->cudnn.back().batch;
  }

  // The tensor-core kernels move 16-byte vectors: every base pointer must be 16-byte aligned.
  static bool tensor_core_ok(const cuda::AttnArgs& a, std::initializer_list<const void*> more) {
    if (!cuda::attention_head_dim_fast(a.head_dim) || !aligned16(a.qkv)) return false;
    for (const void* p : more)
      if (!aligned16(p)) return false;
    return true;
  }

  int device_;
  int cc_major_ = 0, cc_minor_ = 0;  // compute capability
  CudaBackendOptions options_;
  CudaCachingAllocator* alloc_;
  cuda::LtGemm lt_;                              // bf16 GEMMs (lt_gemm.h)
  int64_t fp8_groups_batched_ = 0;
  std::unique_ptr<cuda::Fp8Lt> fp8_lt_;          // FP8 GEMMs (fp8_gemm.h), made at first use
  cuda::Fp8HeldOperands fp8_held_;               // Backend::hold_fp8_weights
  bool in_group_ = false;                        // inside gemm_group: products not tuned
  std::unique_ptr<cuda::CudnnAttention> cudnn_;  // null: the tiled kernels
  std::string attention_desc_;
  int64_t profile_mallocs_ = 0, profile_plans_ = 0;  // at profile_begin
  static constexpr int64_t kCudnnDeterministicBytes = int64_t{1} << 30;
  cudaStream_t streams_[3] = {};  // indexed by StreamKind: compute, copy, comm
  cublasHandle_t cublas_ = nullptr;
  Tensor cublas_workspace_;
  // Side streams of gemm_group_on_side_streams (made at its first use).
  static constexpr size_t kGemmStreams = 4;
  struct SideStream {
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
    Tensor workspace;
  };
  SideStream side_streams_[kGemmStreams - 1];
  cudaEvent_t fork_ = nullptr;
  PinnedStaging staging_;
  int32_t* info_host_ = nullptr;
  // The copy issuer (see IssueOp): started by the first set_link_arbiter with an arbiter.
  LinkArbiter* arbiter_ = nullptr;  // read by the driving thread; changed only when drained
  std::mutex issue_mu_;
  std::condition_variable issue_cv_, issued_cv_;
  std::deque<IssueOp> issue_q_;
  uint64_t issue_enqueued_ = 0, issue_done_ = 0;
  bool issue_stop_ = false;
  std::exception_ptr issue_error_;  // the first failure; fails every later copy-stream call
  std::thread issuer_;
};

CudaBackend& as_cuda(Backend& b) {
  auto* c = dynamic_cast<CudaBackend*>(&b);
  HP_CHECK(c != nullptr, "backend ", b.name(), " is not a CUDA backend");
  return *c;
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device_ordinal, const CudaBackendOptions& options) {
  return std::make_unique<CudaBackend>(device_ordinal, options);
}

std::string cuda_attention_description(Backend& b) { return as_cuda(b).attention_description(); }

CUstream_st* cuda_compute_stream(Backend& b) { return as_cuda(b).compute_stream(); }

CUstream_st* cuda_comm_stream(Backend& b) { return as_cuda(b).comm_stream(); }

int cuda_backend_device(Backend& b) { return as_cuda(b).device_ordinal(); }

int cuda_gemm_tuned_buckets(Backend& b) { return as_cuda(b).gemm_tuned_buckets(); }

int cuda_gemm_warmed_algos(Backend& b) { return as_cuda(b).gemm_warmed_algos(); }

int cuda_attention_tuned_graphs(Backend& b) { return as_cuda(b).attention_tuned_graphs(); }

fp8::Recipe cuda_fp8_recipe(Backend& b) { return as_cuda(b).fp8_recipe(); }

fp8::Quantized cuda_fp8_quantize(Backend& b, const Tensor& x, bool trans, fp8::Recipe recipe,
                                 fp8::Role role) {
  return as_cuda(b).fp8_quantize(x, trans, recipe, role, true);
}

void cuda_fp8_quantize_only(Backend& b, const Tensor& x, bool trans, fp8::Recipe recipe,
                            fp8::Role role) {
  as_cuda(b).fp8_quantize(x, trans, recipe, role, false);
}

int64_t cuda_fp8_held_weights(Backend& b) { return as_cuda(b).fp8_held_count(); }

int64_t cuda_fp8_held_uses(Backend& b) { return as_cuda(b).fp8_held_uses(); }

int64_t cuda_fp8_handed_uses(Backend& b) { return as_cuda(b).fp8_handed_uses(); }

int64_t cuda_fp8_scratch_products(Backend& b) { return as_cuda(b).fp8_scratch_products(); }
int64_t cuda_fp8_batched_groups(Backend& b) { return as_cuda(b).fp8_groups_batched(); }

}  // namespace hp
