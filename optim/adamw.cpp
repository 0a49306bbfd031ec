#include "optim/adamw.h"

#include <algorithm>

namespace hp {

void grad_sum_squares(Backend& be, ParamRegistry& params, Tensor& acc) {
  FamilyScope scope(be, OpFamily::kOptimizer);
  HP_CHECK(acc.numel() == 2, "grad_sum_squares needs acc[2], got ", acc.desc());
  be.fill(acc, 0.0);
  Tensor dense = acc.slice(0, 1), expert = acc.slice(1, 2);
  for (auto& p : params.all())
    be.sum_squares(p->grad, p->group == ParamGroup::kExpert ? expert : dense);
}

double clip_coefficient(double grad_norm, double clip) {
  if (clip <= 0) return 1.0;
  return std::min(1.0, clip / (grad_norm + 1e-6));
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
  FamilyScope scope(be, OpFamily::kOptimizer);
  for (auto& prm : params.all()) {
    Tensor working = prm->work.storage() == prm->master.storage() ? Tensor() : prm->work;
    update(be, prm->master, prm->grad, prm->m, prm->v, prm->weight_decay, step, lr, grad_scale,
           working);
  }
}

}  // namespace hp
