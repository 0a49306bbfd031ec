#include "framework/model/expert_exchange.h"

namespace hp {

std::vector<ExchangePlan::Chunk> ExchangePlan::chunks() const {
  std::vector<Chunk> out;
  int64_t row = 0;
  for (int src = 0; src < ep_size; ++src) {
    for (int le = 0; le < experts_per_rank; ++le) {
      int64_t n = count(src, ep_rank * experts_per_rank + le);
      out.push_back({row, n, le});
      row += n;
    }
  }
  return out;
}

std::vector<int64_t> read_expert_counts(Backend& be, const Tensor& counts, int n_experts,
                                        RoutingMode mode) {
  std::vector<int64_t> out(static_cast<size_t>(n_experts));
  if (mode == RoutingMode::kBincount) {
    Tensor host = Tensor::host({n_experts}, DType::kI32);
    be.read_to_host(counts, host, SyncCause::kRouting);
    for (int e = 0; e < n_experts; ++e) out[e] = host.data<int32_t>()[e];
  } else {
    // The baseline stacks replace: a data-dependent query, and a host sync, per expert.
    Tensor host = Tensor::host({1}, DType::kI32);
    for (int e = 0; e < n_experts; ++e) {
      be.read_to_host(counts.slice(e, e + 1), host, SyncCause::kRouting);
      out[e] = host.data<int32_t>()[0];
    }
  }
  return out;
}

ExchangePlan LocalExpertExchange::plan(Backend& be, const Tensor& counts, int n_experts,
                                       RoutingMode mode) {
  ExchangePlan p;
  p.n_experts = n_experts;
  p.experts_per_rank = n_experts;
  p.counts = read_expert_counts(be, counts, n_experts, mode);
  for (int64_t c : p.counts) p.local_rows_in += c;
  p.expert_rows = p.local_rows_in;
  return p;
}

}  // namespace hp
