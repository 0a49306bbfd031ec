#include "parallel/moe_exchange.h"

namespace hp {

CommExpertExchange::CommExpertExchange(std::shared_ptr<Communicator> ep,
                                       std::shared_ptr<Communicator> data)
    : ep_(std::move(ep)), data_(std::move(data)) {
  HP_CHECK(ep_ && data_, "CommExpertExchange needs ep and data communicators");
}

namespace {
// Collectives run on tensors of the communicator's device: host communicators stage device
// tensors through host memory (the CPU backend's tensors are host memory already).
bool on_comm_device(const Communicator& c, const Tensor& t) { return c.device() == t.device(); }
}  // namespace

ExchangePlan CommExpertExchange::plan(Backend& be, const Tensor& counts, int n_experts,
                                      RoutingMode mode) {
  const int ep = ep_->size();
  HP_CHECK(n_experts % ep == 0, "n_experts ", n_experts, " not divisible by ep size ", ep);
  ExchangePlan p;
  p.ep_size = ep;
  p.ep_rank = ep_->rank();
  p.n_experts = n_experts;
  p.experts_per_rank = n_experts / ep;
  Tensor mine = Tensor::host({n_experts}, DType::kI64);
  Tensor all = Tensor::host({static_cast<int64_t>(ep) * n_experts}, DType::kI64);
  if (ep_->device() == Device::kCPU) {
    // The one blocking read of the layer, then a host all-gather of the counts.
    std::vector<int64_t> local = read_expert_counts(be, counts, n_experts, mode);
    std::copy(local.begin(), local.end(), mine.data<int64_t>());
    ep_->all_gather(mine, all);
  } else {
    // Device communicator: gather the histograms on the device, read the matrix once.
    Tensor dev_mine = be.empty({n_experts}, DType::kI32);
    be.copy(counts, dev_mine);
    Tensor dev_all = be.empty({static_cast<int64_t>(ep) * n_experts}, DType::kI32);
    ep_->all_gather(dev_mine, dev_all);
    std::vector<int64_t> flat = read_expert_counts(be, dev_all, ep * n_experts, mode);
    std::copy(flat.begin(), flat.end(), all.data<int64_t>());
  }
  p.counts.assign(all.data<int64_t>(), all.data<int64_t>() + all.numel());
  for (int e = 0; e < n_experts; ++e) p.local_rows_in += p.count(p.ep_rank, e);
  for (const auto& c : p.chunks()) p.expert_rows += c.rows;
  return p;
}

std::vector<int64_t> CommExpertExchange::send_rows(const ExchangePlan& p) {
  std::vector<int64_t> out(static_cast<size_t>(p.ep_size), 0);
  for (int dst = 0; dst < p.ep_size; ++dst)
    for (int le = 0; le < p.experts_per_rank; ++le)
      out[dst] += p.count(p.ep_rank, dst * p.experts_per_rank + le);
  return out;
}

std::vector<int64_t> CommExpertExchange::recv_rows(const ExchangePlan& p) {
  std::vector<int64_t> out(static_cast<size_t>(p.ep_size), 0);
  for (int src = 0; src < p.ep_size; ++src)
    for (int le = 0; le < p.experts_per_rank; ++le)
      out[src] += p.count(src, p.ep_rank * p.experts_per_rank + le);
  return out;
}

Tensor CommExpertExchange::exchange(Backend& be, const Tensor& in, const std::vector<int64_t>& send,
                                    const std::vector<int64_t>& recv) {
  int64_t rows = 0;
  for (int64_t r : recv) rows += r;
  Shape shape = in.shape();
  shape[0] = rows;
  Tensor out = be.empty(shape, in.dtype());
  if (on_comm_device(*ep_, in)) {
    ep_->all_to_all_v(in, send, out, recv);
  } else {
    Tensor hin = Tensor::host(in.shape(), in.dtype());
    be.copy(in, hin);
    be.synchronize(SyncCause::kOther);
    Tensor hout = Tensor::host(shape, in.dtype());
    ep_->all_to_all_v(hin, send, hout, recv);
    be.copy(hout, out);
  }
  return out;
}

Tensor CommExpertExchange::dispatch(Backend& be, const ExchangePlan& p, const Tensor& x_sorted) {
  HP_CHECK(x_sorted.dim(0) == p.local_rows_in, "dispatch: ", x_sorted.desc(), " vs plan rows ",
           p.local_rows_in);
  return exchange(be, x_sorted, send_rows(p), recv_rows(p));
}

Tensor CommExpertExchange::combine(Backend& be, const ExchangePlan& p, const Tensor& y_expert) {
  HP_CHECK(y_expert.dim(0) == p.expert_rows, "combine: ", y_expert.desc(), " vs plan rows ",
           p.expert_rows);
  return exchange(be, y_expert, recv_rows(p), send_rows(p));
}

void CommExpertExchange::sum_over_data_ranks(Backend& be, Tensor& t) {
  if (on_comm_device(*data_, t)) {
    data_->all_reduce(t, ReduceOp::kSum);
    return;
  }
  Tensor h = Tensor::host(t.shape(), t.dtype());
  be.read_to_host(t, h, SyncCause::kRouting);
  data_->all_reduce(h, ReduceOp::kSum);
  be.copy(h, t);
}

}  // namespace hp
