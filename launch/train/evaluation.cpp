#include "launch/train/evaluation.h"

#include <chrono>
#include <cmath>
#include <vector>

#include "framework/core/error.h"
#include "launch/train/components.h"
#include "launch/train/trainer.h"

namespace hp {

HeldOutData::HeldOutData(const TrainOptions& o, const std::string& source, const char* key,
                         int rank, int world) {
  DataConfig d = make_data_config(o, rank, world);
  d.source = source;
  d.shuffle = false;  // the same batches every time, in file order
  try {
    loader_ = DataLoader::open(d);
  } catch (const UserError& e) {
    HP_USER_ERROR(e.kind(), "config key '", key, "' (", source, "): ", e.what());
  }
}

DataLoader& HeldOutData::from_start() {
  loader_->seek(0);
  return *loader_;
}

EvalStats evaluate_held_out(Trainer& t, HeldOutData& data, int64_t batches,
                            const EvalBatchHook& each) {
  HP_CHECK(batches >= 1, "evaluate_held_out: ", batches, " batches");
  const auto t0 = std::chrono::steady_clock::now();
  Backend& be = t.backend();
  DataLoader& loader = data.from_start();
  t.wait_params();
  // Each batch's loss sum in a slot of its own (the master dtype's sum over one batch, as a step
  // computes it), added on the host in batch order after the evaluation's one read.
  Tensor lm = be.zeros({batches}, be.master_dtype());
  Tensor aux = be.zeros({1}, be.master_dtype());  // the MoE balance loss: not part of the loss
  double valid = 0, doc_tokens = 0;               // this rank's (integers, exact in f64)
  for (int64_t b = 0; b < batches; ++b) {
    const PackedBatch batch = loader.next();
    const BatchMeta meta = be.upload_batch(batch);
    t.model().evaluate(meta, LossSums{lm.slice(b, b + 1), aux});
    valid += static_cast<double>(batch.num_valid_targets);
    doc_tokens += static_cast<double>(batch.num_doc_tokens);
    if (each) each(batch, meta);
  }
  Tensor host = Tensor::host({batches}, be.master_dtype());
  be.read_to_host(lm, host, SyncCause::kLoss);
  double sum = 0;
  for (double v : to_double_vector(host)) sum += v;
  const RankContext& ctx = t.context();
  if (ctx.world() > 1) {
    // Folded in rank order: every rank holds the same three numbers.
    Tensor s = Tensor::host_from(std::vector<double>{sum, valid, doc_tokens}, DType::kF64);
    ctx.groups.world->all_reduce(s, ReduceOp::kSum);
    sum = s.data<double>()[0];
    valid = s.data<double>()[1];
    doc_tokens = s.data<double>()[2];
  }
  EvalStats e;
  e.targets = static_cast<int64_t>(valid);
  e.tokens = static_cast<int64_t>(doc_tokens);
  // No target to average over (every held-out target masked): no loss, NaN (null in JSON).
  e.loss = e.targets > 0 ? sum / valid : std::nan("");
  e.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return e;
}

}  // namespace hp
