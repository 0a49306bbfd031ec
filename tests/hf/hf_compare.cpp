// Checks for the Hugging Face tests (tests/hf/CMakeLists.txt):
//
//   hp_hf_compare logits FIXTURE_DIR DUMP --loss_rel R --logit_abs A
//       DUMP (hotpath eval --dump_logits) against the fixture's logits.safetensors [rows, T, V]
//       and reference.json loss: |loss - ref| <= R |ref|, max |logit - ref| <= A.
//   hp_hf_compare params A.h5 B.h5
//       every /params/ dataset of two hotpath checkpoints bitwise equal (same names, shapes).
//   hp_hf_compare sft-data A.h5 B.h5 --vocab V --eot E --docs N --seed S
//       two SFT token files: documents of prompt (mask 0), answer (mask 1), trailer (mask 0) and
//       EOT (mask 0); B differs from A only in the trailer tokens, which no counted target
//       sees or predicts.
//   hp_hf_compare decreases METRICS.jsonl --by D
//       the last step's loss is below the first step's by more than D.
//
// Prints the numbers and "[hp_hf_compare] FAILED ..." with exit status 1 on a mismatch.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "framework/checkpoint/checkpoint.h"
#include "framework/data/token_files.h"
#include "launch/hf/safetensors.h"

namespace {

int fail(const std::string& what) {
  std::printf("[hp_hf_compare] FAILED %s\n", what.c_str());
  return 1;
}

std::vector<float> tensor(const hp::SafetensorsFile& f, const std::string& name, hp::Shape* shape) {
  const auto& e = f.entries().at(name);
  *shape = e.shape;
  std::vector<float> v(static_cast<size_t>(hp::shape_numel(e.shape)));
  std::memcpy(v.data(), f.data(e), v.size() * 4);
  return v;
}

int compare_logits(int argc, char** argv) {
  const std::string dir = argv[2], dump = argv[3];
  double loss_rel = 1e-5, logit_abs = 1e-4;
  for (int i = 4; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--loss_rel") loss_rel = std::atof(argv[i + 1]);
    if (std::string(argv[i]) == "--logit_abs") logit_abs = std::atof(argv[i + 1]);
  }
  std::ifstream rf(dir + "/reference.json");
  const nlohmann::json ref = nlohmann::json::parse(rf);
  const double ref_loss = ref["loss"].get<double>();
  hp::SafetensorsFile want(dir + "/logits.safetensors"), got(dump);
  hp::Shape ws, gs;
  const std::vector<float> w = tensor(want, "logits", &ws), g = tensor(got, "logits", &gs);
  if (w.size() != g.size())
    return fail("logits: " + hp::shape_str(gs) + " dumped, " + hp::shape_str(ws) + " expected");
  const auto& meta = got.entries();
  (void)meta;
  double max_abs = 0;
  for (size_t i = 0; i < w.size(); ++i)
    max_abs = std::max(max_abs, std::abs(static_cast<double>(w[i]) - g[i]));
  // The dump's loss is in its metadata, written with 17 significant digits.
  std::ifstream df(dump, std::ios::binary);
  uint64_t n = 0;
  df.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, ' ');
  df.read(&header[0], static_cast<std::streamsize>(n));
  const double loss =
      std::stod(nlohmann::json::parse(header)["__metadata__"]["loss"].get<std::string>());
  const double rel = std::abs(loss - ref_loss) / std::abs(ref_loss);
  std::printf(
      "loss=%.9f reference=%.9f rel_diff=%.3g (tol %.1g); max |logit diff|=%.3g (tol %.1g)"
      " over %zu logits\n",
      loss, ref_loss, rel, loss_rel, max_abs, logit_abs, w.size());
  if (!(rel <= loss_rel)) return fail("loss");
  if (!(max_abs <= logit_abs)) return fail("logits");
  return 0;
}

