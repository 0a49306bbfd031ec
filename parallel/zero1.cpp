#include "parallel/zero1.h"

#include <algorithm>

namespace hp {

OptimizerStateBytes optimizer_state_bytes(const ParamRegistry& params) {
  OptimizerStateBytes b;
  for (const auto& p : params.all()) {
    const auto n = static_cast<int64_t>(p->master.nbytes() + p->m.nbytes() + p->v.nbytes());
    (p->group == ParamGroup::kExpert ? b.expert : b.dense) += n;
  }
  return b;
}

namespace {
Shape with_rows(Shape s, int64_t rows) {
  s[0] = rows;
  return s;
}

Communicator* group_for(const Param& p, const ProcessGroups& groups) {
  return (p.group == ParamGroup::kExpert ? groups.dp : groups.world).get();
}
}  // namespace

ShardRows shard_rows(const Param& p, const Communicator* comm) {
  if (!comm || comm->size() == 1) return {};
  const int64_t d = comm->size(), total = p.shape[0];
  if (total % d != 0) return {};
  return ShardRows{comm->rank() * (total / d), total / d};
}

void partitioned_grad_sum_squares(Backend& be, ParamRegistry& params, const ProcessGroups& groups,
                                  Zero1* zero1, Tensor& acc) {
  FamilyScope scope(be, OpFamily::kOptimizer);
  HP_CHECK(acc.numel() == 2, "grad_sum_squares needs acc[2], got ", acc.desc());
  be.fill(acc, 0.0);
  Tensor dense = acc.slice(0, 1), expert = acc.slice(1, 2);
  for (auto& p : params.all()) {
    Tensor& into = p->group == ParamGroup::kExpert ? expert : dense;
    const Communicator* comm = group_for(*p, groups);
    const ShardRows own = shard_rows(*p, comm);
    if (own.partitioned()) {
      Tensor* shard = zero1 ? zero1->find_grad_shard(*p) : nullptr;
      be.sum_squares(shard ? *shard : p->grad.slice(own.begin, own.begin + own.rows), into);
    } else if (!comm || comm->rank() == 0) {
      // Replicated over its group after the all-reduce: counted once, by the group's rank 0.
      be.sum_squares(p->grad, into);
    }
  }
}

Zero1::Zero1(Backend& be, ParamRegistry& params, const ProcessGroups& groups,
             Backend::StreamKind stream)
    : be_(be), params_(params), groups_(groups), stream_(stream) {
  const DType md = be.master_dtype(), ad = be.act_dtype();
  for (auto& ptr : params.all()) {
    Param& p = *ptr;
    HP_CHECK(!p.sharded(), "parameter ", p.name, " is sharded already");
    Communicator* comm = group_of(p);
    const ShardRows own = shard_rows(p, comm);
    if (!own.partitioned()) continue;  // stays replicated
    const int64_t rows = own.rows, begin = own.begin;
    const Shape shard = with_rows(p.shape, rows);
    Tensor master = be.empty(shard, md);
    be.copy(p.master.slice(begin, begin + rows), master);
    // The working copy keeps the whole tensor (on the cpu backend it was the master's storage);
    // the full master, where it was separate, is released here.
    p.master = master;
    p.m = be.zeros(shard, md);
    p.v = be.zeros(shard, md);
    p.shard_begin = begin;
    p.shard_rows = rows;
    Slot s;
    s.p = &p;
    s.comm = comm;
    s.grad = be.zeros(shard, md);
    // Same dtype: the master rows are what the all-gather sends; else the optimizer writes the
    // updated rows in the working dtype into a buffer of their own.
    s.work = ad == md ? p.master : be.empty(shard, ad);
    slots_.push_back(std::move(s));
  }
  std::stable_sort(slots_.begin(), slots_.end(), [](const Slot& a, const Slot& b) {
    return param_layer(a.p->name) < param_layer(b.p->name);
  });
  for (size_t i = 0; i < slots_.size(); ++i) index_[slots_[i].p] = i;
}

Zero1::~Zero1() {
  try {
    wait_params();
  } catch (...) {
    // Already failing: nothing left to order.
  }
}

Communicator* Zero1::group_of(const Param& p) const { return group_for(p, groups_); }

Tensor* Zero1::find_grad_shard(const Param& p) {
  Slot* s = slot(p);
  return s ? &s->grad : nullptr;
}

Zero1::Slot* Zero1::slot(const Param& p) {
  auto it = index_.find(&p);
  return it == index_.end() ? nullptr : &slots_[it->second];
}

Tensor& Zero1::grad_shard(const Param& p) {
  Slot* s = slot(p);
  HP_CHECK(s, "parameter ", p.name, " has no optimizer shard");
  return s->grad;
}

void Zero1::step(const Update& update) {
  {
    FamilyScope scope(be_, OpFamily::kOptimizer);
    for (auto& ptr : params_.all()) {
      Param& p = *ptr;
      if (Slot* s = slot(p)) {
        Tensor working = s->work.storage() == p.master.storage() ? Tensor() : s->work;
        update(p, s->grad, working);
      } else {
        Tensor working = p.work.storage() == p.master.storage() ? Tensor() : p.work;
        update(p, p.grad, working);
      }
    }
  }
  gather_params();
}

void Zero1::gather(Slot& s) {
  Param& p = *s.p;
  if (s.comm->device() == p.work.device()) {
    s.comm->all_gather(s.work, p.work);
    return;
  }
  // A host communicator for device tensors: through host memory.
  Tensor mine = Tensor::host(s.work.shape(), s.work.dtype());
  be_.read_to_host(s.work, mine, SyncCause::kOther);
  Tensor all = Tensor::host(p.work.shape(), p.work.dtype());
  s.comm->all_gather(mine, all);
  be_.copy(all, p.work);
}

void Zero1::gather_params() {
  if (slots_.empty()) return;
  wait_params();  // a gather still pending (no forward since): compute is ordered after it
  const bool async = stream_ != Backend::StreamKind::kCompute;
  if (async) {
    // The updated rows are complete once compute has run what it has been given so far.
    auto ready = be_.record_event(Backend::StreamKind::kCompute);
    be_.wait_event(stream_, *ready);
  }
  FamilyScope scope(be_, OpFamily::kComm);
  for (size_t i = 0; i < slots_.size(); ++i) {
    gather(slots_[i]);
    const int layer = param_layer(slots_[i].p->name);
    const bool last_of_layer =
        i + 1 == slots_.size() || param_layer(slots_[i + 1].p->name) != layer;
    if (async && last_of_layer) pending_[layer] = be_.record_event(stream_);
  }
}

void Zero1::layer_needed(int layer) {
  auto it = pending_.find(layer);
  if (it == pending_.end()) return;
  be_.wait_event(Backend::StreamKind::kCompute, *it->second);
  pending_.erase(it);
}

void Zero1::wait_params() {
  if (pending_.empty()) return;
  // The last layer's event follows every gather before it on stream_.
  be_.wait_event(Backend::StreamKind::kCompute, *pending_.rbegin()->second);
  pending_.clear();
}

}  // namespace hp
