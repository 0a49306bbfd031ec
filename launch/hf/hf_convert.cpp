#include "launch/hf/hf_convert.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "framework/checkpoint/checkpoint.h"
#include "framework/core/error.h"
#include "framework/core/rng.h"
#include "framework/data/loader.h"
#include "launch/hf/json_strict.h"
#include "launch/hf/safetensors.h"

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

namespace hp {
namespace {

const char* const kGptOss = "GptOssForCausalLM";
const char* const kLlama = "LlamaForCausalLM";
const char* const kQwen3 = "Qwen3ForCausalLM";
constexpr int64_t kMaxDim = 1 << 20;  // ModelConfig's limit on each dimension
constexpr int64_t kMaxInt32 = 2147483647;

// Fields that describe tokenization, serving or the file itself: they change nothing hotpath
// computes. eos_token_id is read for the end-of-text id.
const std::set<std::string> kMetadata = {
    "architectures",          "model_type",   "dtype",        "torch_dtype", "transformers_version",
    "bos_token_id",           "eos_token_id", "pad_token_id", "use_cache",   "_name_or_path",
    "max_position_embeddings"};

// Reads config.json fields one by one, remembering which were used, so that every field not
// used is refused by name at the end.
class ConfigFields {
 public:
  ConfigFields(const Json& j, std::string file) : j_(j), file_(std::move(file)) {}
  bool has(const std::string& k) const { return j_.contains(k) && !j_[k].is_null(); }
  const Json& get(const std::string& k) {
    used_.insert(k);
    if (!has(k)) fail(k, "is required");
    return j_[k];
  }
  void use(const std::string& k) { used_.insert(k); }
  // An integer in [lo, hi]: a fraction, a string or a value beyond the range is refused naming
  // the field, never narrowed.
  int64_t integer(const std::string& k, int64_t lo, int64_t hi) {
    const Json& v = get(k);
    if (!v.is_number_integer())
      fail(k, str_cat("is ", v.dump(), "; it must be an integer in [", lo, ", ", hi, "]"));
    const bool big = v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi);
    if (big || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
      fail(k, str_cat("is ", v.dump(), "; it must be an integer in [", lo, ", ", hi, "]"));
    return v.get<int64_t>();
  }
  int64_t integer_or(const std::string& k, int64_t lo, int64_t hi, int64_t dflt) {
    return has(k) ? integer(k, lo, hi) : (use(k), dflt);
  }
  // A model dimension: [1, 2^20], hotpath's own limit for every dimension.
  int dim(const std::string& k) { return static_cast<int>(integer(k, 1, kMaxDim)); }
  int dim_or(const std::string& k, int dflt) {
    return static_cast<int>(integer_or(k, 1, kMaxDim, dflt));
  }
  double number_or(const std::string& k, double dflt) {
    use(k);
    if (!has(k)) return dflt;
    if (!j_[k].is_number() || !std::isfinite(j_[k].get<double>()))
      fail(k, str_cat("is ", j_[k].dump(), "; it must be a finite number"));
    return j_[k].get<double>();
  }
  bool boolean_or(const std::string& k, bool dflt) {
    use(k);
    if (!has(k)) return dflt;
    if (!j_[k].is_boolean()) fail(k, str_cat("is ", j_[k].dump(), "; it must be true or false"));
    return j_[k].get<bool>();
  }
  // The field must be absent, null or `want`.
  void expect(const std::string& k, const Json& want, const std::string& why) {
    use(k);
    if (has(k) && j_[k] != want)
      fail(k,
           str_cat("is ", j_[k].dump(), "; hotpath supports only ", want.dump(), " (", why, ")"));
  }
  [[noreturn]] void fail(const std::string& k, const std::string& rule) const {
    HP_USER_ERROR(ErrorKind::kConfig, file_, ": field '", k, "' ", rule);
  }
  void refuse_unused() const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      if (used_.count(it.key()) || kMetadata.count(it.key())) continue;
      HP_USER_ERROR(ErrorKind::kConfig, file_, ": field '", it.key(), "' (", it.value().dump(),
                    ") has no hotpath equivalent; import-hf maps every field or refuses it");
    }
  }
  const std::string& file() const { return file_; }

 private:
  const Json& j_;
  std::string file_;
  std::set<std::string> used_;
};

