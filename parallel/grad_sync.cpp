#include "parallel/grad_sync.h"

#include <cstdlib>

namespace hp {
namespace {
// "layers.12.attn.wo" -> 12; anything else -> -1.
int layer_of(const std::string& name) {
  const std::string pre = "layers.";
  if (name.compare(0, pre.size(), pre) != 0) return -1;
  return std::atoi(name.c_str() + pre.size());
}
}  // namespace

GradSync::GradSync(Backend& be, ParamRegistry& params, const ProcessGroups& groups)
    : be_(be), groups_(groups) {
  size_t i = 0;
  for (auto& p : params.all()) {
    by_layer_[layer_of(p->name)].push_back(p.get());
    index_[p.get()] = i++;
  }
  done_.assign(i, false);
}

void GradSync::reduce(Param& p) {
  const auto& comm = p.group == ParamGroup::kExpert ? groups_.dp : groups_.world;
  if (!comm || comm->size() == 1) return;
  if (comm->device() == p.grad.device()) {
    comm->all_reduce(p.grad, ReduceOp::kSum);
  } else {
    Tensor h = Tensor::host(p.grad.shape(), p.grad.dtype());
    be_.read_to_host(p.grad, h, SyncCause::kOther);
    comm->all_reduce(h, ReduceOp::kSum);
    be_.copy(h, p.grad);
  }
  bytes_ += static_cast<int64_t>(p.grad.nbytes());
}

void GradSync::layer_ready(int layer) {
  auto it = by_layer_.find(layer);
  if (it == by_layer_.end()) return;
  for (Param* p : it->second) {
    size_t i = index_[p];
    if (done_[i]) continue;
    reduce(*p);
    done_[i] = true;
  }
}

void GradSync::finish() {
  for (auto& [layer, ps] : by_layer_)
    for (Param* p : ps) {
      size_t i = index_[p];
      if (!done_[i]) reduce(*p);
    }
  done_.assign(done_.size(), false);
}

}  // namespace hp
