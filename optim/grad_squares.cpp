#include "optim/grad_squares.h"

namespace hp {

LayerGradSquares::LayerGradSquares(Backend& be, ParamRegistry& params, Backend::StreamKind stream)
    : be_(be), stream_(stream) {
  int64_t slots[2] = {0, 0};
  for (auto& p : params.all()) {
    const int g = p->group == ParamGroup::kExpert ? 1 : 0;
    const int64_t n = be_.sum_squares_slots(p->grad.numel());
    by_layer_[param_layer(p->name)].push_back(entries_.size());
    entries_.push_back({p.get(), g, slots[g], n});
    slots[g] += n;
  }
  done_.assign(entries_.size(), false);
  for (int g = 0; g < 2; ++g) partials_[g] = be_.empty({slots[g]}, be_.master_dtype());
}

LayerGradSquares::~LayerGradSquares() {
  if (!in_flight_) return;
  try {
    auto done = be_.record_event(stream_);
    be_.wait_event(Backend::StreamKind::kCompute, *done);
  } catch (...) {
    // Already failing (a broken device): nothing left to order.
  }
}

void LayerGradSquares::square(const std::vector<const Entry*>& entries) {
  if (entries.empty()) return;
  FamilyScope scope(be_, OpFamily::kOptimizer);
  if (stream_ != Backend::StreamKind::kCompute) {
    // The gradients are complete once compute has run what it has been given so far.
    auto ready = be_.record_event(Backend::StreamKind::kCompute);
    be_.wait_event(stream_, *ready);
    in_flight_ = true;
  }
  be_.set_stream(stream_);
  try {
    size_t i = 0;
    while (i < entries.size()) {
      // A run: entries of one group whose partial sums follow each other.
      const Entry& first = *entries[i];
      std::vector<Tensor> xs{first.param->grad};
      int64_t end = first.offset + first.slots;
      size_t j = i + 1;
      for (; j < entries.size() && entries[j]->group == first.group && entries[j]->offset == end;
           ++j) {
        xs.push_back(entries[j]->param->grad);
        end += entries[j]->slots;
      }
      Tensor out = partials_[first.group].slice(first.offset, end);
      be_.sum_squares_partials(xs, out);
      i = j;
    }
  } catch (...) {
    be_.set_stream(Backend::StreamKind::kCompute);
    throw;
  }
  be_.set_stream(Backend::StreamKind::kCompute);
}

void LayerGradSquares::layer_ready(int layer) {
  auto it = by_layer_.find(layer);
  if (it == by_layer_.end()) return;
  std::vector<const Entry*> todo;
  for (size_t i : it->second) {
    if (done_[i]) continue;
    done_[i] = true;
    todo.push_back(&entries_[i]);
  }
  square(todo);
}

void LayerGradSquares::finish(Tensor& acc) {
  HP_CHECK(acc.numel() == 2, "LayerGradSquares::finish needs acc[2], got ", acc.desc());
  std::vector<const Entry*> todo;
  for (size_t i = 0; i < entries_.size(); ++i)
    if (!done_[i]) todo.push_back(&entries_[i]);
  square(todo);
  done_.assign(done_.size(), false);
  FamilyScope scope(be_, OpFamily::kOptimizer);
  if (in_flight_) {
    auto done = be_.record_event(stream_);
    be_.wait_event(Backend::StreamKind::kCompute, *done);
    in_flight_ = false;
  }
  be_.fill(acc, 0.0);
  for (int g = 0; g < 2; ++g) {
    Tensor sum = acc.slice(g, g + 1);
    be_.sum_squares_finish(partials_[g], sum);
  }
}

}  // namespace hp