// RoPE: rope_parameters (or the older rope_scaling plus rope_theta). "default" and "yarn" map;
// every other type (llama3, linear, dynamic, longrope, ...) is refused.
void read_rope(ConfigFields& f, double default_theta, int64_t max_positions, ModelConfig& m) {
  Json rope = Json::object();
  std::string key = "rope_parameters";
  if (f.has("rope_parameters")) {
    rope = f.get("rope_parameters");
  } else if (f.has("rope_scaling")) {
    key = "rope_scaling";
    rope = f.get("rope_scaling");
  }
  f.use("rope_parameters");
  f.use("rope_scaling");
  if (!rope.is_object()) f.fail(key, "must be an object");
  std::set<std::string> used;
  const auto take = [&](const char* k) -> const Json* {
    used.insert(k);
    return rope.contains(k) && !rope[k].is_null() ? &rope[k] : nullptr;
  };
  const auto num = [&](const char* k, double dflt) {
    const Json* v = take(k);
    if (!v) return dflt;
    if (!v->is_number() || !std::isfinite(v->get<double>()))
      f.fail(str_cat(key, ".", k), str_cat("is ", v->dump(), "; it must be a finite number"));
    return v->get<double>();
  };
  const auto text = [&](const char* k) -> std::string {
    const Json* v = take(k);
    if (!v) return std::string();
    if (!v->is_string()) f.fail(str_cat(key, ".", k), str_cat("is ", v->dump(), "; it must be a string"));
    return v->get<std::string>();
  };
  m.rope_theta = num("rope_theta", f.number_or("rope_theta", default_theta));
  std::string type = "default";
  for (const char* k : {"rope_type", "type"}) {
    const std::string t = text(k);
    if (!t.empty()) type = t;
  }
  if (num("partial_rotary_factor", 1.0) != 1.0)
    f.fail(str_cat(key, ".partial_rotary_factor"), "must be 1 (hotpath rotates every pair)");
  if (f.number_or("partial_rotary_factor", 1.0) != 1.0)
    f.fail("partial_rotary_factor", "must be 1 (hotpath rotates every pair)");
  if (type == "yarn") {
    m.rope_scaling_factor = num("factor", 1.0);
    m.rope_beta_fast = num("beta_fast", 32);
    m.rope_beta_slow = num("beta_slow", 1);
    m.rope_original_max_positions =
        num("original_max_position_embeddings", static_cast<double>(max_positions));
    m.rope_truncate = true;
    if (const Json* t = take("truncate")) {
      if (!t->is_boolean())
        f.fail(str_cat(key, ".truncate"), str_cat("is ", t->dump(), "; it must be true or false"));
      m.rope_truncate = t->get<bool>();
    }
    if (rope.contains("attention_factor") && !rope["attention_factor"].is_null()) {
      const double a = num("attention_factor", 0.0);
      const double want =
          m.rope_scaling_factor <= 1 ? 1.0 : 0.1 * std::log(m.rope_scaling_factor) + 1;
      if (std::abs(a - want) > 1e-12)
        f.fail(str_cat(key, ".attention_factor"),
               str_cat("is ", rope["attention_factor"].dump(),
                       "; hotpath's YaRN uses 0.1 ln(factor) + 1 = ", want));
    }
    for (const char* k : {"mscale", "mscale_all_dim"})
      if (num(k, 0.0) != 0)
        f.fail(str_cat(key, ".", k),
               "is not supported (hotpath's YaRN attention factor is "
               "0.1 ln(factor) + 1)");
  } else if (type != "default") {
    f.fail(str_cat(key, ".rope_type"),
           str_cat("is '", type, "'; hotpath implements 'default' and 'yarn' RoPE only"));
  }
  for (auto it = rope.begin(); it != rope.end(); ++it)
    if (!used.count(it.key())) f.fail(str_cat(key, ".", it.key()), "has no hotpath equivalent");
}

// layer_types (or, without it, the architecture's default pattern) to window_layers.
void read_windows(ConfigFields& f, const std::string& arch, ModelConfig& m) {
  std::vector<std::string> types;
  if (f.has("layer_types")) {
    const Json& lt = f.get("layer_types");
    if (!lt.is_array()) f.fail("layer_types", str_cat("is ", lt.dump(), "; it must be a list"));
    for (const auto& t : lt) {
      if (!t.is_string())
        f.fail("layer_types", str_cat("entry ", types.size(), " is ", t.dump(),
                                      "; expected \"sliding_attention\" or \"full_attention\""));
      types.push_back(t.get<std::string>());
    }
    if (static_cast<int>(types.size()) != m.n_layers)
      f.fail("layer_types",
             str_cat("lists ", types.size(), " layers; num_hidden_layers is ", m.n_layers));
  } else {
    f.use("layer_types");
    for (int l = 0; l < m.n_layers; ++l)
      types.push_back(arch == kGptOss && l % 2 == 0 ? "sliding_attention" : "full_attention");
  }
  bool all = true, none = true, even = true;
  for (int l = 0; l < m.n_layers; ++l) {
    const bool s = types[static_cast<size_t>(l)] == "sliding_attention";
    if (!s && types[static_cast<size_t>(l)] != "full_attention")
      f.fail("layer_types", str_cat("entry ", l, " is '", types[static_cast<size_t>(l)],
                                    "'; expected sliding_attention or full_attention"));
    all = all && s;
    none = none && !s;
    even = even && s == (l % 2 == 0);
  }
  if (none) {
    m.window_layers = WindowLayers::kNone;
    f.use("sliding_window");
    return;
  }
  m.window_layers = all ? WindowLayers::kAll : even ? WindowLayers::kEven : WindowLayers::kNone;
  if (!all && !even)
    f.fail("layer_types",
           "mixes sliding and full attention in a pattern hotpath cannot express "
           "(none, all, or even layers sliding)");
  m.sliding_window = static_cast<int>(f.integer("sliding_window", 1, kMaxInt32));
}

