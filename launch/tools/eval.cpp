#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include "framework/checkpoint/checkpoint.h"
#include "framework/core/error.h"
#include "launch/hf/safetensors.h"
#include "launch/json.h"
#include "launch/tools/tools.h"
#include "launch/train/evaluation.h"
#include "launch/train/run_checkpoint.h"
#include "launch/train/trainer.h"

namespace hp {
namespace {

namespace fs = std::filesystem;

// --dump_logits: checked before any work, written into a directory of its own next to the
// destination and moved into place at the end, so an existing file is never replaced (unless
// --force) and a failed run leaves nothing behind.
class LogitsDump {
 public:
  LogitsDump(const std::string& path, bool force) : path_(path), force_(force) {
    if (path_.empty()) return;
    std::error_code ec;
    const fs::file_status st = fs::status(path_, ec);
    if (fs::is_directory(st))
      fail("is a directory; name a file (e.g. " +
           (fs::path(path_) / "logits.safetensors").string() + ")");
    if (fs::exists(st) && !force_)
      fail(
          "already exists; hotpath eval does not replace a file it did not create: remove it, "
          "choose another path, or pass --force");
    std::string pattern = path_ + ".XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr)
      fail(std::string("cannot be written: ") + std::strerror(errno));
    staging_ = pattern;
  }
  ~LogitsDump() {
    std::error_code ec;
    if (!staging_.empty()) fs::remove_all(staging_, ec);
  }
  LogitsDump(const LogitsDump&) = delete;
  LogitsDump& operator=(const LogitsDump&) = delete;

  bool enabled() const { return !staging_.empty(); }
  // Where to write the file; commit() moves it to the destination.
  std::string staged() const { return staging_ + "/logits.safetensors"; }

  void commit() {
    const std::string from = staged();
    if (force_) {
      if (std::rename(from.c_str(), path_.c_str()) != 0) fail_io(errno);
      return;
    }
    // link() never replaces: a file that appeared at the destination meanwhile stays.
    if (::link(from.c_str(), path_.c_str()) != 0) {
      if (errno == EEXIST)
        fail(
            "appeared while the evaluation ran; it was not replaced (pass --force to replace "
            "it)");
      // No hard links on this file system: rename, once more making sure nothing is there.
      std::error_code ec;
      if (fs::exists(path_, ec))
        fail(
            "appeared while the evaluation ran; it was not replaced (pass --force to replace "
            "it)");
      if (std::rename(from.c_str(), path_.c_str()) != 0) fail_io(errno);
    }
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    HP_USER_ERROR(ErrorKind::kUser, "hotpath eval: --dump_logits ", path_, " ", why);
  }
  [[noreturn]] void fail_io(int err) const {
    HP_FAIL(ErrorKind::kIo, "hotpath eval: writing --dump_logits ", path_,
            " failed: ", std::strerror(err));
  }

  std::string path_;
  bool force_ = false;
  std::string staging_;  // a directory this run created ("": no dump)
};

}  // namespace

int run_eval(const TrainOptions& o, const RankContext& ctx) {
  if (o.eval.checkpoint.empty())
    HP_USER_ERROR(ErrorKind::kUser, "hotpath eval: --checkpoint FILE (or directory) is required");
  if (!o.eval.dump_logits.empty() && ctx.world() > 1)
    HP_USER_ERROR(ErrorKind::kUser, "hotpath eval: --dump_logits runs on one rank");
  // Before the model is built or anything evaluated: an output that cannot be written fails now.
  LogitsDump dump_file(o.eval.dump_logits, o.eval.force);
  Trainer t(o, ctx);
  // The first --batches global batches of `data` in file order: the batches a training run's
  // evaluation reads from eval_data (launch/train/evaluation.h).
  HeldOutData data(o, o.data.source, "data", ctx.rank(), ctx.world());
  const std::string path = resolve_checkpoint_arg(o.eval.checkpoint);
  std::string error;
  RunPosition loaded;
  if (!load_checkpoint_agreed(t.run_state(), path, true, &loaded, &error))
    HP_USER_ERROR(ErrorKind::kData, "hotpath eval: checkpoint ", path, " cannot be loaded: ",
                  error.empty() ? "it failed on another rank (see its message)" : error);
  Backend& be = t.backend();
  std::vector<float> logits, targets;
  EvalBatchHook dump_batch;
  if (dump_file.enabled())
    dump_batch = [&](const PackedBatch& batch, const BatchMeta& meta) {
      const Tensor l = t.model().logits(meta);
      Tensor h = Tensor::host(l.shape(), l.dtype());
      be.read_to_host(l, h, SyncCause::kOther);
      const std::vector<double> v = to_double_vector(h);
      logits.insert(logits.end(), v.begin(), v.end());
      targets.insert(targets.end(), batch.targets.begin(), batch.targets.end());
    };
  const EvalStats e = evaluate_held_out(t, data, o.eval.batches, dump_batch);
  if (e.targets == 0)
    HP_USER_ERROR(ErrorKind::kData, "hotpath eval: the data has no targets to evaluate");
  if (dump_file.enabled()) {
    const int64_t n = static_cast<int64_t>(targets.size());
    char loss_text[64];
    std::snprintf(loss_text, sizeof loss_text, "%.17g", e.loss);
    write_safetensors(
        dump_file.staged(),
        {{"logits", {n, o.model.vocab_size}, logits.data()}, {"targets", {n}, targets.data()}},
        "F32", {{"loss", loss_text}, {"tokens", std::to_string(e.targets)}});
    dump_file.commit();
  }
  if (ctx.rank() == 0) {
    std::printf("eval_loss=%.6f tokens=%lld\n", e.loss, static_cast<long long>(e.targets));
    if (!o.eval.json.empty()) {
      Json j = Json::object();
      j["checkpoint"] = path;
      j["step"] = CheckpointReader(path).int_attr("step");
      j["batches"] = o.eval.batches;
      j["eval_loss"] = json_number(e.loss);
      j["eval_tokens"] = e.tokens;
      j["eval_targets"] = e.targets;
      j["eval_ms"] = json_number(e.ms);
      write_json_file(o.eval.json, j, "eval_json");
    }
  }
  std::fflush(stdout);
  // Every rank holds the same sums: all of them fail together.
  if (!std::isfinite(e.loss))
    HP_USER_ERROR(ErrorKind::kData, "hotpath eval: the loss of checkpoint ", path,
                  " is not finite (", e.loss,
                  "): its parameters or this config make the model "
                  "diverge");
  return 0;
}

}  // namespace hp
