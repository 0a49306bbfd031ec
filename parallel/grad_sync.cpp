#include "parallel/grad_sync.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

namespace hp {
GradSync::GradSync(Backend& be, ParamRegistry& params, const ProcessGroups& groups,
                   Backend::StreamKind stream, Zero1* zero1, DType wire)
    : be_(be), groups_(groups), stream_(stream), zero1_(zero1), wire_(wire) {
  HP_CHECK(wire == DType::kF32 || wire == DType::kBF16, "gradient wire dtype ", dtype_name(wire),
           ": must be f32 or bf16");
  size_t i = 0;
  int64_t largest = 0;
  for (auto& p : params.all()) {
    by_layer_[param_layer(p->name)].push_back(p.get());
    index_[p.get()] = i++;
    largest = std::max(largest, p->grad.numel());
  }
  done_.assign(i, false);
  if (wire_ == DType::kBF16) {
    // An all-reduce exchanges up to ceil(n / size) * size elements of an n-element gradient.
    const int64_t n = largest + (groups_.world ? groups_.world->size() : 1);
    wire_send_ = be_.empty({n}, DType::kBF16);
    wire_recv_ = be_.empty({n}, DType::kBF16);
    sum_ = be_.empty({n}, be_.master_dtype());
    part_ = be_.empty({n}, be_.master_dtype());
  }
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

void GradSync::reduce_via_host(Param& p, Communicator& comm, Tensor* shard) {
  Tensor h = Tensor::host(p.grad.shape(), p.grad.dtype());
  be_.read_to_host(p.grad, h, SyncCause::kOther);
  if (shard) {
    Tensor out = Tensor::host(shard->shape(), shard->dtype());
    comm.reduce_scatter(h, out, ReduceOp::kSum);
    be_.copy(out, *shard);
  } else {
    comm.all_reduce(h, ReduceOp::kSum);
    be_.copy(h, p.grad);
  }
}

namespace {
// Backend ops issued inside run on `s` (the stream the communicators enqueue on).
class OnStream {
 public:
  OnStream(Backend& be, Backend::StreamKind s) : be_(be) { be_.set_stream(s); }
  ~OnStream() { be_.set_stream(Backend::StreamKind::kCompute); }
  OnStream(const OnStream&) = delete;
  OnStream& operator=(const OnStream&) = delete;

 private:
  Backend& be_;
};
}  // namespace

void GradSync::wire_reduce_scatter(Communicator& comm, const Tensor& in, Tensor& out) {
  const int d = comm.size();
  const int64_t m = out.numel(), n = in.numel();
  HP_CHECK(n == m * d, "reduce-scatter of ", in.desc(), " into ", out.desc(), " over ", d,
           " ranks");
  OnStream on(be_, stream_);
  Tensor send = wire_send_.flat_view(0, n), recv = wire_recv_.flat_view(0, n);
  be_.convert(in.reshape({n}), send);
  const std::vector<int64_t> counts(static_cast<size_t>(d), m);
  comm.all_to_all_v(send, counts, recv, counts);
  // Rank order, in the gradient's dtype: ((x_0 + x_1) + x_2) + ...
  Tensor acc = out.reshape({m}), part = part_.flat_view(0, m);
  be_.convert(recv.flat_view(0, m), acc);
  for (int r = 1; r < d; ++r) {
    be_.convert(recv.flat_view(r * m, m), part);
    be_.add(acc, part, acc);
  }
}

void GradSync::wire_all_reduce(Communicator& comm, Tensor& t) {
  const int d = comm.size(), me = comm.rank();
  const int64_t n = t.numel();
  // Chunk r (reduced by rank r): n / d elements, one more for the first n % d ranks.
  std::vector<int64_t> chunk(static_cast<size_t>(d));
  for (int r = 0; r < d; ++r) chunk[static_cast<size_t>(r)] = n / d + (r < n % d ? 1 : 0);
  const int64_t mine = chunk[static_cast<size_t>(me)];
  OnStream on(be_, stream_);
  Tensor flat = t.reshape({n});
  Tensor send = wire_send_.flat_view(0, n);
  be_.convert(flat, send);
  const std::vector<int64_t> mine_each(static_cast<size_t>(d), mine);
  Tensor recv = wire_recv_.flat_view(0, mine * d);
  comm.all_to_all_v(send, chunk, recv, mine_each);
  Tensor acc = sum_.flat_view(0, mine), part = part_.flat_view(0, mine);
  be_.convert(recv.flat_view(0, mine), acc);
  for (int r = 1; r < d; ++r) {
    be_.convert(recv.flat_view(r * mine, mine), part);
    be_.add(acc, part, acc);
  }
  // The sums go back in bf16, one copy per rank, and every rank (this one too) reads them back.
  Tensor back = wire_send_.flat_view(0, mine * d);
  Tensor first = back.flat_view(0, mine);
  be_.convert(acc, first);
  for (int r = 1; r < d; ++r) {
    Tensor dst = back.flat_view(r * mine, mine);
    be_.copy(first, dst);
  }
  Tensor all = wire_recv_.flat_view(0, n);
  comm.all_to_all_v(back, mine_each, all, chunk);
  be_.convert(all, flat);
}

void GradSync::reduce_one(Param& p, Communicator& comm, Tensor* shard) {
  if (wire_ == DType::kBF16) {
    if (shard)
      wire_reduce_scatter(comm, p.grad, *shard);
    else
      wire_all_reduce(comm, p.grad);
  } else if (shard) {
    comm.reduce_scatter(p.grad, *shard, ReduceOp::kSum);
  } else {
    comm.all_reduce(p.grad, ReduceOp::kSum);
  }
}

void GradSync::reduce(const std::vector<Param*>& ps) {
  // NCCL reductions bucketed by communicator, in order of first use: the same order on every
  // rank, since every rank holds the same parameter names in the same order.
  std::vector<std::pair<Communicator*, std::vector<Param*>>> buckets;
  for (Param* p : ps) {
    const auto& comm = p->group == ParamGroup::kExpert ? groups_.dp : groups_.world;
    if (!comm || comm->size() == 1) continue;
    Tensor* shard = zero1_ && p->sharded() ? &zero1_->grad_shard(*p) : nullptr;
    if (comm->device() != p->grad.device()) {
      HP_CHECK(wire_ == DType::kF32,
               "grad_reduce_dtype=bf16 needs communicators on the "
               "gradients' device");
      reduce_via_host(*p, *comm, shard);
      continue;
    }
    if (comm->device() != Device::kCUDA) {
      // Host tensors on a host communicator (the cpu backend): blocking, in parameter order.
      reduce_one(*p, *comm, shard);
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
    // there. Elsewhere each tensor is its own reduction, exactly as if issued alone. (A flat
    // bucket copied in and out would move chunk boundaries, with the same problem, and cost
    // two extra passes over the gradients.) The bf16 wire reuses one scratch per tensor in
    // stream order, so it is never grouped.
    const bool grouped = comm->size() == 2 && bucket.size() > 1 && wire_ == DType::kF32;
    if (grouped) comm->group_start();
    try {
      for (Param* p : bucket)
        reduce_one(*p, *comm, zero1_ && p->sharded() ? &zero1_->grad_shard(*p) : nullptr);
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
