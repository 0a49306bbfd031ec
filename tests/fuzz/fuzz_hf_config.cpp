// libFuzzer harness of the config.json mapping: the input is a Hugging Face config.json,
// read as import-hf and init_from read it (read_hf_config: every field's JSON type and range,
// RoPE, layer types, the architecture's fixed values, duplicate keys), and a config it maps is
// then written back as hotpath config lines and exported as a config.json again, which must be
// importable and map to the same shapes and RoPE base.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "launch/hf/hf_convert.h"
#include "tests/fuzz/fuzz_common.h"

namespace {

// A directory per process holding config.json, rewritten for every input (in /dev/shm where it
// exists), removed at exit.
class ScratchDir {
 public:
  ScratchDir() {
    const char* base = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    path_ = std::string(base) + "/hotpath-fuzz-hfcfg-" + std::to_string(::getpid());
    ::mkdir(path_.c_str(), 0700);
  }
  ~ScratchDir() {
    ::unlink((path_ + "/config.json").c_str());
    ::rmdir(path_.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  hp::fuzz::quiet_logs();
  static const ScratchDir scratch;
  const std::string& dir = scratch.path();
  hp::fuzz::write_file(dir + "/config.json", data, size);
  hp::fuzz::expect_clean([&] {
    const hp::HfImport imp = hp::read_hf_config(dir);
    const std::string ini = hp::model_config_ini(imp.model);
    HP_FUZZ_REQUIRE(!ini.empty());
    // Export of what was imported: refused only for models no architecture expresses.
    std::string arch;
    std::string json;
    try {
      json = hp::hf_config_json(imp.model, imp.max_positions > 0 ? imp.max_positions : 4096,
                                imp.eot_token, "F32", &arch);
    } catch (const hp::UserError& e) {
      hp::fuzz::note(e.what());
      return;
    }
    hp::fuzz::write_file(dir + "/config.json", reinterpret_cast<const uint8_t*>(json.data()),
                         json.size());
    const hp::HfImport again = hp::read_hf_config(dir);
    const hp::ModelConfig& a = imp.model;
    const hp::ModelConfig& b = again.model;
    HP_FUZZ_REQUIRE(a.vocab_size == b.vocab_size && a.d_model == b.d_model &&
                    a.n_layers == b.n_layers && a.n_heads == b.n_heads &&
                    a.n_kv_heads == b.n_kv_heads && a.head_dim == b.head_dim &&
                    a.ffn_dim == b.ffn_dim && a.n_experts == b.n_experts && a.top_k == b.top_k &&
                    a.expert_ffn_dim == b.expert_ffn_dim && a.rope_theta == b.rope_theta &&
                    a.tie_embeddings == b.tie_embeddings && a.attn_bias == b.attn_bias);
  });
  return 0;
}
