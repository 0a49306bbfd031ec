// Packed varlen attention through cuDNN's fused SDPA (the cuDNN frontend graph API).
//
// Layout: q, k and v are the head blocks of the model's packed qkv[N, Hq + 2 Hkv, D] buffer, one
// ragged (THD) tensor each; sequences are the batch's cu_seqlens, causal, with the optional
// sliding window W (keys i - W < j <= i). A batch whose sequences all have one length (a
// multiple of 64) is a plain [B, H, S, D] problem instead: no offsets, no padding mask, faster
// kernels; its statistics pass through cuDNN's packed BHSD layout. Learned sinks are not handed to cuDNN (its packed
// backward with sinks needs cuDNN >= 9.26): attention without the sink is exactly rescaled, since
// with c = sigmoid(lse_ns - s), O = c * O_ns and lse = log(exp(s) + exp(lse_ns)); the backward
// runs cuDNN's with dO' = c * dO and the sinked O, whose row sums dO'.O equal the sinked
// gradient's correction term, and ds = -sum_i (dO_i . O_i)(1 - c_i).
//
// libcudnn is loaded at run time: where it is missing, available() says why and the backend
// keeps its own tiled kernels. Graphs are built once per (shape, batch-size bucket, length
// bucket) and cached; building one takes a fraction of a second (longer where autotune builds
// every plan the heuristic offers).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "framework/backend/cuda/cuda_kernels.h"
#include "framework/core/tensor.h"

struct CUstream_st;

namespace hp::cuda {

// The batch's sequences as cuDNN reads them, built once per batch and shape (device memory).
struct CudnnBatch {
  // false: every sequence has the same length s, and b = n_seqs (no offsets, no padding mask)
  bool ragged = true;
  Tensor offsets;  // ragged: int32 seq_len[B], qkv_off[B+1], o_off[B+1], lse_off[B+1]
  int64_t b = 0;   // ragged: batch bucket (>= n_seqs; extra sequences have length 0)
  int64_t s = 0;   // ragged: length bucket (>= max_seqlen)
};

class CudnnAttention {
 public:
  // Loads libcudnn and creates a handle on the current device; returns null (and the reason in
  // *why) where cuDNN cannot be used.
  static std::unique_ptr<CudnnAttention> create(std::string* why);
  ~CudnnAttention();

  // Whether the shape can run here (head_dim 64 or 128, 16-byte aligned buffers).
  bool supports(const AttnArgs& a) const;
  // The batch layout for this shape; cu_seqlens is the batch's device array.
  CudnnBatch make_batch(const AttnArgs& a, const int32_t* cu_seqlens, int64_t n_seqs,
                        int64_t max_seqlen, Allocator& alloc, CUstream_st* stream);
  void forward(const AttnArgs& a, const CudnnBatch& b, void* out, float* lse, Allocator& alloc,
               CUstream_st* stream);
  // Device memory cuDNN's atomic-free (deterministic) backward needs for this batch: it grows
  // with the square of the longest sequence, so long documents rule it out.
  static int64_t deterministic_workspace_bytes(const CudnnBatch& b, const AttnArgs& a);
  // deterministic: cuDNN's atomic-free backward (slower, see deterministic_workspace_bytes).
  void backward(const AttnArgs& a, const CudnnBatch& b, const void* out, const float* lse,
                const void* dout, void* dqkv, float* dsinks, bool deterministic, Allocator& alloc,
                CUstream_st* stream);
  std::string version() const;
  // Graphs built so far (each distinct shape and bucket builds one, once).
  int64_t graphs_built() const;
  // Autotune (off by default): a forward graph builds every plan the heuristic offers, times them
  // at its first run (between events, without waiting) and runs the fastest once a later run
  // finds the timings done. Which plan wins depends on timings, so the bits may differ from
  // process to process: not for deterministic runs.
  void set_autotune(bool on);
  // Forward graphs whose plans have been compared (the fastest then runs).
  int64_t graphs_tuned() const;

 private:
  CudnnAttention() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Sink kernels (attention_sinks.cu). After the sink-free forward: out *= c, lse -> sinked lse.
void launch_sink_forward_fixup(void* out, float* lse, const void* sinks, DType sinks_t, int64_t n,
                               int hq, int d, CUstream_st* stream);
// Before the sink-free backward: dout_scaled = c * dout, lse_ns = lse + log(c), and
// dsinks[h] += -sum_i (dout_i . out_i)(1 - c_i) (deterministic).
void launch_sink_backward_prep(const void* out, const void* dout, const float* lse,
                               const void* sinks, DType sinks_t, int64_t n, int hq, int d,
                               void* dout_scaled, float* lse_ns, float* dsinks, Allocator& alloc,
                               CUstream_st* stream);
// Between the backend's lse[t, h] (t = i s + j) and cuDNN's packed statistics stats[i, h, j] of a
// batch of b sequences of s tokens: to_bhsd writes `to` in cuDNN's layout from `from` in the
// backend's, else the other way.
void launch_lse_bhsd(const float* from, int64_t b, int64_t s, int hq, float* to, bool to_bhsd,
                     CUstream_st* stream);
// seq_len[b], and the element offsets of qkv, out and lse rows for a batch bucket of `b`.
void launch_cudnn_offsets(const int32_t* cu_seqlens, int64_t n_seqs, int64_t b, int64_t qkv_row,
                          int64_t o_row, int64_t lse_row, int32_t* out, CUstream_st* stream);

}  // namespace hp::cuda
