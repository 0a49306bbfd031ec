// Checks before a run starts: outputs that cannot be written and CPU batches that cannot fit are
// refused naming the key; a metrics file keeps its history across a resume.
#include "launch/train/preflight.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "framework/core/error.h"
#include "launch/train/metrics.h"
#include "tests/common/launch_fixtures.h"

namespace fs = std::filesystem;

namespace hp {
namespace {

TrainOptions tiny() { return test::small_dense_options(); }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d =
      fs::temp_directory_path() / ("hotpath_preflight_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

TEST(Preflight, CpuMemoryNamesBatchTokensOrTheModel) {
  TrainOptions o = tiny();
  const int64_t gib = int64_t{1} << 30;
  EXPECT_EQ(error_of([&] { check_cpu_memory(o, 1, 1, gib); }), "");
  o.data.batch_tokens = int64_t{1} << 24;  // 16M tokens x 32 x 4 B x 8 per token: 16 GiB
  const std::string m = error_of([&] { check_cpu_memory(o, 1, 1, gib); });
  EXPECT_NE(m.find("config key 'batch_tokens'"), std::string::npos) << m;
  // Spread over more ranks of other machines it fits; more ranks on this one need more.
  EXPECT_EQ(error_of([&] { check_cpu_memory(o, 64, 1, gib); }), "");
  EXPECT_NE(error_of([&] { check_cpu_memory(o, 64, 64, gib); }).find("batch_tokens"),
            std::string::npos);
  TrainOptions big = tiny();
  big.model.vocab_size = 1 << 24;
  big.model.d_model = 4096;
  big.model.head_dim = 2048;
  const std::string mb = error_of([&] { check_cpu_memory(big, 1, 1, gib); });
  EXPECT_NE(mb.find("the model (vocab_size, d_model"), std::string::npos) << mb;
}

TEST(Preflight, OutputsThatAreNotWritableAreNamed) {
  const fs::path dir = fresh_dir("outputs");
  const fs::path file = dir / "a_file";
  std::ofstream(file) << "x";
  TrainOptions o = tiny();
  o.checkpoint.dir = file.string();
  EXPECT_NE(error_of([&] {
              check_outputs_writable(o, "train", 0);
            }).find("'checkpoint_dir': cannot write"),
            std::string::npos);
  o.checkpoint.dir = (file / "sub").string();
  EXPECT_NE(error_of([&] { check_outputs_writable(o, "train", 0); }).find("'checkpoint_dir'"),
            std::string::npos);
  o.checkpoint.dir = (dir / "new" / "ckpt").string();
  o.run.metrics_path = (dir / "m" / "metrics.jsonl").string();
  EXPECT_EQ(error_of([&] { check_outputs_writable(o, "train", 0); }), "");
  EXPECT_TRUE(fs::is_directory(o.checkpoint.dir));
  EXPECT_TRUE(fs::is_empty(o.checkpoint.dir));   // the probe is gone
  EXPECT_FALSE(fs::exists(o.run.metrics_path));  // created by the check, removed again
  EXPECT_TRUE(fs::is_directory(dir / "m"));
  o.run.metrics_path = dir.string();
  EXPECT_NE(error_of([&] { check_outputs_writable(o, "train", 0); }).find("'metrics_path'"),
            std::string::npos);
  // Rank 1 does not write the metrics: it does not check them.
  EXPECT_EQ(error_of([&] { check_outputs_writable(o, "train", 1); }), "");
  o.run.metrics_path.clear();
  o.bench.json = dir.string();
  EXPECT_NE(error_of([&] { check_outputs_writable(o, "bench", 0); }).find("'bench_json'"),
            std::string::npos);
}

std::vector<std::string> lines_of(const fs::path& p) {
  std::ifstream f(p);
  std::vector<std::string> out;
  for (std::string l; std::getline(f, l);) out.push_back(l);
  return out;
}

TEST(Preflight, MetricsKeepTheirHistoryOnResume) {
  const fs::path dir = fresh_dir("metrics");
  const std::string path = (dir / "m.jsonl").string();
  {
    std::ofstream f(path);
    for (int s = 1; s <= 5; ++s) f << "{\"step\":" << s << ",\"loss\":1.5}\n";
    f << "{\"step\":6,\"lo";  // torn by a kill
  }
  {
    MetricsWriter w(path, 3);
    EXPECT_EQ(w.kept(), 3);
    EXPECT_EQ(w.dropped(), 3);
    StepStats s;
    s.step = 4;
    w.write(s, false);
  }
  std::vector<std::string> lines = lines_of(path);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[2], "{\"step\":3,\"loss\":1.5}");
  EXPECT_EQ(lines[3].rfind("{\"step\":4,", 0), 0u) << lines[3];
  // A fresh run starts the file anew.
  { MetricsWriter w(path, 0); }
  EXPECT_TRUE(lines_of(path).empty());
}

}  // namespace
}  // namespace hp