int compare_params(char** argv) {
  hp::CheckpointReader a(argv[2]), b(argv[3]);
  int n = 0;
  std::vector<hp::DatasetInfo> da = a.datasets(), db = b.datasets();
  size_t pa = 0, pb = 0;
  for (const auto& d : da) pa += d.name.rfind("/params/", 0) == 0;
  for (const auto& d : db) pb += d.name.rfind("/params/", 0) == 0;
  if (pa != pb)
    return fail("parameter counts differ: " + std::to_string(pa) + " vs " + std::to_string(pb));
  for (const auto& d : da) {
    if (d.name.rfind("/params/", 0) != 0) continue;
    if (!b.has_dataset(d.name)) return fail(d.name + " missing from " + std::string(argv[3]));
    const hp::DatasetInfo e = b.info(d.name);
    if (e.shape != d.shape) return fail(d.name + " shapes differ");
    std::vector<float> x(static_cast<size_t>(hp::shape_numel(d.shape))), y(x.size());
    a.read_rows(d.name, hp::RowRange{0, d.shape[0]}, hp::DType::kF32, x.data());
    b.read_rows(d.name, hp::RowRange{0, d.shape[0]}, hp::DType::kF32, y.data());
    if (std::memcmp(x.data(), y.data(), x.size() * 4) != 0) return fail(d.name + " differs");
    ++n;
  }
  std::printf("%d parameter datasets bitwise equal\n", n);
  return 0;
}

int arg_int(int argc, char** argv, const char* name, int dflt) {
  for (int i = 2; i + 1 < argc; ++i)
    if (std::string(argv[i]) == name) return std::atoi(argv[i + 1]);
  return dflt;
}

int sft_data(int argc, char** argv) {
  const int vocab = arg_int(argc, argv, "--vocab", 96), eot = arg_int(argc, argv, "--eot", 95);
  const int docs = arg_int(argc, argv, "--docs", 16);
  std::mt19937 rng(static_cast<unsigned>(arg_int(argc, argv, "--seed", 1)));
  const auto id = [&] { return static_cast<int32_t>(rng() % static_cast<unsigned>(eot)); };
  std::vector<int32_t> a, b;
  std::vector<uint8_t> mask;
  std::vector<int64_t> offsets{0};
  for (int d = 0; d < docs; ++d) {
    const int prompt = 3 + static_cast<int>(rng() % 4), answer = 4 + static_cast<int>(rng() % 4);
    for (int k = 0; k < prompt + answer; ++k) {
      const int32_t t = id();
      a.push_back(t);
      b.push_back(t);
      mask.push_back(k >= prompt ? 1 : 0);
    }
    for (int k = 0; k < 3; ++k) {  // the trailer: different ids in B
      a.push_back(id());
      b.push_back(id());
      mask.push_back(0);
    }
    a.push_back(eot);
    b.push_back(eot);
    mask.push_back(0);
    offsets.push_back(static_cast<int64_t>(a.size()));
  }
  (void)vocab;
  hp::write_h5_tokens(argv[2], a, offsets, &mask);
  hp::write_h5_tokens(argv[3], b, offsets, &mask);
  std::printf("wrote %s and %s: %d documents, %zu tokens\n", argv[2], argv[3], docs, a.size());
  return 0;
}

int decreases(int argc, char** argv) {
  double by = 0;
  for (int i = 3; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--by") by = std::atof(argv[i + 1]);
  std::ifstream f(argv[2]);
  std::vector<double> losses;
  for (std::string line; std::getline(f, line);)
    if (!line.empty()) losses.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  if (losses.size() < 2) return fail(std::string(argv[2]) + " holds fewer than 2 steps");
  std::printf("loss first=%.6f last=%.6f over %zu steps (must drop by more than %g)\n",
              losses.front(), losses.back(), losses.size(), by);
  return losses.back() < losses.front() - by ? 0 : fail("the loss did not drop");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc >= 4 && std::string(argv[1]) == "sft-data") return sft_data(argc, argv);
    if (argc >= 3 && std::string(argv[1]) == "decreases") return decreases(argc, argv);
    if (argc >= 4 && std::string(argv[1]) == "logits") return compare_logits(argc, argv);
    if (argc == 4 && std::string(argv[1]) == "params") return compare_params(argv);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  std::fprintf(stderr,
               "usage: hp_hf_compare logits FIXTURE DUMP [--loss_rel R --logit_abs A] | "
               "params A.h5 B.h5\n");
  return 2;
}
