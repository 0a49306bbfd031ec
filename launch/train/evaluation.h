// Held-out loss: the mean cross-entropy of the model's current parameters over the first global
// batches of a data set, read in file order. One implementation serves `hotpath eval` (a
// checkpoint's parameters, launch/tools/eval.cpp) and the evaluation during training (eval_data,
// eval_every, eval_batches; run_train in trainer.cpp), so both give the same number for the same
// parameters, data and layout.
//
// What an evaluation costs: forward passes of Pass::kEval (no gradient, no activation kept past
// its layer, the activation store and its offload ring untouched) and the loss in chunks, on
// the batches of a loader of its own (the training loader and its data order are not touched);
// no optimizer state. One read of the loss sums per evaluation (sync cause `loss`), outside any
// training step's count; each MoE layer's forward makes its routing read as in training.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "framework/data/loader.h"
#include "launch/options.h"
#include "launch/train/metrics.h"

namespace hp {

class Trainer;

// The held-out batches of one rank: its rows of the global batches of `source` (a data spec like
// the `data` key's) with the run's seq_len, batch_tokens and packing, documents in file order
// (shuffle off), every evaluation from the start of the data.
class HeldOutData {
 public:
  // Opens and checks `source`. A file that cannot be used is a UserError naming `key` (the
  // option that gave the source) and the file.
  HeldOutData(const TrainOptions& o, const std::string& source, const char* key, int rank,
              int world);
  // The loader, positioned before the first global batch.
  DataLoader& from_start();
  std::string describe() const { return loader_->describe(); }

 private:
  std::unique_ptr<DataLoader> loader_;
};

// Called after each batch's loss has been computed (hotpath eval --dump_logits).
using EvalBatchHook = std::function<void(const PackedBatch&, const BatchMeta&)>;

// Evaluates `t`'s parameters on the first `batches` global batches of `data`: the sum of -log p
// over the valid targets of every rank's rows, divided by their global count; tokens counts the
// document tokens, targets the valid targets (the mean's denominator). Collective over the world
// (every rank calls it with the same `batches`). Waits for parameters still being gathered
// (zero1) first. Changes no parameter, gradient, optimizer state or training data position.
EvalStats evaluate_held_out(Trainer& t, HeldOutData& data, int64_t batches,
                            const EvalBatchHook& each = {});

}  // namespace hp