// eos_token_id: one id, a list of ids (no single end-of-text id: -1) or absent.
int32_t read_eos(const Json& j, const ConfigFields& f) {
  if (!j.contains("eos_token_id") || j["eos_token_id"].is_null()) return -1;
  const Json& v = j["eos_token_id"];
  const auto id = [&](const Json& x) {
    if (!x.is_number_integer() || (x.is_number_unsigned() && x.get<uint64_t>() > kMaxInt32) ||
        x.get<int64_t>() < 0 || x.get<int64_t>() > kMaxInt32)
      f.fail("eos_token_id", str_cat("is ", v.dump(), "; it must be a token id in [0, ",
                                     kMaxInt32, "] or a list of them"));
    return static_cast<int32_t>(x.get<int64_t>());
  };
  if (v.is_array()) {
    for (const Json& x : v) id(x);
    return v.size() == 1 ? id(v[0]) : -1;
  }
  return id(v);
}
}  // namespace

HfImport read_hf_config(const std::string& dir) {
  const std::string file = (fs::path(dir) / "config.json").string();
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    HP_USER_ERROR(ErrorKind::kData, dir,
                  fs::exists(dir, ec) ? " is not a directory" : " does not exist",
                  " (a Hugging Face checkpoint is a directory with config.json and safetensors)");
  if (!fs::exists(file, ec))
    HP_USER_ERROR(ErrorKind::kData, "the Hugging Face checkpoint directory ", dir,
                  " has no config.json (it needs config.json next to its safetensors)");
  std::ifstream in(file, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in && !in.eof())
    HP_USER_ERROR(ErrorKind::kData, "cannot read ", file,
                  " (import-hf reads a Hugging Face checkpoint directory: config.json and "
                  "safetensors)");
  const Json j = parse_json_strict<Json>(text.data(), text.data() + text.size(), file, 16);
  if (!j.is_object()) HP_USER_ERROR(ErrorKind::kData, file, " is not a JSON object");
  ConfigFields f(j, file);
  HfImport imp;
  std::string arch;
  if (j.contains("architectures") && j["architectures"].is_array() &&
      j["architectures"].size() == 1 && j["architectures"][0].is_string())
    arch = j["architectures"][0].get<std::string>();
  if (arch != kGptOss && arch != kLlama && arch != kQwen3)
    HP_USER_ERROR(ErrorKind::kConfig, file, ": field 'architectures' is ",
                  j.contains("architectures") ? j["architectures"].dump() : "missing",
                  "; hotpath imports [\"", kGptOss, "\"], [\"", kLlama, "\"] or [\"", kQwen3,
                  "\"]");
  imp.architecture = arch;
  ModelConfig& m = imp.model;
  m.vocab_size = static_cast<int>(f.integer("vocab_size", 1, kMaxInt32));
  m.d_model = f.dim("hidden_size");
  m.n_layers = f.dim("num_hidden_layers");
  m.n_heads = f.dim("num_attention_heads");
  m.n_kv_heads = f.dim_or("num_key_value_heads", m.n_heads);
  m.head_dim = f.dim_or("head_dim", std::max(1, m.d_model / m.n_heads));
  m.norm_eps = f.number_or("rms_norm_eps", 1e-6);
  m.init_std = f.number_or("initializer_range", 0.02);
  m.tie_embeddings = f.boolean_or("tie_word_embeddings", false);
  imp.max_positions = f.integer_or("max_position_embeddings", 1, kMaxInt32, 0);
  imp.eot_token = read_eos(j, f);
  f.expect("hidden_act", "silu", "SwiGLU with SiLU");
  f.use("attention_dropout");
  if (f.number_or("attention_dropout", 0.0) != 0.0)
    f.fail("attention_dropout", "must be 0 (hotpath has no dropout)");
  m.attn_bias = f.boolean_or("attention_bias", arch == kGptOss);
  read_rope(f, arch == kGptOss ? 150000.0 : 10000.0, imp.max_positions, m);
  if (arch == kGptOss) {
    m.n_experts = f.dim("num_local_experts");
    m.top_k = f.dim("num_experts_per_tok");
    // The original release's names for two values config.json also gives under their usual ones.
    if (f.has("experts_per_token") && f.dim("experts_per_token") != m.top_k)
      f.fail("experts_per_token", str_cat("is ", j["experts_per_token"].dump(),
                                          " but num_experts_per_tok is ", m.top_k));
    f.use("experts_per_token");
    m.expert_ffn_dim = f.dim("intermediate_size");
    m.activation = Activation::kGptOss;
    m.attn_sinks = true;
    m.swiglu_alpha = f.number_or("swiglu_alpha", 1.702);
    m.swiglu_limit = f.number_or("swiglu_limit", 7.0);
    const bool router_logits = f.boolean_or("output_router_logits", false);
    const double aux = f.number_or("router_aux_loss_coef", 0.0);
    m.moe_aux_coef = router_logits ? aux : 0.0;
    read_windows(f, arch, m);
    if (f.has("initial_context_length") && m.rope_scaling_factor > 1 &&
        f.integer("initial_context_length", 1, kMaxInt32) !=
            static_cast<int64_t>(m.rope_original_max_positions))
      f.fail("initial_context_length", str_cat("is ", j["initial_context_length"].dump(),
                                               " but YaRN's original_max_position_embeddings is ",
                                               m.rope_original_max_positions));
    f.use("initial_context_length");
    if (f.has("quantization_config")) {
      const Json& q = f.get("quantization_config");
      if (!q.is_object() || !q.contains("quant_method") || q["quant_method"] != "mxfp4")
        f.fail("quantization_config",
               str_cat("is ", q.dump(), "; hotpath dequantizes quant_method \"mxfp4\" only"));
      imp.mxfp4 = true;
    }
  } else {
    m.ffn_dim = f.dim("intermediate_size");
    m.activation = Activation::kSwiGLU;
    if (arch == kLlama) {
      f.expect("mlp_bias", false, "the dense FFN has no biases");
      f.expect("pretraining_tp", 1, "tensor-parallel slicing of the projections");
      read_windows(f, arch, m);
    } else {
      m.qk_norm = true;
      if (f.boolean_or("use_sliding_window", false))
        f.fail("use_sliding_window",
               "must be false for Qwen3 (windowed layers from "
               "max_window_layers on are not supported)");
      f.use("max_window_layers");
      f.use("sliding_window");
      read_windows(f, arch, m);
    }
  }
  f.refuse_unused();
  try {
    m.validate();
  } catch (const UserError& e) {
    HP_USER_ERROR(ErrorKind::kConfig, file, " maps to an invalid hotpath model: ", e.what());
  }
  return imp;
}

