// The multi-rank ExpertExchange over an expert-parallel group (docs/architecture.md, "Rule 3:
// one routing sync per MoE layer").
//
// plan(): the rank's expert histogram is read once to the host (the single routing sync of the
// layer; per-expert reads in the baseline mode) and all-gathered over the ep group, giving every
// rank the whole count matrix counts[src][e]. Its row sums by destination are the all-to-all
// send sizes, its columns for this rank's experts the receive sizes and the expert GEMM sizes.
// dispatch()/combine() are one all_to_all_v each with those sizes; backward reuses the plan.
#pragma once

#include <memory>

#include "framework/model/expert_exchange.h"
#include "parallel/communicator.h"

namespace hp {

class CommExpertExchange final : public ExpertExchange {
 public:
  // ep: the ranks that split the experts; data: the ranks that split the global batch (world).
  CommExpertExchange(std::shared_ptr<Communicator> ep, std::shared_ptr<Communicator> data);

  int ep_size() const override { return ep_->size(); }
  int ep_rank() const override { return ep_->rank(); }
  ExchangePlan plan(Backend& be, const Tensor& counts, int n_experts, RoutingMode mode) override;
  Tensor dispatch(Backend& be, const ExchangePlan& plan, const Tensor& x_sorted) override;
  Tensor combine(Backend& be, const ExchangePlan& plan, const Tensor& y_expert) override;
  int data_ranks() const override { return data_->size(); }
  void sum_over_data_ranks(Backend& be, Tensor& t) override;

  // Rows this rank sends to (dispatch) or receives from each ep rank.
  static std::vector<int64_t> send_rows(const ExchangePlan& p);
  static std::vector<int64_t> recv_rows(const ExchangePlan& p);

 private:
  Tensor exchange(Backend& be, const Tensor& in, const std::vector<int64_t>& send,
                  const std::vector<int64_t>& recv);

  std::shared_ptr<Communicator> ep_;
  std::shared_ptr<Communicator> data_;
};

}  // namespace hp
