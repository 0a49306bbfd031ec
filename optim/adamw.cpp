#include "optim/adamw.h"

#include <utility>
#include <vector>

namespace hp {

void grad_sum_squares(Backend& be, ParamRegistry& params, Tensor& acc) {
  FamilyScope scope(be, OpFamily::kOptimizer);
  HP_CHECK(acc.numel() == 2, "grad_sum_squares needs acc[2], got ", acc.desc());
  be.fill(acc, 0.0);
  Tensor dense = acc.slice(0, 1), expert = acc.slice(1, 2);
  std::vector<Tensor> grads[2];  // dense, expert
  std::vector<char> unwritten;   // per expert gradient: a slice left unwritten (reads as zeros)
  for (auto& p : params.all()) {
    if (p->group != ParamGroup::kExpert) {
      grads[0].push_back(p->grad);
      continue;
    }
    // Expert by expert, flagged or not, so that a flagged slice adds the bits its zeros would.
    for (int64_t le = 0; le < p->grad.dim(0); ++le) {
      grads[1].push_back(p->grad[le]);
      unwritten.push_back(p->expert_grad_unwritten(le) ? 1 : 0);
    }
  }
  be.sum_squares_many(grads[0], dense);
  be.sum_squares_many(grads[1], expert, unwritten);
}

namespace {
AdamWParams adamw_params(const AdamWConfig& cfg, bool weight_decay, int64_t step, double lr,
                         double grad_scale) {
  AdamWParams p;
  p.lr = lr;
  p.beta1 = cfg.beta1;
  p.beta2 = cfg.beta2;
  p.eps = cfg.eps;
  p.step = step;
  p.grad_scale = grad_scale;
  p.weight_decay = weight_decay ? cfg.weight_decay : 0.0;
  return p;
}
}  // namespace

void AdamW::update(Backend& be, Tensor& master, const Tensor& grad, Tensor& m, Tensor& v,
                   bool weight_decay, int64_t step, double lr, double grad_scale,
                   Tensor& working) const {
  be.adamw(master, grad, m, v, adamw_params(cfg_, weight_decay, step, lr, grad_scale), working);
}

void AdamW::check_update(Backend& be, Tensor& master, const Tensor& grad, Tensor& m, Tensor& v,
                         bool weight_decay, int64_t step, double lr, double grad_scale,
                         Tensor& working, Tensor& flag) const {
  AdamWParams p = adamw_params(cfg_, weight_decay, step, lr, grad_scale);
  p.check_flag = &flag;
  be.adamw(master, grad, m, v, p, working);
}

void AdamW::step(Backend& be, ParamRegistry& params, int64_t step, double lr, double grad_scale) {
  step_all(be, params, adamw_params(cfg_, true, step, lr, grad_scale));
}

void AdamW::step_gated(Backend& be, ParamRegistry& params, int64_t step, double lr,
                       const Tensor& gate) {
  AdamWParams p = adamw_params(cfg_, true, step, lr, 1.0);
  p.gate = &gate;
  step_all(be, params, p);
}

void AdamW::step_all(Backend& be, ParamRegistry& params, const AdamWParams& p) const {
  FamilyScope scope(be, OpFamily::kOptimizer);
  std::vector<Backend::AdamWEntry> entries;
  entries.reserve(params.all().size());
  for (auto& prm : params.all()) {
    Backend::AdamWEntry e;
    e.master = prm->master;
    e.grad = prm->grad;
    e.m = prm->m;
    e.v = prm->v;
    if (prm->work.storage() != prm->master.storage()) e.working = prm->work;
    e.weight_decay = prm->weight_decay;
    if (prm->grad_zero_experts.empty()) {
      entries.push_back(std::move(e));
      continue;
    }
    // Expert by expert: a slice whose gradient was left unwritten is updated with zeros.
    for (int64_t le = 0; le < prm->grad.dim(0); ++le) {
      Backend::AdamWEntry x;
      x.master = e.master[le];
      x.grad = e.grad[le];
      x.grad_zero = prm->expert_grad_unwritten(le);
      x.m = e.m[le];
      x.v = e.v[le];
      if (e.working.defined()) x.working = e.working[le];
      x.weight_decay = e.weight_decay;
      entries.push_back(std::move(x));
    }
  }
  // p.weight_decay applies to the entries that decay, 0 to the others: update()'s numbers.
  be.adamw_many(entries, p);
}

}  // namespace hp