// ---- tensors --------------------------------------------------------------------------------

namespace {

// [rows, cols] -> [cols, rows].
std::vector<float> transpose(const std::vector<float>& a, int64_t rows, int64_t cols) {
  std::vector<float> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

// nn.Linear weights [out_p, in] side by side as one [in, sum out_p].
std::vector<float> concat_linear(const std::vector<std::vector<float>>& parts,
                                 const std::vector<int64_t>& outs, int64_t in) {
  int64_t total = 0;
  for (int64_t o : outs) total += o;
  std::vector<float> w(static_cast<size_t>(in * total));
  int64_t col0 = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    for (int64_t o = 0; o < outs[p]; ++o)
      for (int64_t i = 0; i < in; ++i) w[i * total + col0 + o] = parts[p][o * in + i];
    col0 += outs[p];
  }
  return w;
}

// The reverse: columns [col0, col0 + out) of [in, total] as nn.Linear [out, in].
std::vector<float> split_linear(const std::vector<float>& w, int64_t in, int64_t total,
                                int64_t col0, int64_t out) {
  std::vector<float> p(static_cast<size_t>(out * in));
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) p[o * in + i] = w[i * total + col0 + o];
  return p;
}

// GPT-OSS gate/up, last axis of `rows` rows of 2F: interleaved (even gate, odd up) <-> halves.
std::vector<float> deinterleave(const std::vector<float>& a, int64_t rows, int64_t f) {
  std::vector<float> b(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < f; ++j) {
      b[r * 2 * f + j] = a[r * 2 * f + 2 * j];
      b[r * 2 * f + f + j] = a[r * 2 * f + 2 * j + 1];
    }
  return b;
}
std::vector<float> interleave(const std::vector<float>& b, int64_t rows, int64_t f) {
  std::vector<float> a(b.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < f; ++j) {
      a[r * 2 * f + 2 * j] = b[r * 2 * f + j];
      a[r * 2 * f + 2 * j + 1] = b[r * 2 * f + f + j];
    }
  return a;
}

}  // namespace

float e2m1_value(uint8_t code) {
  static const float kValues[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = kValues[code & 7];
  return (code & 8) ? -v : v;
}

std::vector<float> mxfp4_dequantize(const uint8_t* blocks, const uint8_t* scales, int64_t experts,
                                    int64_t rows, int64_t groups) {
  const int64_t cols = groups * 32;
  std::vector<float> out(static_cast<size_t>(experts * rows * cols));
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t rg = (e * rows + r) * groups + g;
        const int exp = static_cast<int>(scales[rg]) - 127;
        const uint8_t* b = blocks + rg * 16;
        for (int k = 0; k < 16; ++k) {
          const int64_t c = g * 32 + 2 * k;
          float* dst = out.data() + e * cols * rows;  // [E, cols, rows]
          dst[c * rows + r] = std::ldexp(e2m1_value(b[k] & 0x0f), exp);
          dst[(c + 1) * rows + r] = std::ldexp(e2m1_value(b[k] >> 4), exp);
        }
      }
  return out;
}

