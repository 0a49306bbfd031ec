#include <boost/program_options.hpp>
#include <iostream>

#include "framework/core/error.h"
#include "framework/core/log.h"
#include "framework/data/loader.h"
#include "framework/data/token_files.h"
#include "launch/tools/tools.h"

namespace po = boost::program_options;

namespace hp {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

int synth_main(const std::vector<std::string>& args) {
  std::string out;
  int64_t docs = 1000;
  DataConfig d;
  d.vocab_size = 64;
  po::options_description opts("hotpath data synth");
  opts.add_options()("help,h", "print this help")(
      "out", po::value(&out), "output file: .bin (llm.c token shard) or .h5 (HDF5 tokens)")(
      "docs", po::value(&docs)->default_value(docs), "number of documents")(
      "vocab_size", po::value(&d.vocab_size)->default_value(d.vocab_size), "vocabulary size")(
      "eot_token", po::value(&d.eot_token)->default_value(-1), "EOT id (-1: vocab_size - 1)")(
      "synthetic_vocab", po::value(&d.synthetic_vocab)->default_value(0),
      "content tokens (0: vocab_size - 1)")(
      "synthetic_zipf", po::value(&d.synthetic_zipf)->default_value(d.synthetic_zipf),
      "Zipf exponent")(
      "synthetic_mean_doc_len",
      po::value(&d.synthetic_mean_doc_len)->default_value(d.synthetic_mean_doc_len),
      "mean document length")("seed", po::value(&d.seed)->default_value(0), "seed");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(args).options(opts).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    HP_USER_ERROR(ErrorKind::kUser, "hotpath data synth: ", e.what());
  }
  if (vm.count("help")) {
    std::cout << "usage: hotpath data synth --out FILE.{bin,h5} [options]\n" << opts << "\n";
    return 0;
  }
  if (out.empty()) HP_USER_ERROR(ErrorKind::kUser, "hotpath data synth: --out FILE is required");
  if (docs < 1) HP_USER_ERROR(ErrorKind::kUser, "hotpath data synth: --docs must be >= 1");
  if (d.eot_token < 0) d.eot_token = static_cast<int32_t>(d.vocab_size - 1);
  if (d.synthetic_vocab == 0) d.synthetic_vocab = d.vocab_size - 1;
  if (d.vocab_size > 65536 && ends_with(out, ".bin"))
    HP_USER_ERROR(ErrorKind::kUser,
                  "hotpath data synth: .bin shards hold uint16 tokens; "
                  "vocab_size must be <= 65536, got ",
                  d.vocab_size);
  d.seq_len = 2;
  d.rows_per_batch = 1;
  std::vector<std::vector<int32_t>> documents = synthetic_documents(d, docs);
  int64_t tokens = 0;
  for (const auto& doc : documents) tokens += static_cast<int64_t>(doc.size());
  if (ends_with(out, ".bin")) {
    std::vector<int32_t> flat;
    flat.reserve(static_cast<size_t>(tokens));
    for (const auto& doc : documents) flat.insert(flat.end(), doc.begin(), doc.end());
    write_bin_shard(out, flat);
  } else if (ends_with(out, ".h5") || ends_with(out, ".hdf5")) {
    write_h5_tokens(out, documents);
  } else {
    HP_USER_ERROR(ErrorKind::kUser, "hotpath data synth: --out '", out,
                  "' must end in .bin or .h5");
  }
  std::cout << "wrote " << out << ": " << docs << " documents, " << tokens << " tokens\n";
  return 0;
}

}  // namespace

int data_tool_main(const std::vector<std::string>& args) {
  if (args.empty() || args[0] != "synth") {
    std::cerr << "usage: hotpath data synth --out FILE.{bin,h5} [--docs N] [--vocab_size V] ...\n";
    return 2;
  }
  return synth_main(std::vector<std::string>(args.begin() + 1, args.end()));
}

}  // namespace hp
