// Hugging Face checkpoints (config.json + safetensors) of GptOss, Llama and Qwen3 models, to and
// from hotpath's ModelConfig and parameters (docs/hf.md has the mapping).
//
// Import: every config.json field is mapped to a ModelConfig key, checked against the one value
// hotpath implements, or known to be about serving or tokenization only; anything else is refused
// naming the field. Tensors are mapped to hotpath's names and layouts: nn.Linear's [out, in]
// becomes [in, out], q/k/v projections become the fused wqkv (q heads, then k, then v), gate and
// up become one [in, 2F] matrix (gate half first), GPT-OSS's interleaved expert gate/up columns
// (even gate, odd up) become the two halves, and MXFP4 expert weights are dequantized to fp32.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "framework/core/tensor.h"
#include "framework/model/config.h"

namespace hp {

// One parameter in hotpath's name and global layout, fp32.
struct NamedTensor {
  std::string name;
  Shape shape;
  std::vector<float> data;
};

struct HfImport {
  std::string architecture;  // "GptOssForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM"
  ModelConfig model;
  int64_t max_positions = 0;        // config.json max_position_embeddings
  int32_t eot_token = -1;           // config.json eos_token_id when it is one id; -1 otherwise
  bool mxfp4 = false;               // experts were stored as MXFP4
  std::vector<NamedTensor> params;  // in hotpath's registration order
};

// Reads config.json only (names the field that cannot be mapped).
HfImport read_hf_config(const std::string& dir);
// Reads config.json and every tensor; a missing or misshapen tensor is an error naming it, and so
// is a tensor the mapping does not use.
HfImport read_hf_checkpoint(const std::string& dir);

// MXFP4 (OCP microscaling FP4): `blocks` [E, rows, groups, 16] bytes, each the E2M1 codes of two
// values (low nibble first), `scales` [E, rows, groups] E8M0 exponents (value 2^(s - 127) for the
// 32 values of a group). Returns fp32 [E, groups * 32, rows]: the dequantized [E, rows, cols]
// transposed to the [E, in, out] layout of GPT-OSS's expert weights.
std::vector<float> mxfp4_dequantize(const uint8_t* blocks, const uint8_t* scales, int64_t experts,
                                    int64_t rows, int64_t groups);
// The E2M1 value of a 4-bit code (sign, 2 exponent bits, 1 mantissa bit).
float e2m1_value(uint8_t code);

// The `key = value` lines of every ModelConfig key (a hotpath config file's model section).
std::string model_config_ini(const ModelConfig& m);

// Writes a hotpath checkpoint at `path` (the caller's temporary name; it renames the file when
// complete and removes it on failure): the parameters, zero AdamW moments, step 0, the config
// text as its `config` attribute, `model_record` (model_config_record of imp.model) as its
// `model_config` attribute, and `source_dir` as `imported_from` (the file holds no training state).
void write_imported_checkpoint(const std::string& path, const HfImport& imp,
                               const std::string& config_text, const std::string& model_record,
                               const std::string& source_dir);

// Export: config.json for `m` (the architecture is chosen from what the model uses; a model no
// supported architecture expresses is refused naming the key), and the tensors in HF names.
std::string hf_config_json(const ModelConfig& m, int64_t max_positions, int32_t eot_token,
                           const std::string& dtype, std::string* architecture);
// `get(name)` returns hotpath parameter `name` (global shape, fp32). Returns HF name/tensor pairs.
std::vector<NamedTensor> hf_tensors_from_hotpath(
    const ModelConfig& m, const std::string& architecture,
    const std::function<std::vector<float>(const std::string&, const Shape&)>& get);

}  // namespace hp