HfImport read_hf_checkpoint(const std::string& dir) {
  HfImport imp = read_hf_config(dir);
  SafetensorsSet st(dir);
  const ModelConfig& m = imp.model;
  const int64_t d = m.d_model, hd = m.head_dim, hq = m.n_heads, hkv = m.n_kv_heads;
  const int64_t v = m.vocab_size;
  std::set<std::string> used;
  auto read = [&](const std::string& name, const Shape& shape) {
    used.insert(name);
    return st.read_f32(name, shape);
  };
  auto add = [&](const std::string& name, Shape shape, std::vector<float> data) {
    imp.params.push_back({name, std::move(shape), std::move(data)});
  };
  add("tok_embeddings", {v, d}, read("model.embed_tokens.weight", {v, d}));
  for (int l = 0; l < m.n_layers; ++l) {
    const std::string hf = "model.layers." + std::to_string(l) + ".";
    const std::string pre = "layers." + std::to_string(l) + ".";
    add(pre + "attn_norm", {d}, read(hf + "input_layernorm.weight", {d}));
    const std::vector<int64_t> outs = {hq * hd, hkv * hd, hkv * hd};
    const char* proj[3] = {"q_proj", "k_proj", "v_proj"};
    std::vector<std::vector<float>> w, b;
    for (int p = 0; p < 3; ++p) {
      w.push_back(read(hf + "self_attn." + proj[p] + ".weight", {outs[p], d}));
      if (m.attn_bias) b.push_back(read(hf + "self_attn." + proj[p] + ".bias", {outs[p]}));
    }
    const int64_t qkv = (hq + 2 * hkv) * hd;
    add(pre + "attn.wqkv", {d, qkv}, concat_linear(w, outs, d));
    if (m.attn_bias) {
      std::vector<float> bias;
      for (auto& x : b) bias.insert(bias.end(), x.begin(), x.end());
      add(pre + "attn.bqkv", {qkv}, bias);
    }
    if (m.qk_norm) {
      add(pre + "attn.q_norm", {hd}, read(hf + "self_attn.q_norm.weight", {hd}));
      add(pre + "attn.k_norm", {hd}, read(hf + "self_attn.k_norm.weight", {hd}));
    }
    add(pre + "attn.wo", {hq * hd, d},
        transpose(read(hf + "self_attn.o_proj.weight", {d, hq * hd}), d, hq * hd));
    if (m.attn_bias) add(pre + "attn.bo", {d}, read(hf + "self_attn.o_proj.bias", {d}));
    if (m.attn_sinks) add(pre + "attn.sinks", {hq}, read(hf + "self_attn.sinks", {hq}));
    add(pre + "ffn_norm", {d}, read(hf + "post_attention_layernorm.weight", {d}));
    if (m.is_moe()) {
      const int64_t e = m.n_experts, f = m.expert_ffn_dim;
      add(pre + "moe.wr", {d, e}, transpose(read(hf + "mlp.router.weight", {e, d}), e, d));
      add(pre + "moe.br", {e}, read(hf + "mlp.router.bias", {e}));
      const std::string ex = hf + "mlp.experts.";
      std::vector<float> gu, down;
      if (imp.mxfp4) {
        if (d % 32 != 0 || f % 32 != 0)
          HP_USER_ERROR(ErrorKind::kData,
                        "MXFP4 experts need hidden_size and intermediate_size "
                        "divisible by 32, got ",
                        d, " and ", f);
        for (const char* s :
             {"gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"})
          used.insert(ex + s);
        // E8M0 has no zero and no infinity; 0xFF is its NaN.
        const auto finite_scales = [&](const std::string& name, const std::vector<uint8_t>& s) {
          for (size_t i = 0; i < s.size(); ++i)
            if (s[i] == 0xFF)
              HP_USER_ERROR(ErrorKind::kData, "tensor '", name, "' in ", st.entry(name).file,
                            " holds the E8M0 scale 0xFF (NaN) at flat index ", i,
                            " (MXFP4 scales are 2^(s - 127) for s in [0, 254])");
          return s;
        };
        const auto gb = st.read_u8(ex + "gate_up_proj_blocks", {e, 2 * f, d / 32, 16});
        const auto gs = finite_scales(ex + "gate_up_proj_scales",
                                      st.read_u8(ex + "gate_up_proj_scales", {e, 2 * f, d / 32}));
        gu = mxfp4_dequantize(gb.data(), gs.data(), e, 2 * f, d / 32);
        const auto db = st.read_u8(ex + "down_proj_blocks", {e, d, f / 32, 16});
        const auto ds = finite_scales(ex + "down_proj_scales",
                                      st.read_u8(ex + "down_proj_scales", {e, d, f / 32}));
        down = mxfp4_dequantize(db.data(), ds.data(), e, d, f / 32);
      } else {
        gu = read(ex + "gate_up_proj", {e, d, 2 * f});
        down = read(ex + "down_proj", {e, f, d});
      }
      add(pre + "moe.w1", {e, d, 2 * f}, deinterleave(gu, e * d, f));
      add(pre + "moe.b1", {e, 2 * f},
          deinterleave(read(ex + "gate_up_proj_bias", {e, 2 * f}), e, f));
      add(pre + "moe.w2", {e, f, d}, down);
      add(pre + "moe.b2", {e, d}, read(ex + "down_proj_bias", {e, d}));
    } else {
      const int64_t f = m.ffn_dim;
      std::vector<std::vector<float>> gu = {read(hf + "mlp.gate_proj.weight", {f, d}),
                                            read(hf + "mlp.up_proj.weight", {f, d})};
      add(pre + "mlp.w_gate_up", {d, 2 * f}, concat_linear(gu, {f, f}, d));
      add(pre + "mlp.w_down", {f, d}, transpose(read(hf + "mlp.down_proj.weight", {d, f}), d, f));
    }
  }
  add("final_norm", {d}, read("model.norm.weight", {d}));
  if (!m.tie_embeddings) {
    add("lm_head", {d, v}, transpose(read("lm_head.weight", {v, d}), v, d));
  } else if (st.has("lm_head.weight")) {
    used.insert("lm_head.weight");  // a tied checkpoint may still store the shared table
  }
  for (const std::string& n : st.names())
    if (!used.count(n))
      HP_USER_ERROR(ErrorKind::kData, "tensor '", n, "' in ", st.entry(n).file,
                    " is not part of a ", imp.architecture,
                    " model with this config.json (import-hf maps every tensor or refuses it)");
  return imp;
}

