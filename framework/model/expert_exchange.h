// ExpertExchange: moves routed tokens to the ranks that own their experts and back
// (docs/architecture.md, "Rule 3: one routing sync per MoE layer"). framework/ declares it;
// parallel/ implements the multi-rank version; LocalExpertExchange (below) serves one rank
// owning every expert.
//
// Protocol for one MoE layer forward, all on the backend's compute stream:
//   1. plan(): takes the device histogram of this rank's assignments per global expert and
//      returns the host count matrix counts[src][e] — the single routing sync of the layer.
//   2. dispatch(): rows sorted by global expert id -> rows for this rank's experts, grouped by
//      (source rank, local expert) in that order; sizes straight from the plan.
//   3. combine(): the reverse, same counts.
// Backward reuses the plan: dispatch of gradients is combine's adjoint and vice versa; no sync.
#pragma once

#include <cstdint>
#include <vector>

#include "framework/backend/backend.h"

namespace hp {

struct ExchangePlan {
  int ep_size = 1;
  int ep_rank = 0;
  int n_experts = 0;  // global
  int experts_per_rank = 0;
  std::vector<int64_t> counts;  // [ep_size * n_experts]: rows rank src sends to expert e
  int64_t local_rows_in = 0;    // rows this rank sends (its assignments)
  int64_t expert_rows = 0;      // rows this rank's experts process

  int64_t count(int src, int e) const { return counts[static_cast<size_t>(src) * n_experts + e]; }
  // Chunks of the dispatched buffer: (first row, rows, local expert), in buffer order.
  struct Chunk {
    int64_t begin;
    int64_t rows;
    int local_expert;
  };
  std::vector<Chunk> chunks() const;
};

enum class RoutingMode { kBincount, kPerExpert };

class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  virtual int ep_size() const = 0;
  virtual int ep_rank() const = 0;
  // counts: device [n_experts] i32. kBincount: one blocking read of the whole count matrix
  // (cause routing). kPerExpert: the baseline, one blocking query per expert.
  virtual ExchangePlan plan(Backend& be, const Tensor& counts, int n_experts, RoutingMode mode) = 0;
  // x_sorted [plan.local_rows_in, D] -> [plan.expert_rows, D].
  virtual Tensor dispatch(Backend& be, const ExchangePlan& plan, const Tensor& x_sorted) = 0;
  // y_expert [plan.expert_rows, D] -> [plan.local_rows_in, D] in x_sorted's order.
  virtual Tensor combine(Backend& be, const ExchangePlan& plan, const Tensor& y_expert) = 0;
  // Ranks that split the global batch (the world) and an in-place sum over them of a device
  // tensor, stream-ordered: the load-balancing loss needs every rank's expert counts so that N
  // ranks compute what one rank computes on the same global batch.
  virtual int data_ranks() const = 0;
  virtual void sum_over_data_ranks(Backend& be, Tensor& t) = 0;
};

// One rank owns every expert: dispatch and combine are the identity (no copy).
class LocalExpertExchange final : public ExpertExchange {
 public:
  int ep_size() const override { return 1; }
  int ep_rank() const override { return 0; }
  ExchangePlan plan(Backend& be, const Tensor& counts, int n_experts, RoutingMode mode) override;
  Tensor dispatch(Backend&, const ExchangePlan&, const Tensor& x_sorted) override {
    return x_sorted;
  }
  Tensor combine(Backend&, const ExchangePlan&, const Tensor& y_expert) override {
    return y_expert;
  }
  int data_ranks() const override { return 1; }
  void sum_over_data_ranks(Backend&, Tensor&) override {}
};

// Reads the per-expert counts of this rank to the host: one sync (bincount) or one per expert.
std::vector<int64_t> read_expert_counts(Backend& be, const Tensor& counts, int n_experts,
                                        RoutingMode mode);

}  // namespace hp
