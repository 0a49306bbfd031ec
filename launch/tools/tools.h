// The tools of the hotpath executable: `inspect`, `eval` and `data`.
#pragma once

#include <string>
#include <vector>

#include "launch/options.h"
#include "launch/train/rank_context.h"

namespace hp {

// hotpath inspect CHECKPOINT: step, layout, every dataset with shape, dtype, size and digest,
// and the checksum verification of every chunk. Returns 0 when all checks pass, 1 otherwise.
int inspect_main(const std::vector<std::string>& args);

// hotpath eval: mean loss of the checkpoint's model on `batches` global batches from the start
// of the data; prints "eval_loss=<float> tokens=<int>" on rank 0 (tokens: the valid targets the
// mean is over). Collective over the world.
int run_eval(const TrainOptions& o, const RankContext& ctx);

// `hotpath import-hf DIR --out FILE.h5`: a Hugging Face checkpoint as a hotpath checkpoint
// (fresh optimizer state, step 0) and config file (docs/hf.md).
int import_hf_main(const std::vector<std::string>& args);
// `hotpath export-hf CKPT --out DIR [--dtype bf16|f32] [--shard_mib N]`: the reverse.
int export_hf_main(const std::vector<std::string>& args);

// `hotpath data synth --out FILE.{bin,h5} --docs N [--vocab_size V --seed S ...]`.
int data_tool_main(const std::vector<std::string>& args);

}  // namespace hp