// ---- config files ---------------------------------------------------------------------------

namespace {
std::string num(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}
const char* tf(bool b) { return b ? "true" : "false"; }
}  // namespace

std::string model_config_ini(const ModelConfig& m) {
  std::ostringstream o;
  o << "vocab_size = " << m.vocab_size << "\n"
    << "d_model = " << m.d_model << "\n"
    << "n_layers = " << m.n_layers << "\n"
    << "n_heads = " << m.n_heads << "\n"
    << "n_kv_heads = " << m.n_kv_heads << "\n"
    << "head_dim = " << m.head_dim << "\n"
    << "ffn_dim = " << m.ffn_dim << "\n"
    << "n_experts = " << m.n_experts << "\n"
    << "top_k = " << m.top_k << "\n"
    << "expert_ffn_dim = " << m.expert_ffn_dim << "\n"
    << "sliding_window = " << m.sliding_window << "\n"
    << "window_layers = "
    << (m.window_layers == WindowLayers::kNone   ? "none"
        : m.window_layers == WindowLayers::kEven ? "even"
                                                 : "all")
    << "\n"
    << "attn_sinks = " << tf(m.attn_sinks) << "\n"
    << "attn_bias = " << tf(m.attn_bias) << "\n"
    << "qk_norm = " << tf(m.qk_norm) << "\n"
    << "tie_embeddings = " << tf(m.tie_embeddings) << "\n"
    << "activation = " << (m.activation == Activation::kGptOss ? "gptoss" : "swiglu") << "\n"
    << "swiglu_alpha = " << num(m.swiglu_alpha) << "\n"
    << "swiglu_limit = " << num(m.swiglu_limit) << "\n"
    << "rope_theta = " << num(m.rope_theta) << "\n"
    << "rope_scaling_factor = " << num(m.rope_scaling_factor) << "\n"
    << "rope_original_max_positions = " << num(m.rope_original_max_positions) << "\n"
    << "rope_beta_fast = " << num(m.rope_beta_fast) << "\n"
    << "rope_beta_slow = " << num(m.rope_beta_slow) << "\n"
    << "rope_truncate = " << tf(m.rope_truncate) << "\n"
    << "norm_eps = " << num(m.norm_eps) << "\n"
    << "moe_aux_coef = " << num(m.moe_aux_coef) << "\n"
    << "init_std = " << num(m.init_std) << "\n";
  return o.str();
}

