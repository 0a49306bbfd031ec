#include "launch/train/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <sstream>

#include "framework/core/error.h"
#include "launch/json.h"

namespace hp {
namespace {

Json number(double v) { return json_number(v); }

Json syncs_json(const SyncCounter& c) {
  Json j = Json::object();
  for (int i = 0; i < kNumSyncCauses; ++i) {
    const auto cause = static_cast<SyncCause>(i);
    j[sync_cause_name(cause)] = c.get(cause);
  }
  return j;
}

Json copies_json(const LinkArbiterStats& c) {
  Json j = Json::object();
  j["arbiter"] = c.shared() ? "node" : "local";
  for (int d = 0; d < 2; ++d) {
    const std::string n = copy_direction_name(static_cast<CopyDirection>(d));
    j[n + "_bytes"] = c.bytes[d];
    j[n + "_chunks"] = c.chunks[d];
    j[n + "_wait_s"] = number(c.wait_s[d]);
    j[n + "_max_wait_s"] = number(c.max_wait_s[d]);
  }
  j["active_s"] = number(c.active_s);
  j["gbps"] = number(c.achieved_gbps());
  if (c.shared()) {
    j["link_ranks"] = c.link_ranks;
    j["link_bytes"] = c.link_bytes;
    j["jain"] = number(c.link_jain);
  }
  return j;
}

std::string copies_log_fields(const LinkArbiterStats& c) {
  std::string out = str_cat(" link_mib=r", fmt_sig(c.bytes[0] / 1048576.0, 4), "/o",
                            fmt_sig(c.bytes[1] / 1048576.0, 4),
                            " link_wait_ms=", fmt_sig(1e3 * (c.wait_s[0] + c.wait_s[1]), 3), "/max",
                            fmt_sig(1e3 * std::max(c.max_wait_s[0], c.max_wait_s[1]), 3),
                            " link_gbps=", fmt_sig(c.achieved_gbps(), 3));
  if (c.shared()) out += " jain=" + fmt_sig(c.link_jain, 4);
  return out;
}

}  // namespace

std::string fmt_sig(double v, int prec) {
  std::ostringstream os;
  os << std::setprecision(prec) << v;
  return os.str();
}

std::string step_log_line(const StepStats& s, bool moe) {
  return str_cat("step=", s.step, " loss=", fmt_sig(s.loss),
                 moe ? " aux_loss=" + fmt_sig(s.aux_loss) : "", " lr=", fmt_sig(s.lr, 3),
                 " grad_norm=", fmt_sig(s.grad_norm, 3), " tok/s=", fmt_sig(s.tokens_per_s, 5),
                 " pad=", fmt_sig(100 * s.padding, 3), "%", " ms=", fmt_sig(s.ms, 4), s.mfu > 0 ? " mfu=" + fmt_sig(100 * s.mfu, 3) + "%" : "",
                 " syncs=", s.syncs.total(),
                 s.skipped_steps > 0 ? str_cat(" skipped=", s.skipped_steps) : "",
                 s.copies ? copies_log_fields(*s.copies) : "",
                 s.eval ? " eval_loss=" + fmt_sig(s.eval->loss, 6) : "");
}

std::string step_json(const StepStats& s, bool moe) {
  Json j = Json::object();
  j["step"] = s.step;
  j["loss"] = number(s.loss);
  if (moe) j["aux_loss"] = number(s.aux_loss);
  j["lr"] = number(s.lr);
  j["grad_norm"] = number(s.grad_norm);
  if (!s.finite) j["finite"] = false;
  if (s.skipped) j["skipped"] = true;
  if (s.skipped_steps > 0) j["skipped_steps"] = s.skipped_steps;
  j["tokens_per_s"] = number(s.tokens_per_s);
  if (s.mfu > 0) j["mfu"] = number(s.mfu);
  j["ms"] = number(s.ms);
  j["tokens"] = s.tokens;
  j["positions"] = s.positions;
  j["padding"] = number(s.padding);
  j["flops"] = number(s.model_flops);
  if (s.eval) {
    j["eval_loss"] = number(s.eval->loss);
    j["eval_tokens"] = s.eval->tokens;
    j["eval_ms"] = number(s.eval->ms);
  }
  j["syncs"] = syncs_json(s.syncs);
  Json opt = Json::object();
  opt["dense"] = s.optimizer_state_bytes_dense;
  opt["expert"] = s.optimizer_state_bytes_expert;
  j["optimizer_state_bytes"] = opt;
  if (s.copies) j["link"] = copies_json(*s.copies);
  if (!s.checkpoints.empty()) {
    Json list = Json::array();
    for (const CheckpointReport& c : s.checkpoints) {
      Json o;
      o["step"] = c.step;
      o["async"] = c.async;
      o["stall_ms"] = number(c.stall_ms);
      o["wait_ms"] = number(c.wait_ms);
      o["write_ms"] = number(c.write_ms);
      o["bytes"] = c.bytes;
      o["committed_after_step"] = c.committed_after_step;
      list.push_back(o);
    }
    j["checkpoints"] = list;
  }
  return j.dump();
}

namespace {
// The step of one metrics line, or -1 when it is not a complete object with a step.
int64_t step_of_line(const std::string& line) {
  if (line.size() < 2 || line.front() != '{' || line.back() != '}') return -1;
  const Json j = Json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number_integer())
    return -1;
  return j["step"].get<int64_t>();
}
}  // namespace

MetricsWriter::MetricsWriter(const std::string& path, int64_t resumed_step) {
  if (path.empty()) return;
  std::ifstream old(path);
  if (resumed_step > 0 && old) {
    std::string kept, line;
    while (std::getline(old, line)) {
      if (line.empty()) continue;
      const int64_t s = step_of_line(line);
      if (s >= 1 && s <= resumed_step) {
        kept += line + "\n";
        ++kept_;
      } else {
        ++dropped_;
      }
    }
    old.close();
    if (dropped_ > 0) {
      const std::string tmp = path + ".tmp";
      {
        std::ofstream t(tmp, std::ios::trunc);
        t << kept;
        t.close();
        if (!t)
          HP_USER_ERROR(ErrorKind::kConfig, "config key 'metrics_path': cannot write '", tmp, "'");
      }
      if (std::rename(tmp.c_str(), path.c_str()) != 0)
        HP_USER_ERROR(ErrorKind::kConfig, "config key 'metrics_path': cannot replace '", path, "'");
    }
    out_.open(path, std::ios::app);
  } else {
    out_.open(path, std::ios::trunc);
  }
  if (!out_)
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'metrics_path': cannot write '", path, "'");
}

void MetricsWriter::write(const StepStats& s, bool moe) {
  if (!out_.is_open()) return;
  out_ << step_json(s, moe) << "\n" << std::flush;
}

}  // namespace hp
