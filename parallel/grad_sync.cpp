#include "parallel/grad_sync.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

namespace hp {
namespace {
// "layers.12.attn.wo" -> 12; anything else -> -1.
int layer_of(const std::string& name) {
  const std::string pre = "layers.";
  if (name.compare(0, pre.size(), pre) != 0) return -1;
  return std::atoi(name.c_str() + pre.size());
}
}  // namespace

GradSync::GradSync(Backend& be, ParamRegistry& params, const ProcessGroups& groups,
                   Backend::StreamKind stream)
    : be_(be), groups_(groups), stream_(stream) {
  size_t i = 0;
  for (auto& p : params.all()) {
    by_layer_[layer_of(p->name)].push_back(p.get());
    index_[p.get()] = i++;
  }
  done_.assign(i, false);
}

GradSync::~GradSync() {
  if (!in_flight_) return;
  try {
    auto done = be_.record_event(stream_);
    be_.wait_event(Backend::StreamKind::kCompute, *done);
  } catch (...) {
    // Already failing (a broken device or communicator): nothing left to order.
  }
}

void GradSync::reduce_via_host(Param& p, Communicator& comm) {
  Tensor h = Tensor::host(p.grad.shape(), p.grad.dtype());
  be_.read_to_host(p.grad, h, SyncCause::kOther);
  comm.all_reduce(h, ReduceOp::kSum);
  be_.copy(h, p.grad);
  bytes_ += static_cast<int64_t>(p.grad.nbytes());
}

void GradSync::reduce(const std::vector<Param*>& ps) {
  // NCCL reductions bucketed by communicator, in order of first use: the same order on every
  // rank, since every rank holds the same parameter names in the same order.
  std::vector<std::pair<Communicator*, std::vector<Param*>>> buckets;
  for (Param* p : ps) {
    const auto& comm = p->group == ParamGroup::kExpert ? groups_.dp : groups_.world;
    if (!comm || comm->size() == 1) continue;
    if (comm->device() != p->grad.device()) {
      reduce_via_host(*p, *comm);
      continue;
    }
    if (comm->device() != Device::kCUDA) {
      // Host tensors on a host communicator (the cpu backend): blocking, in parameter order.
      comm->all_reduce(p->grad, ReduceOp::kSum);
      bytes_ += static_cast<int64_t>(p->grad.nbytes());
      continue;
    }
    auto it = std::find_if(buckets.begin(), buckets.end(),
                           [&](const auto& b) { return b.first == comm.get(); });
    if (it == buckets.end()) {
      buckets.emplace_back(comm.get(), std::vector<Param*>{});
      it = buckets.end() - 1;
    }
    it->second.push_back(p);
  }
  if (buckets.empty()) return;
  if (stream_ != Backend::StreamKind::kCompute) {
    // The gradients are complete once compute has run what it has been given so far.
    auto ready = be_.record_event(Backend::StreamKind::kCompute);
    be_.wait_event(stream_, *ready);
    in_flight_ = true;
  }
  for (auto& [comm, bucket] : buckets) {
    // One launch for the bucket where it cannot change a bit: NCCL picks algorithm, protocol
    // and channels for grouped reductions by their aggregate size, which on 3 or more ranks can
    // change the order in which an element's addends are summed. With 2 ranks each element is
    // one addition of two values, the same whichever way round, so grouping is bitwise neutral
    // there. Elsewhere each tensor is its own all-reduce, exactly as if issued alone. (A flat
    // bucket copied in and out would move chunk boundaries, with the same problem, and cost
    // two extra passes over the gradients.)
    const bool grouped = comm->size() == 2 && bucket.size() > 1;
    if (grouped) comm->group_start();
    try {
      for (Param* p : bucket) {
        comm->all_reduce(p->grad, ReduceOp::kSum);
        bytes_ += static_cast<int64_t>(p->grad.nbytes());
      }
    } catch (...) {
      if (grouped) {
        try {
          comm->group_end();  // keeps the thread's NCCL group state balanced
        } catch (...) {
        }
      }
      throw;
    }
    if (grouped) comm->group_end();
  }
}

void GradSync::layer_ready(int layer) {
  auto it = by_layer_.find(layer);
  if (it == by_layer_.end()) return;
  std::vector<Param*> todo;
  for (Param* p : it->second) {
    size_t i = index_[p];
    if (done_[i]) continue;
    todo.push_back(p);
    done_[i] = true;
  }
  reduce(todo);
}

void GradSync::finish() {
  for (auto& [layer, ps] : by_layer_) {
    std::vector<Param*> todo;
    for (Param* p : ps)
      if (!done_[index_[p]]) todo.push_back(p);
    reduce(todo);
  }
  done_.assign(done_.size(), false);
  if (in_flight_) {
    // Whatever compute does next (gradient norms, the optimizer, zeroing for the next step)
    // comes after the last reduction.
    auto done = be_.record_event(stream_);
    be_.wait_event(Backend::StreamKind::kCompute, *done);
    in_flight_ = false;
  }
}

}  // namespace hp