void write_imported_checkpoint(const std::string& path, const HfImport& imp,
                               const std::string& config_text, const std::string& model_record,
                               const std::string& source_dir) {
  // Expert stacks are chunked one expert per chunk, as save_checkpoint writes them.
  const auto chunk_of = [](const NamedTensor& t) {
    for (const char* s : {".moe.w1", ".moe.b1", ".moe.w2", ".moe.b2"}) {
      const std::string suffix(s);
      if (t.name.size() >= suffix.size() &&
          t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix) == 0)
        return int64_t{1};
    }
    return checkpoint_chunk_rows(t.shape, DType::kF32);
  };
  {
    CheckpointWriter w(path, nullptr);
    for (const NamedTensor& t : imp.params)
      w.write_rows("/params/" + t.name, t.shape, DType::kF32, chunk_of(t), RowRange{0, t.shape[0]},
                   t.data.data());
    for (const NamedTensor& t : imp.params) {
      const std::vector<float> zeros(t.data.size(), 0.0f);
      for (const char* moment : {"/m", "/v"})
        w.write_rows("/optim/" + t.name + moment, t.shape, DType::kF32, chunk_of(t),
                     RowRange{0, t.shape[0]}, zeros.data());
    }
    w.write_i64("/state/step", {0}, true);
    w.write_i64("/state/tokens_seen", {0}, true);
    w.write_i64("/state/loader", LoaderState{}.to_vector(), true);
    w.write_i64("/state/seed", {0}, true);
    const std::vector<double> lr(6, 0.0);
    w.write_rows("/state/lr_schedule", {6}, DType::kF64, 6, RowRange{0, 6}, lr.data());
    w.set_attr("format", std::string(kCheckpointFormat));
    w.set_attr("format_version", kCheckpointVersion);
    w.set_attr("hotpath_version", std::string(HOTPATH_VERSION));
    w.set_attr("hdf5_version", hdf5_version_string());
    w.set_attr("config", config_text);
    w.set_attr("command_line", std::string());
    w.set_attr("step", int64_t{0});
    w.set_attr("world", int64_t{1});
    w.set_attr("dp", int64_t{1});
    w.set_attr("ep", int64_t{1});
    w.set_attr("master_dtype", std::string("f32"));
    // The record training checkpoints carry, compared with the run's model config on load (eval,
    // init_from); and where the weights came from, which also marks the file as holding no
    // training state.
    w.set_attr("model_config", model_record);
    w.set_attr("config_fingerprint", static_cast<int64_t>(hash64(model_record)));
    w.set_attr("imported_from", source_dir);
    w.close();
  }
}

// ---- export ---------------------------------------------------------------------------------

std::string hf_config_json(const ModelConfig& m, int64_t max_positions, int32_t eot_token,
                           const std::string& dtype, std::string* architecture) {
  const auto refuse = [](const char* key, const std::string& why) {
    HP_USER_ERROR(ErrorKind::kConfig, "export-hf: config key '", key, "': ", why);
  };
  std::string arch;
  if (m.is_moe()) {
    arch = kGptOss;
    if (m.activation != Activation::kGptOss)
      refuse("activation", "a MoE model exports as GptOss, whose experts use activation=gptoss");
    if (!m.attn_sinks) refuse("attn_sinks", "GptOss has attention sinks: must be true");
    if (m.qk_norm) refuse("qk_norm", "GptOss has no q/k norm: must be false");
  } else {
    arch = m.qk_norm ? kQwen3 : kLlama;
    if (m.activation != Activation::kSwiGLU)
      refuse("activation", "a dense model exports as Llama or Qwen3, which use swiglu");
    if (m.attn_sinks) refuse("attn_sinks", "Llama and Qwen3 have no sinks: must be false");
    if (m.window_layers != WindowLayers::kNone)
      refuse("window_layers", "Llama and Qwen3 export with full attention: must be none");
  }
  if (m.moe_aux_coef < 0) refuse("moe_aux_coef", "must be >= 0");
  Json j;
  j["architectures"] = {arch};
  j["model_type"] = arch == kGptOss ? "gpt_oss" : arch == kQwen3 ? "qwen3" : "llama";
  j["vocab_size"] = m.vocab_size;
  j["hidden_size"] = m.d_model;
  j["num_hidden_layers"] = m.n_layers;
  j["num_attention_heads"] = m.n_heads;
  j["num_key_value_heads"] = m.n_kv_heads;
  j["head_dim"] = m.head_dim;
  j["intermediate_size"] = m.is_moe() ? m.expert_ffn_dim : m.ffn_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = m.norm_eps;
  j["initializer_range"] = m.init_std;
  j["tie_word_embeddings"] = m.tie_embeddings;
  j["attention_bias"] = m.attn_bias;
  j["attention_dropout"] = 0.0;
  j["max_position_embeddings"] = max_positions;
  Json rope;
  rope["rope_theta"] = m.rope_theta;
  if (m.rope_scaling_factor > 1) {
    rope["rope_type"] = "yarn";
    rope["factor"] = m.rope_scaling_factor;
    rope["beta_fast"] = m.rope_beta_fast;
    rope["beta_slow"] = m.rope_beta_slow;
    rope["original_max_position_embeddings"] = static_cast<int64_t>(m.rope_original_max_positions);
    rope["truncate"] = m.rope_truncate;
  } else {
    rope["rope_type"] = "default";
  }
  j["rope_parameters"] = rope;
  if (arch == kGptOss) {
    j["num_local_experts"] = m.n_experts;
    j["num_experts_per_tok"] = m.top_k;
    Json types = Json::array();
    for (int l = 0; l < m.n_layers; ++l)
      types.push_back(m.window_for_layer(l) > 0 ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
    j["sliding_window"] = m.sliding_window > 0 ? m.sliding_window : 128;
    j["swiglu_limit"] = m.swiglu_limit;
    if (m.swiglu_alpha != 1.702) j["swiglu_alpha"] = m.swiglu_alpha;
    j["router_aux_loss_coef"] = m.moe_aux_coef;
    j["output_router_logits"] = m.moe_aux_coef > 0;
  } else if (arch == kLlama) {
    j["mlp_bias"] = false;
  } else {
    j["use_sliding_window"] = false;
  }
  if (eot_token >= 0) j["eos_token_id"] = eot_token;
  j["dtype"] = dtype == "BF16" ? "bfloat16" : "float32";
  *architecture = arch;
  return j.dump(2) + "\n";
}

std::vector<NamedTensor> hf_tensors_from_hotpath(
    const ModelConfig& m, const std::string& arch,
    const std::function<std::vector<float>(const std::string&, const Shape&)>& get) {
  (void)arch;
  const int64_t d = m.d_model, hd = m.head_dim, hq = m.n_heads, hkv = m.n_kv_heads;
  const int64_t v = m.vocab_size;
  std::vector<NamedTensor> out;
  auto add = [&](const std::string& name, Shape shape, std::vector<float> data) {
    out.push_back({name, std::move(shape), std::move(data)});
  };
  add("model.embed_tokens.weight", {v, d}, get("tok_embeddings", {v, d}));
  for (int l = 0; l < m.n_layers; ++l) {
    const std::string hf = "model.layers." + std::to_string(l) + ".";
    const std::string pre = "layers." + std::to_string(l) + ".";
    add(hf + "input_layernorm.weight", {d}, get(pre + "attn_norm", {d}));
    const int64_t qkv = (hq + 2 * hkv) * hd;
    const std::vector<float> w = get(pre + "attn.wqkv", {d, qkv});
    std::vector<float> b;
    if (m.attn_bias) b = get(pre + "attn.bqkv", {qkv});
    const std::vector<int64_t> outs = {hq * hd, hkv * hd, hkv * hd};
    const char* proj[3] = {"q_proj", "k_proj", "v_proj"};
    int64_t col0 = 0;
    for (int p = 0; p < 3; ++p) {
      add(hf + "self_attn." + proj[p] + ".weight", {outs[p], d},
          split_linear(w, d, qkv, col0, outs[p]));
      if (m.attn_bias)
        add(hf + "self_attn." + proj[p] + ".bias", {outs[p]},
            std::vector<float>(b.begin() + col0, b.begin() + col0 + outs[p]));
      col0 += outs[p];
    }
    if (m.qk_norm) {
      add(hf + "self_attn.q_norm.weight", {hd}, get(pre + "attn.q_norm", {hd}));
      add(hf + "self_attn.k_norm.weight", {hd}, get(pre + "attn.k_norm", {hd}));
    }
    add(hf + "self_attn.o_proj.weight", {d, hq * hd},
        transpose(get(pre + "attn.wo", {hq * hd, d}), hq * hd, d));
    if (m.attn_bias) add(hf + "self_attn.o_proj.bias", {d}, get(pre + "attn.bo", {d}));
    if (m.attn_sinks) add(hf + "self_attn.sinks", {hq}, get(pre + "attn.sinks", {hq}));
    add(hf + "post_attention_layernorm.weight", {d}, get(pre + "ffn_norm", {d}));
    if (m.is_moe()) {
      const int64_t e = m.n_experts, f = m.expert_ffn_dim;
      add(hf + "mlp.router.weight", {e, d}, transpose(get(pre + "moe.wr", {d, e}), d, e));
      add(hf + "mlp.router.bias", {e}, get(pre + "moe.br", {e}));
      const std::string ex = hf + "mlp.experts.";
      add(ex + "gate_up_proj", {e, d, 2 * f},
          interleave(get(pre + "moe.w1", {e, d, 2 * f}), e * d, f));
      add(ex + "gate_up_proj_bias", {e, 2 * f}, interleave(get(pre + "moe.b1", {e, 2 * f}), e, f));
      add(ex + "down_proj", {e, f, d}, get(pre + "moe.w2", {e, f, d}));
      add(ex + "down_proj_bias", {e, d}, get(pre + "moe.b2", {e, d}));
    } else {
      const int64_t f = m.ffn_dim;
      const std::vector<float> gu = get(pre + "mlp.w_gate_up", {d, 2 * f});
      add(hf + "mlp.gate_proj.weight", {f, d}, split_linear(gu, d, 2 * f, 0, f));
      add(hf + "mlp.up_proj.weight", {f, d}, split_linear(gu, d, 2 * f, f, f));
      add(hf + "mlp.down_proj.weight", {d, f}, transpose(get(pre + "mlp.w_down", {f, d}), f, d));
    }
  }
  add("model.norm.weight", {d}, get("final_norm", {d}));
  if (!m.tie_embeddings) add("lm_head.weight", {v, d}, transpose(get("lm_head", {d, v}), d, v));
  return out;
}

}  // namespace hp
